"""An off-boarded user's MLflow experiments (hub/offboarding.py; docs/runbooks/offboarding.md).

The hub reaches the MLflow server it manages as MLflow's admin, the way the MLflow service
does: the server's address from the service's ``upstream.json`` and the admin password derived
from the service key (both in the service's state directory, 0700, the hub's user's own).
A leaver's experiments are those their account holds MANAGE on directly (MLflow grants the
creator MANAGE on create); team roles' READ grants are not theirs.

- ``lead``: each lead gets MANAGE on each experiment (their MLflow account is made first if
  they never used MLflow); the leaver's own grant stays, unusable (their hub tokens are gone
  and their login is refused).
- ``read-only``: the leaver's MANAGE becomes READ, so nothing can write as them; teammates keep
  reading through their team's role.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlsplit

from .accounts import Accounts, MlflowApiError
from .secrets import KEY_FILE, Passwords
from .upstream import ADMIN_USERNAME

SYNTHETIC_ROLE = "__user_"  # MLflow's per-user role that direct grants live in


def admin_accounts(state_dir: str | Path) -> Accounts | None:
    """MLflow's admin API for the server the service in ``state_dir`` runs; None when it has
    not started one yet (no ``upstream.json``) or fronts an external server it has no key for."""
    state = Path(state_dir)
    try:
        upstream = json.loads((state / "upstream.json").read_text())["url"]
        key = (state / KEY_FILE).read_bytes().strip()
    except (OSError, ValueError, KeyError):
        return None
    passwords = Passwords(key)
    return Accounts(upstream, ADMIN_USERNAME, passwords.admin(), passwords, host_header=urlsplit(upstream).netloc)


async def experiments_of(accounts: Accounts, username: str) -> list[str]:
    """The experiment ids ``username`` manages directly (those they created); [] without an account."""
    if await accounts.get_user(username) is None:
        return []
    rows = (await accounts.call("GET", "3.0/mlflow/users/permissions/list", {"username": username})).get("permissions", [])
    return sorted(
        {
            str(r["resource_pattern"])
            for r in rows
            if r.get("resource_type") == "experiment"
            and r.get("permission") == "MANAGE"
            and str(r.get("role_name", "")).startswith(SYNTHETIC_ROLE)
            and r.get("resource_pattern") != "*"
        },
        key=lambda e: (len(e), e),
    )


async def grant(accounts: Accounts, username: str, experiment_id: str, permission: str) -> None:
    """``username`` holds exactly ``permission`` on the experiment directly (idempotent)."""
    body = {"username": username, "resource_type": "experiment", "resource_id": experiment_id, "permission": permission}
    try:
        await accounts.call("POST", "3.0/mlflow/users/permissions/grant", body=body)
    except MlflowApiError as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        await accounts.call(
            "POST",
            "3.0/mlflow/users/permissions/revoke",
            body={"username": username, "resource_type": "experiment", "resource_id": experiment_id},
        )
        await accounts.call("POST", "3.0/mlflow/users/permissions/grant", body=body)


async def hand_over(accounts: Accounts, username: str, mode: str, leads: dict[str, tuple[str, ...]]) -> str:
    """Apply ``mode`` (``lead`` or ``read-only``) to ``username``'s experiments; ``leads``: each
    lead's hub name and teams. Returns what was done, in words."""
    experiments = await experiments_of(accounts, username)
    if not experiments:
        return "no MLflow experiments of theirs"
    if mode == "lead":
        if not leads:
            mode = "read-only"  # nobody to hand them to: keep them, read-only
        else:
            for lead, teams in sorted(leads.items()):
                await accounts.ensure_user(lead, teams)
                for exp in experiments:
                    await grant(accounts, lead, exp, "MANAGE")
            return f"handed {len(experiments)} experiment(s) ({', '.join(experiments)}) to their lead(s) {', '.join(sorted(leads))}: MANAGE"
    for exp in experiments:
        await grant(accounts, username, exp, "READ")
    why = " (their team has no lead in the policy)" if not leads else ""
    return f"kept {len(experiments)} experiment(s) ({', '.join(experiments)}) read-only{why}"
