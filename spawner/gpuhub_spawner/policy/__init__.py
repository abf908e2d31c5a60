"""The policy core shared by both backends: model, located validation, live reload."""

from .loader import PolicyError, PolicyIssue, load_policy, parse_policy
from .model import Flavor, IdleRules, Policy, PriorityClass, Profile, Team
from .store import PolicyStore

__all__ = [
    "Flavor", "IdleRules", "Policy", "PolicyError", "PolicyIssue", "PolicyStore",
    "PriorityClass", "Profile", "Team", "load_policy", "parse_policy",
]
