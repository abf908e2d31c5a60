"""The policy core shared by both backends: model, located validation, live reload."""

from .loader import PolicyError, PolicyIssue, load_policy, parse_policy
from .model import Flavor, IdleRules, Policy, PriorityClass, Profile, Team

__all__ = [
    "Flavor",
    "IdleRules",
    "Policy",
    "PolicyError",
    "PolicyIssue",
    "PolicyStore",
    "PriorityClass",
    "Profile",
    "Team",
    "load_policy",
    "parse_policy",
]


def __getattr__(name: str):
    # The live store (asyncio, traitlets) is imported on first use: `gpuhub validate` and the
    # other commands that only read a file do not pay for it (docs/benchmarks.md).
    if name == "PolicyStore":
        from .store import PolicyStore

        return PolicyStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
