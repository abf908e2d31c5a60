"""MLflow accounts that mirror hub users, and team roles that mirror policy teams.

All calls use MLflow's own admin REST API (basic-auth app of MLflow 3.17):
``/api/2.0/mlflow/users/{create,get,update-password,delete,list}`` and the RBAC
roles API under ``/api/3.0/mlflow/roles/...``. The hub username is the MLflow
username; the password is derived from the service key (see ``secrets.py``).

Team sharing: each team is an MLflow role ``team-<name>`` in the ``default``
workspace. Members are assigned on their first request (and re-synced when their
hub groups change); every experiment a member creates through the service gets a
READ grant for each of the creator's teams. Everything else stays private to its
owner (``default_permission = NO_PERMISSIONS``).

Viewers (policy ``roles.viewers``, in no team) hold the role ``gpuhub-viewers``: READ on
every experiment. MLflow's READ includes artifacts, which only the proxy keeps from
them, and only while they are viewer-only; so the role is re-synced with the user's
standing on every request (``ensure_user(..., viewer)``): assigned while viewer-only,
taken away as soon as they are not.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from dataclasses import dataclass
from urllib.parse import urlencode

from tornado.httpclient import AsyncHTTPClient, HTTPRequest

log = logging.getLogger("JupyterHub.gpuhub.mlflow")

TEAM_ROLE_PREFIX = "team-"
# Viewers (policy roles.viewers): READ on every experiment; the proxy keeps them off
# artifacts and writes (mlflow/proxy.py, VIEWER_*).
VIEWER_ROLE = "gpuhub-viewers"
WORKSPACE = "default"


class MlflowApiError(Exception):
    def __init__(self, method: str, path: str, code: int, body: str):
        self.code = code
        self.body = body
        super().__init__(f"MLflow {method} {path} answered {code}: {body[:300]}")

    @property
    def error_code(self) -> str:
        try:
            return json.loads(self.body).get("error_code", "")
        except (ValueError, AttributeError):
            return ""


def basic_auth(username: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()


@dataclass
class _Synced:
    teams: tuple[str, ...]
    viewer: bool
    at: float


class Accounts:
    """Provision, re-sync and delete per-user MLflow accounts through the admin API."""

    def __init__(
        self,
        base_url: str,
        admin_username: str,
        admin_password: str,
        passwords,
        host_header: str | None = None,
        resync_after: float = 300.0,
    ):
        self.base_url = base_url.rstrip("/")
        self.admin_username = admin_username
        self._admin_auth = basic_auth(admin_username, admin_password)
        self.passwords = passwords
        self.host_header = host_header
        self.resync_after = resync_after
        self._synced: dict[str, _Synced] = {}
        self._role_ids: dict[str, int] = {}
        self.client = AsyncHTTPClient()

    def __repr__(self) -> str:
        return f"Accounts({self.base_url!r})"

    def user_auth(self, username: str) -> str:
        return basic_auth(username, self.passwords.user(username))

    async def call(
        self, method: str, path: str, params: dict | None = None, body: dict | None = None, auth: str | None = None
    ) -> dict:
        url = f"{self.base_url}/api/{path}"
        if params:
            url += "?" + urlencode(params, doseq=True)
        headers = {"Authorization": auth or self._admin_auth}
        if self.host_header:
            headers["Host"] = self.host_header
        data = None
        if body is not None:
            headers["Content-Type"] = "application/json"
            data = json.dumps(body)
        req = HTTPRequest(url, method=method, headers=headers, body=data, request_timeout=30)
        r = await self.client.fetch(req, raise_error=False)
        text = r.body.decode(errors="replace") if r.body else ""
        if r.code >= 400 or r.code == 599:
            raise MlflowApiError(method, path, r.code, text or str(r.error))
        return json.loads(text) if text.strip() else {}

    # -- users -----------------------------------------------------------------------
    async def get_user(self, username: str) -> dict | None:
        try:
            return (await self.call("GET", "2.0/mlflow/users/get", {"username": username}))["user"]
        except MlflowApiError as e:
            if e.code == 404 or e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise

    async def list_usernames(self) -> set[str]:
        users = (await self.call("GET", "2.0/mlflow/users/list")).get("users", [])
        return {u["username"] for u in users}

    async def ensure_user(self, username: str, teams: tuple[str, ...], viewer: bool = False) -> None:
        """Make sure ``username`` exists with its derived password, its team roles and the
        viewers' role exactly when ``viewer`` (viewer-only now).

        Cheap when nothing changed: MLflow is asked again only when the teams or the
        viewer standing differ from the last sync (or after ``resync_after``, or once
        after a restart of the service, which catches changes made while it was down).
        """
        synced = self._synced.get(username)
        if synced and synced.teams == teams and synced.viewer == viewer and time.monotonic() - synced.at < self.resync_after:
            return
        password = self.passwords.user(username)
        if await self.get_user(username) is None:
            try:
                await self.call("POST", "2.0/mlflow/users/create", body={"username": username, "password": password})
                log.info("Created MLflow account for hub user %s", username)
            except MlflowApiError as e:
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
        elif synced is None:
            # Existing account (earlier run, or an existing server being adopted):
            # make its password the derived one, so only this service can use it.
            await self.call("PATCH", "2.0/mlflow/users/update-password", body={"username": username, "password": password})
        await self._sync_roles(username, teams, viewer)
        self._synced[username] = _Synced(teams, viewer, time.monotonic())

    async def delete_user(self, username: str) -> bool:
        self._synced.pop(username, None)
        if username == self.admin_username:
            return False
        try:
            await self.call("DELETE", "2.0/mlflow/users/delete", {"username": username})
        except MlflowApiError as e:
            if e.code == 404 or e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise
        log.info("Deleted MLflow account of removed hub user %s", username)
        return True

    def forget(self, username: str) -> None:
        self._synced.pop(username, None)

    # -- teams ------------------------------------------------------------------------
    async def team_role_id(self, team: str) -> int:
        name = TEAM_ROLE_PREFIX + team
        if name in self._role_ids:
            return self._role_ids[name]
        roles = (await self.call("GET", "3.0/mlflow/roles/list", {"workspace": WORKSPACE})).get("roles", [])
        for role in roles:
            self._role_ids[role["name"]] = int(role["id"])
        if name not in self._role_ids:
            role = (
                await self.call(
                    "POST",
                    "3.0/mlflow/roles/create",
                    body={
                        "name": name,
                        "workspace": WORKSPACE,
                        "description": f"gpuhub team {team}: read access to experiments its members create",
                    },
                )
            )["role"]
            self._role_ids[name] = int(role["id"])
        return self._role_ids[name]

    async def _sync_roles(self, username: str, teams: tuple[str, ...], viewer: bool) -> None:
        """The user's MLflow roles become exactly: a ``team-<name>`` role per team, and
        ``gpuhub-viewers`` iff ``viewer``. Any failure raises (the request is refused)."""
        have = (await self.call("GET", "3.0/mlflow/users/roles/list", {"username": username})).get("roles", [])
        have_team = {r["name"][len(TEAM_ROLE_PREFIX) :]: int(r["id"]) for r in have if r["name"].startswith(TEAM_ROLE_PREFIX)}
        for team in teams:
            if team not in have_team:
                role_id = await self.team_role_id(team)
                await self.call("POST", "3.0/mlflow/roles/assign", body={"username": username, "role_id": role_id})
        for team, role_id in have_team.items():
            if team not in teams:
                await self.call("DELETE", "3.0/mlflow/roles/unassign", {"username": username, "role_id": role_id})
        # MLflow's READ includes artifacts: this role must not outlive the viewer-only
        # standing under which the proxy keeps its holder off artifacts and writes.
        have_viewer = [int(r["id"]) for r in have if r["name"] == VIEWER_ROLE]
        if viewer and not have_viewer:
            role_id = await self.viewer_role_id()
            await self.call("POST", "3.0/mlflow/roles/assign", body={"username": username, "role_id": role_id})
            log.info("MLflow account %s is a viewer (read-only, no artifacts)", username)
        elif not viewer:
            for role_id in have_viewer:
                await self.call("DELETE", "3.0/mlflow/roles/unassign", {"username": username, "role_id": role_id})
                log.info("MLflow account %s is no longer a viewer: read-everything role removed", username)

    async def viewer_role_id(self) -> int:
        """The viewers' role (READ on every experiment), created on first use."""
        role_id = self._role_ids.get(VIEWER_ROLE)
        if role_id is not None:
            return role_id
        roles = (await self.call("GET", "3.0/mlflow/roles/list", {"workspace": WORKSPACE})).get("roles", [])
        found = next((r for r in roles if r["name"] == VIEWER_ROLE), None)
        if found is None:
            found = (
                await self.call(
                    "POST",
                    "3.0/mlflow/roles/create",
                    body={
                        "name": VIEWER_ROLE,
                        "workspace": WORKSPACE,
                        "description": "gpuhub viewers: read every experiment's runs and metrics",
                    },
                )
            )["role"]
            await self.call(
                "POST",
                "3.0/mlflow/roles/permissions/add",
                body={
                    "role_id": int(found["id"]),
                    "resource_type": "experiment",
                    "resource_pattern": "*",
                    "permission": "READ",
                },
            )
        role_id = self._role_ids[VIEWER_ROLE] = int(found["id"])
        return role_id

    async def share_experiment_with_teams(self, experiment_id: str, teams: tuple[str, ...]) -> None:
        for team in teams:
            role_id = await self.team_role_id(team)
            await self.call(
                "POST",
                "3.0/mlflow/roles/permissions/add",
                body={
                    "role_id": role_id,
                    "resource_type": "experiment",
                    "resource_pattern": str(experiment_id),
                    "permission": "READ",
                },
            )
