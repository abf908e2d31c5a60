"""Warnings about a *valid* policy that cannot keep its promises where it runs.

Validation (``loader``) refuses what is wrong in the file itself. These checks need a fact
from outside it — how many GPUs of a flavor this machine has, how often JupyterHub hears
about activity — and so are warnings an admin sees (``gpuhub validate``, the hub's log and
status page) rather than refusals: the policy still loads and serves.

- **Quota beyond the machine.** Nominal quota is a guarantee (a lender gets it back by
  reclaim). A team promised 8 A100 on a machine with 3 sees "quota of 8", and when the
  teams' guarantees add up to more than the machine has, some of them can never be given
  back.
- **A warning shorter than the activity report interval.** A user who comes back during the
  warning is seen only at the next activity report; a warning shorter than that interval
  can stop a server whose user already returned.
"""

from __future__ import annotations

from .model import Policy
from .quantities import format_duration


def capacity_warnings(policy: Policy, capacity: dict[str, int]) -> list[str]:
    """``capacity``: GPUs per flavor on this machine (flavors absent from it are not checked)."""
    out = []
    for flavor in policy.flavors:
        if flavor.name not in capacity:
            continue
        have = capacity[flavor.name]
        label = flavor.display_name or flavor.name
        total = 0
        for team in policy.teams:
            quota = team.quota.gpus.get(flavor.name)
            if quota is None:
                continue
            total += quota.nominal
            if quota.nominal > have:
                out.append(
                    f"teams[{team.name}].quota.gpus.{flavor.name}: a nominal quota of {quota.nominal} {label} "
                    f"but this machine has {have}: {team.display_name or team.name} is promised GPUs that do not exist"
                )
        if total > have:
            out.append(
                f"flavor {flavor.name}: the teams' nominal quotas add up to {total} {label} but this machine has "
                f"{have}: guaranteed GPUs lent to other teams cannot all be reclaimed"
            )
    return out


def warning_interval_warnings(policy: Policy, activity_interval: float) -> list[str]:
    """Profiles whose effective ``idle.warning`` is shorter than ``activity_interval`` seconds."""
    out = []
    for profile in policy.profiles:
        rules = policy.idle_rules(profile)
        if rules.warning is None or not (rules.timeout or rules.gpu_idle_timeout or rules.max_age):
            continue
        if rules.warning < activity_interval:
            out.append(
                f"profiles[{profile.slug}].idle.warning: {format_duration(rules.warning)} is shorter than JupyterHub's "
                f"activity report interval ({format_duration(activity_interval)}): a user who comes back during the "
                f"warning may not be seen before the stop"
            )
    return out
