"""Who holds which accelerators, how long the queues are, and whether the policy is live.

``/hub/gpuhub`` (HTML) and ``/hub/api/gpuhub/status`` (JSON) for every logged-in user;
the policy's health (stale, located errors) only for admins.
"""

from __future__ import annotations

import json
import time

from jupyterhub.handlers import BaseHandler
from jupyterhub.apihandlers import APIHandler
from tornado import web

from ..local.broker import LocalBroker
from ..policy import PolicyStore
from ..policy.quantities import format_duration


def status_snapshot(broker: LocalBroker, is_admin: bool) -> dict:
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
        gpu_idle = format_duration(now - rec.gpu_last_busy) if rec and rec.gpu_last_busy else None
        devices.append(
            {
                "id": d.id,
                "flavor": d.flavor,
                "name": d.name,
                "virtual": d.virtual,
                "user": adm.user if adm else None,
                "team": adm.team if adm else None,
                "profile": adm.profile if adm else None,
                "held_for": format_duration(now - adm.since) if adm else None,
                "idle_for": gpu_idle if gpu_idle != "0s" else None,
                "stops_at": rec.state.deadline if rec and rec.state.deadline else None,
            }
        )
    usage = queue.usage()
    teams = []
    for team in policy.teams:
        teams.append(
            {
                "name": team.name,
                "label": team.label,
                "waiting": sum(1 for t in queue.waiting if t.team == team.name),
                "gpus": {
                    f: {"in_use": usage.get(team.name, {}).get(f"gpu/{f}", 0), "nominal": q.nominal}
                    for f, q in team.quota.gpus.items()
                },
            }
        )
    out = {"devices": devices, "teams": teams}
    if is_admin:
        out["policy"] = broker.store.status.as_dict()
    return out


class StatusAPIHandler(APIHandler):
    @web.authenticated
    def get(self):
        user = self.current_user
        self.write(json.dumps(status_snapshot(LocalBroker.instance(config=self.config), bool(getattr(user, "admin", False)))))


class StatusPageHandler(BaseHandler):
    @web.authenticated
    async def get(self):
        user = self.current_user
        snap = status_snapshot(LocalBroker.instance(config=self.config), bool(getattr(user, "admin", False)))
        html = await self.render_template("gpuhub_status.html", snap=snap, user=user)
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
