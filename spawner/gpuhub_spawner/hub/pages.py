"""Who holds which accelerators, how long the queues are, and whether the policy is live.

``/hub/gpuhub`` (HTML) and ``/hub/api/gpuhub/status`` (JSON). What a reader sees depends
on the request's scopes (``hub/scopes.py``), not on who owns the token:
``custom:gpuhub:status:all`` sees every holder and the policy's health; plain
``custom:gpuhub:status`` sees counts, and holders' names only inside the reader's own
teams; without either, 403.
"""

from __future__ import annotations

import json
import time

from jupyterhub.apihandlers import APIHandler
from jupyterhub.handlers import BaseHandler
from tornado import web

from ..local.broker import LocalBroker
from ..policy import PolicyStore
from ..policy.access import teams_for
from ..policy.quantities import format_duration
from .scopes import STATUS, STATUS_ALL, allowed

_HIDDEN = ("user", "profile", "held_for", "idle_for", "stops_at")


def status_snapshot(broker: LocalBroker, see_all: bool, own_teams: set[str] = frozenset()) -> dict:
    """The status as one reader may see it.

    ``see_all``: every holder; otherwise names only on devices held by ``own_teams``.
    """
    policy = broker.policy
    queue = broker.queue
    now = time.time()
    holders = {}
    for adm in queue.holdings():
        for dev in adm.devices:
            holders[dev] = adm
    from ..culling.board import CullBoard

    records = CullBoard.instance().records if CullBoard.initialized() else {}
    devices = []
    for d in broker.devices.devices:
        adm = holders.get(d.id)
        rec = records.get(adm.key) if adm else None
        busy = getattr(rec, "gpu_last_busy", None)
        gpu_idle = format_duration(now - busy) if busy else None
        deadline = getattr(getattr(rec, "state", None), "deadline", None)
        entry = {
            "id": d.id,
            "flavor": d.flavor,
            "name": d.name,
            "virtual": d.virtual,
            "held": adm is not None,
            "user": adm.user if adm else None,
            "team": adm.team if adm else None,
            "profile": adm.profile if adm else None,
            "held_for": format_duration(now - adm.since) if adm else None,
            "idle_for": gpu_idle if gpu_idle != "0s" else None,
            "stops_at": deadline,
        }
        if adm is not None and not see_all and adm.team not in own_teams:
            entry.update(dict.fromkeys(_HIDDEN))
        devices.append(entry)
    usage = queue.usage()
    waiting: dict[str, int] = {}
    for t in queue.waiting:
        waiting[t.team] = waiting.get(t.team, 0) + 1
    teams = []
    for team in policy.teams:
        teams.append(
            {
                "name": team.name,
                "label": team.label,
                "member": team.name in own_teams,
                "waiting": waiting.get(team.name, 0),
                "gpus": {
                    f: {"in_use": usage.get(team.name, {}).get(f"gpu/{f}", 0), "nominal": q.nominal}
                    for f, q in team.quota.gpus.items()
                },
            }
        )
    out = {"devices": devices, "teams": teams, "view": "all" if see_all else ("team" if own_teams else "counts")}
    if see_all:
        out["policy"] = broker.store.status.as_dict()
    return out


class _StatusMixin:
    def snapshot_for_request(self) -> dict:
        if not allowed(self, STATUS):
            raise web.HTTPError(403, f"This needs the scope {STATUS}.")
        broker = LocalBroker.instance(config=self.config)
        user = self.current_user
        groups = [g.name for g in getattr(user, "groups", [])] if getattr(user, "kind", "user") == "user" else []
        own = {t.name for t in teams_for(broker.policy, groups)}
        return status_snapshot(broker, allowed(self, STATUS_ALL), own)


class StatusAPIHandler(_StatusMixin, APIHandler):
    @web.authenticated
    def get(self):
        self.write(json.dumps(self.snapshot_for_request()))


class StatusPageHandler(_StatusMixin, BaseHandler):
    @web.authenticated
    async def get(self):
        snap = self.snapshot_for_request()
        html = await self.render_template("gpuhub_status.html", snap=snap, user=self.current_user)
        self.finish(html)


def policy_banner(user) -> dict | None:
    """Template variable: the policy's health, for admins only."""
    if user is None or not getattr(user, "admin", False):
        return None
    # Only read an existing store: creating singletons here would miss the hub's config.
    if not PolicyStore.initialized():
        return None  # nothing loaded yet, so nothing can be stale
    status = PolicyStore.instance().status
    return status.as_dict() if status.stale else None


extra_handlers = [
    (r"/gpuhub/?", StatusPageHandler),
    (r"/api/gpuhub/status", StatusAPIHandler),
]
