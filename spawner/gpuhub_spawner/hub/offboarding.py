"""Off-boarding a leaver (issue 42 item 4): one admin action, from ``gpuhub user offboard NAME``
or the users page (``/hub/gpuhub/users``), and its undo, ``gpuhub user reinstate NAME``.

- ``POST /hub/api/gpuhub/users/<name>/offboard``: block the login, stop the leaver's Ray clusters,
  batch jobs and servers (as a stop by this admin, recorded why), revoke every API and OAuth
  token and every browser session (``cookie_id`` rotated), take them out of gpuhub's roles (their
  groups, direct roles, JupyterHub's admin flag), keep or archive their home (``offboarding.home``
  of the policy), and audit each step; 200 with the summary (``already: true`` when the user was
  off-boarded before: the steps run again and find nothing left).
- ``POST /hub/api/gpuhub/users/<name>/reinstate``: lift the block (200; ``was_blocked: false``
  when there was none).
- ``GET /hub/api/gpuhub/users``: every hub user, their servers, and whether they are off-boarded.

All need the request's ``admin:users`` scope (a hub admin); anyone else gets 403, an unknown user
404, an admin naming themselves 400, and nothing changes then.

**The block** is a file in the hub's data directory (``offboarded.json``, 0600, written
atomically): the names, who blocked them and when. At start the wiring adds its names to
``Authenticator.blocked_users``, where JupyterHub itself refuses a login before the identity
provider's groups are looked at, and JupyterHub 5.2+ strips a blocked user's roles and groups
and stops their servers at every start; the handlers keep that set in step while the hub runs.
The authenticator the wiring picks is subclassed with ``OffboardedLogin`` so the refusal says
why (403 "off-boarded ... ask an admin") instead of "Invalid username or password".
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tarfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jupyterhub.apihandlers import APIHandler
from jupyterhub.handlers import BaseHandler
from jupyterhub.scopes import Scope
from tornado import web

from ..jobs.records import FINAL
from ..rayclusters import BY_USER
from ..rayclusters import FINAL as RAY_FINAL
from ..policy import PolicyStore
from ..policy.access import teams_for
from ..policy.files import write_atomically
from ..usage import recorder
from .context import app_of

if TYPE_CHECKING:
    from traitlets.config import Config

ADMIN_SCOPE = "admin:users"
PVC_LABEL = "gpuhub.io/offboarded"
BLOCK_FILE = "offboarded.json"
NAME = r"([^/]+)"


class Blocklist:
    """The off-boarded names, in a 0600 JSON file: ``{name: {"by": admin, "at": unix time, "groups": [...]}}``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def read(self) -> dict[str, dict]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, name: str) -> dict | None:
        return self.read().get(name)

    def add(self, name: str, by: str, groups: list[str] | None = None) -> bool:
        """Block ``name`` (``groups``: theirs when blocked); False when it already was (the
        first entry stays)."""
        data = self.read()
        if name in data:
            return False
        data[name] = {"by": by, "at": round(time.time(), 3), "groups": list(groups or [])}
        self._write(data)
        return True

    def remove(self, name: str) -> dict | None:
        data = self.read()
        entry = data.pop(name, None)
        if entry is not None:
            self._write(data)
        return entry

    def _write(self, data: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomically(self.path, json.dumps(data, indent=1, sort_keys=True) + "\n", mode=0o600)


def refusal(name: str, entry: dict) -> str:
    when = datetime.fromtimestamp(float(entry.get("at", 0)), timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"{name} was off-boarded by {entry.get('by', 'an admin')} on {when}: logins are refused "
        "whatever the identity provider says. Ask a gpuhub admin to reinstate the account."
    )


class OffboardedLogin:
    """Mixed into the hub's authenticator class (``wiring/offboarding.py``): an off-boarded
    user's login is refused with a message that says why. ``blocklist_file`` is set on the
    subclass by the wiring."""

    blocklist_file: str = ""

    if TYPE_CHECKING:
        blocked_users: set[str]

    async def check_blocked_users(self, username, authentication=None):
        entry = Blocklist(self.blocklist_file).get(username) if self.blocklist_file else None
        if entry is not None:
            raise web.HTTPError(403, refusal(username, entry))
        parent: Any = super()
        result = parent.check_blocked_users(username, authentication)
        return (await result) if asyncio.iscoroutine(result) else result


def with_offboarding(cls: type, blocklist_file: str) -> type:
    """``cls`` with ``OffboardedLogin`` first; its config sections (``c.GitHubOAuthenticator``
    ...) still apply, since traitlets reads every section of the class's ancestry."""
    if issubclass(cls, OffboardedLogin):
        return cls
    return type(cls.__name__, (OffboardedLogin, cls), {"blocklist_file": blocklist_file, "__module__": __name__})


class _OffboardMixin:
    _leaver_groups: tuple[str, ...] = ()

    if TYPE_CHECKING:
        config: Config
        current_user: Any
        parsed_scopes: dict[str, Any]
        authenticator: Any
        db: Any
        log: Any

        def find_user(self, name: str) -> Any: ...
        async def stop_single_user(self, user: Any, server_name: str = "") -> None: ...

    def admin(self) -> str:
        who = self.current_user
        if who is None or self.parsed_scopes.get(ADMIN_SCOPE) != Scope.ALL:
            raise web.HTTPError(403, f"Off-boarding and reinstating are for hub admins (this needs the scope {ADMIN_SCOPE}).")
        return getattr(who, "name", "?")

    @property
    def blocklist(self) -> Blocklist:
        path = app_of(self).offboarding_file
        if not path:
            raise web.HTTPError(404, "off-boarding is not enabled on this hub")
        return Blocklist(path)

    def _block_in_authenticator(self, name: str, blocked: bool) -> None:
        now = set(self.authenticator.blocked_users)
        self.authenticator.blocked_users = (now | {name}) if blocked else (now - {name})

    def users_listed(self) -> list[dict]:
        from jupyterhub import orm

        blocked = self.blocklist.read()
        out = []
        for u in self.db.query(orm.User).order_by(orm.User.name):
            servers = sorted((s.name or "(default)") for s in u._orm_spawners if s.server is not None)
            entry = blocked.get(u.name)
            out.append({"name": u.name, "admin": bool(u.admin), "servers": servers, "offboarded": entry})
        return out

    # -- the steps -------------------------------------------------------------------------
    async def offboard(self, name: str) -> dict:
        by = self.admin()
        if name == by:
            raise web.HTTPError(400, "You cannot off-board yourself; another admin must (nothing was changed).")
        user = self.find_user(name)
        blocklist = self.blocklist
        if user is None:
            raise web.HTTPError(404, f"No user {name!r} in this hub (nothing was changed).")
        # The policy as the file says now: an admin who just changed offboarding: gets that rule,
        # even when a large policy is re-read beside the loop (``.policy`` would answer the old one).
        policy = await PolicyStore.instance(config=self.config).fresh()
        rules = policy.offboarding
        # Their groups as they were before the roles step empties them (kept in the block file:
        # a second run hands MLflow experiments to the same leads).
        earlier = blocklist.get(name)
        groups = sorted(g.name for g in user.groups)
        self._leaver_groups = tuple(earlier.get("groups", groups) if earlier else groups)
        already = not blocklist.add(name, by, groups=groups)
        self._block_in_authenticator(name, True)
        steps: list[dict] = [{"step": "login", "done": f"blocked{' (already)' if already else ''}: refused until reinstated"}]
        recorder.audit("offboard_started", user=name, by=by, already=already)
        for step, fn in (
            ("ray", self._stop_ray),
            ("jobs", self._stop_jobs),
            ("servers", self._stop_servers),
            ("processes", self._end_processes),
            ("queues", self._queues),
            ("tokens", self._revoke),
            ("roles", self._unrole),
            ("home", self._home),
            ("mlflow", self._mlflow),
        ):
            try:
                done = await fn(user, by, rules)
                steps.append({"step": step, "done": done})
                recorder.audit("offboard_step", user=name, by=by, step=step, done=done)
            except Exception as e:  # noqa: BLE001 - every step is tried; each failure is said
                self.log.exception("Off-boarding %s: step %s failed", name, step)
                why = f"{type(e).__name__}: {e}"
                steps.append({"step": step, "failed": why})
                recorder.audit("offboard_step", user=name, by=by, step=step, failed=why)
        failed = [s["step"] for s in steps if "failed" in s]
        recorder.audit("offboarded", user=name, by=by, already=already, failed=failed or None)
        self.log.info("%s off-boarded %s%s", by, name, f" (failed: {failed})" if failed else "")
        return {"user": name, "by": by, "already": already, "steps": steps, "failed": failed}

    async def _stop_ray(self, user, by: str, rules) -> str:
        try:
            manager = app_of(self).ray(self.config)
        except web.HTTPError:
            return "Ray clusters are not enabled"
        stopped = []
        for view in manager.list(user.name):
            if view.state in RAY_FINAL:
                continue
            await manager.stop(view.id, reason=BY_USER, user_name=user.name)
            stopped.append(view.name)
        return f"stopped {len(stopped)} Ray cluster(s)" + (f": {', '.join(stopped)}" if stopped else "")

    async def _stop_jobs(self, user, by: str, rules) -> str:
        try:
            manager = app_of(self).jobs(self.config)
        except web.HTTPError:
            return "batch jobs are not enabled"
        stopped = []
        for rec in list(manager.jobs.values()):
            if rec.user != user.name or rec.state in FINAL:
                continue
            recorder.note_end(f"job:{rec.id}", "stopped", by=by)
            await manager.cancel(rec.id)
            stopped.append(rec.id)
        return f"cancelled {len(stopped)} job(s)" + (f": {', '.join(stopped)}" if stopped else "")

    async def _stop_servers(self, user, by: str, rules) -> str:
        stopped = []
        for server, spawner in list(user.spawners.items()):
            if not (spawner.active or spawner.pending):
                continue
            key = f"{user.name}/{server}"
            recorder.note_end(key, "stopped", by=by)
            recorder.audit(
                "acted_on_server", by=by, role="admin", target_user=user.name, key=key, action="stop", why="offboarded"
            )
            if spawner.pending == "spawn" and spawner._spawn_future:
                spawner._spawn_future.cancel()
                await asyncio.wait([spawner._spawn_future], timeout=30)
            if spawner.pending == "stop" or spawner.active:
                if not spawner.pending:
                    await self.stop_single_user(user, server)
                future = getattr(spawner, "_stop_future", None)
                if future is not None:
                    await future
            stopped.append(server or "(default)")
        return f"stopped {len(stopped)} server(s)" + (f": {', '.join(stopped)}" if stopped else "")

    async def _end_processes(self, user, by: str, rules) -> str:
        """Whatever still runs as the leaver's account once their servers, jobs and clusters
        were stopped (one machine; Kubernetes: their pods are gone with those)."""
        end = app_of(self).end_processes
        if end is None:
            return "nothing runs as them outside their servers, jobs and clusters on this backend"
        spawner = user.spawners.get("") or user.get_spawner("")
        return await asyncio.get_running_loop().run_in_executor(None, end, spawner)

    async def _queues(self, user, by: str, rules) -> str:
        """Kubernetes with ``fairShare.users``: the leaver's own LocalQueues go (their servers,
        jobs and clusters were stopped in the steps before, so nothing waits in them)."""
        delete = app_of(self).delete_user_queues
        if delete is None:
            return "no queues of their own on this backend"
        spawner = user.spawners.get("") or user.get_spawner("")
        return await delete(spawner)

    async def _revoke(self, user, by: str, rules) -> str:
        from jupyterhub.utils import new_token

        orm_user = user.orm_user
        tokens = list(orm_user.api_tokens)
        oauth = sum(1 for t in tokens if getattr(t, "oauth_client_id", None) not in (None, "jupyterhub"))
        for t in tokens:
            self.db.delete(t)
        orm_user.cookie_id = new_token()  # every browser session's cookie names the old one
        self.db.commit()
        return f"revoked {len(tokens)} token(s) ({oauth} OAuth), ended every browser session"

    async def _unrole(self, user, by: str, rules) -> str:
        from jupyterhub.roles import strip_role

        orm_user = user.orm_user
        groups = sorted(g.name for g in orm_user.groups)
        roles = sorted(r.name for r in orm_user.roles if r.name != "user")
        policy = PolicyStore.instance(config=self.config).policy
        gpuhub_roles = sorted({r for g in groups for r in recorder.role_map(policy).get(g, [])})
        for role in list(orm_user.roles):
            if role.name != "user":
                strip_role(self.db, orm_user, role, commit=False)
        orm_user.groups = []
        was_admin = bool(orm_user.admin)
        orm_user.admin = False
        self.db.commit()
        parts = [f"left groups {groups}" if groups else "in no group"]
        if gpuhub_roles:
            parts.append(f"gpuhub roles gone: {gpuhub_roles}")
        if roles:
            parts.append(f"roles stripped: {roles}")
        if was_admin:
            parts.append("no longer a hub admin")
        return "; ".join(parts)

    async def _home(self, user, by: str, rules) -> str:
        spawner = user.spawners.get("") or user.get_spawner("")
        pvc = getattr(spawner, "pvc_name", None)
        if pvc and getattr(spawner, "storage_pvc_ensure", False):  # Kubernetes: the PVC is kept, labelled
            body = {"metadata": {"labels": {PVC_LABEL: "true"}}}
            await spawner.api.patch_namespaced_persistent_volume_claim(pvc, spawner.namespace, body)
            return f"PVC {pvc} kept, labelled {PVC_LABEL}=true (policy offboarding.home={rules.home} applies to one machine)"
        home = getattr(spawner, "home_dir", None)
        if not home or not os.path.isdir(home):  # noqa: ASYNC240 (one stat of a local directory)
            return "no home directory on this machine"
        if rules.home == "keep":
            return f"home kept at {home} (policy offboarding.home=keep)"
        archive_dir = app_of(self).offboarding_archive_dir
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        target = Path(archive_dir) / f"{user.name}-{stamp}.tar.gz"
        await asyncio.get_running_loop().run_in_executor(None, archive_home, home, target)
        return f"home archived to {target} (admins only, 0600) and removed (policy offboarding.home=archive)"

    async def _mlflow(self, user, by: str, rules) -> str:
        state_dir = app_of(self).mlflow_state_dir
        if not state_dir:
            return "no MLflow run by this hub (an external MLflow is not changed: hand its experiments over there)"
        from ..mlflow.handover import admin_accounts, hand_over

        accounts = admin_accounts(state_dir)
        if accounts is None:
            return "MLflow has not started on this hub yet: nothing of theirs there"
        return await hand_over(accounts, user.name, rules.mlflow, self._leads_of(user.name))

    def _leads_of(self, name: str) -> dict[str, tuple[str, ...]]:
        """The leads of the teams the leaver was in (their groups before off-boarding), with
        each lead's own teams: hub users in the teams' ``leads`` groups, the leaver excepted."""
        from jupyterhub import orm

        policy = PolicyStore.instance(config=self.config).policy
        teams = teams_for(policy, self._leaver_groups)
        out: dict[str, tuple[str, ...]] = {}
        for team in teams:
            for group_name in team.leads:
                group = orm.Group.find(self.db, group_name)
                for member in group.users if group is not None else []:
                    if member.name != name:
                        own = tuple(t.name for t in teams_for(policy, [g.name for g in member.groups]))
                        out[member.name] = own
        return out


def archive_home(home: str, target: Path) -> None:
    """``home`` as a tar.gz only the hub's user (root) can read, then the home removed. Links in
    the home are stored as links, never followed (a user's link to /etc stays a link)."""
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(target.parent, 0o700)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w:gz") as tar:
        tar.add(home, arcname=os.path.basename(home.rstrip("/")), recursive=True)
        f.flush()
        os.fsync(f.fileno())
    shutil.rmtree(home)


class OffboardHandler(_OffboardMixin, APIHandler):
    async def post(self, name: str):
        self.write(json.dumps(await self.offboard(name)))


class ReinstateHandler(_OffboardMixin, APIHandler):
    async def post(self, name: str):
        by = self.admin()
        entry = self.blocklist.remove(name)
        self._block_in_authenticator(name, False)
        recorder.audit("reinstated", user=name, by=by, was_blocked=entry is not None)
        self.log.info("%s reinstated %s", by, name)
        self.write(json.dumps({"user": name, "by": by, "was_blocked": entry is not None}))


class UsersHandler(_OffboardMixin, APIHandler):
    def get(self):
        self.admin()
        self.write(json.dumps({"users": self.users_listed()}))


class UsersPageHandler(_OffboardMixin, BaseHandler):
    @web.authenticated
    async def get(self):
        self.admin()
        users = self.users_listed()
        for u in users:
            if u["offboarded"]:
                at = datetime.fromtimestamp(u["offboarded"]["at"], timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
                u["offboarded"] = dict(u["offboarded"], when=at)
        me = getattr(self.current_user, "name", "")
        self.finish(await self.render_template("gpuhub_users.html", users=users, me=me))


handlers = [
    (rf"/api/gpuhub/users/{NAME}/offboard", OffboardHandler),
    (rf"/api/gpuhub/users/{NAME}/reinstate", ReinstateHandler),
    (r"/api/gpuhub/users/?", UsersHandler),
    (r"/gpuhub/users/?", UsersPageHandler),
]
