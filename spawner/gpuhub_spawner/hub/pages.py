"""Who holds which accelerators, how long the queues are, and whether the policy is live.

``/hub/gpuhub`` (HTML) and ``/hub/api/gpuhub/status`` (JSON). What a reader sees depends
on the request's scopes (``policy/scopes.py``) and the live policy's roles, never on who
owns the token alone:

- ``custom:gpuhub:status:all`` (admins): every holder and waiting request with since-when,
  CPU and memory, cohort borrowing and lending, the policy's health, and actions (stop a
  holder, withdraw a request; with ``admin:servers``, drain or uncordon a GPU).
- ``custom:gpuhub:lead`` for a team the policy says the reader leads: that team's holders
  and waiting list, and stopping its members' idle servers.
- plain ``custom:gpuhub:status``: counts, and only one's own name on one's own devices.
- neither: 403.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, AbstractSet, Any

from jupyterhub.apihandlers import APIHandler
from jupyterhub.handlers import BaseHandler
from tornado import web

from ..culling.board import CullBoard
from ..policy import PolicyStore
from ..policy.access import teams_for
from ..policy.quantities import format_duration, format_memory
from ..policy.scopes import LEAD, STATUS, STATUS_ALL, allowed
from ..usage.metrics import lent_and_borrowed
from .context import app_of

if TYPE_CHECKING:
    from traitlets.config import Config


def idle_words(held: bool, last_busy: float | None, idle_for: str | None) -> str | None:
    """The status page's "GPU idle for" column in words: nothing for a free GPU, "not measured
    yet" before any trusted reading, "busy now", or how long it has been idle."""
    if not held:
        return None
    if last_busy is None:
        return "not measured yet"
    return idle_for if idle_for != "0s" else "busy now"


_HIDDEN = ("user", "profile", "held_for", "idle_for", "idle_words", "stops_at", "key")


def status_snapshot(
    broker, see_all: bool, own_teams: AbstractSet[str] = frozenset(), me: str | None = None, member_teams: set[str] | None = None
) -> dict:
    """The status as one reader may see it.

    ``see_all``: everything; ``own_teams``: teams whose holders and waiting requests the
    reader sees (a lead's teams); ``me``: the reader, who always sees their own devices;
    ``member_teams``: teams the reader belongs to (marked on the page).
    """
    policy = broker.policy
    queue = broker.queue
    now = time.time()
    holders = {}
    for adm in queue.holdings():
        for dev in adm.devices:
            holders[dev] = adm
    records = CullBoard.instance().records if CullBoard.initialized() else {}
    flavor_names = {f.name: f.display_name or f.name for f in policy.flavors}
    devices = []
    if broker.devices is None:  # Kubernetes: no device table; one line per holder of GPUs
        devices = _holder_lines(broker, holders_of_gpus(queue), records, flavor_names, now, see_all, own_teams, me)
    for d in broker.devices.devices if broker.devices is not None else ():
        adm = holders.get(d.id)
        rec = records.get(adm.key) if adm else None
        busy = getattr(rec, "gpu_last_busy", None)
        gpu_idle = format_duration(now - busy) if busy else None
        deadline = getattr(getattr(rec, "state", None), "deadline", None)
        entry = {
            "id": d.id,
            "flavor": d.flavor,
            "flavor_name": flavor_names.get(d.flavor, d.flavor),
            "name": d.name,
            "virtual": d.virtual,
            "held": adm is not None,
            "key": adm.key if adm else None,
            "user": adm.user if adm else None,
            "team": adm.team if adm else None,
            "profile": adm.profile if adm else None,
            "held_for": format_duration(now - adm.since) if adm else None,
            "idle_for": gpu_idle if gpu_idle != "0s" else None,
            "idle_words": idle_words(adm is not None, busy, gpu_idle),
            "stops_at": deadline,
        }
        health = broker.devices.health.of(d.id)  # admission.health: not private, everyone sees it
        entry.update(health=health.state, health_summary=health.summary(), drained=bool(health.drained), usable=health.usable)
        if adm is not None and not see_all and adm.team not in own_teams and adm.user != me:
            entry.update(dict.fromkeys(_HIDDEN))
        devices.append(entry)
    usage = queue.usage()
    waiting: dict[str, int] = {}
    waiting_list = []
    for t in sorted(queue.waiting, key=lambda t: t.created):
        waiting[t.team] = waiting.get(t.team, 0) + 1
        if see_all or t.team in own_teams or t.user == me:
            waiting_list.append(
                {
                    "key": t.key,
                    "user": t.user,
                    "team": t.team,
                    "profile": t.profile,
                    "since": t.created,
                    "waited": format_duration(now - t.created),
                    "position": t.status.position if t.status else None,
                    "reason": t.status.reason if t.status else "",
                    "fair": t.status.fair if t.status else "",
                }
            )
    lending = {f.name: lent_and_borrowed(policy, usage, f.name) for f in policy.flavors}
    # One machine: devices of each flavor that may be handed out (a bad or drained GPU is not).
    usable_of: dict[str, int] = {}
    if broker.devices is not None:
        for d in broker.devices.devices:
            usable_of[d.flavor] = usable_of.get(d.flavor, 0) + (1 if broker.devices.health.usable(d.id) else 0)
    teams = []
    for team in policy.teams:
        used = usage.get(team.name, {})
        entry = {
            "name": team.name,
            "label": team.label,
            "cohort": team.cohort,
            "member": team.name in (member_teams if member_teams is not None else own_teams),
            "lead": team.name in own_teams,
            "waiting": waiting.get(team.name, 0),
            "gpus": {
                f: {
                    "in_use": used.get(f"gpu/{f}", 0),
                    "nominal": q.nominal,
                    "display_name": flavor_names.get(f, f),
                    "lent": lending.get(f, ({}, {}))[0].get(team.name, 0),
                    "borrowed": lending.get(f, ({}, {}))[1].get(team.name, 0),
                    # what the team can get now: its quota, but never more than the machine's usable devices
                    **(
                        {"usable": min(q.nominal, usable_of.get(f, 0)), "out_of_service": broker.devices.out_of_service_words(f)}
                        if broker.devices is not None
                        else {}
                    ),
                }
                for f, q in team.quota.gpus.items()
            },
        }
        if see_all or team.name in own_teams:
            q = team.quota
            entry["cpu"] = {"in_use": used.get("cpu", 0) / 1000, "nominal": q.cpu.nominal / 1000 if q.cpu else None}
            entry["memory"] = {
                "in_use": format_memory(used.get("memory", 0)),
                "nominal": format_memory(q.memory.nominal) if q.memory else None,
            }
        teams.append(entry)
    view = "all" if see_all else ("team" if own_teams else "counts")
    out = {"devices": devices, "teams": teams, "view": view, "waiting": waiting_list, "now": now}
    fair = fair_share_figures(policy, queue)
    if fair is not None:
        out["fair_share"] = fair
    if see_all:
        out["policy"] = broker.store.status.as_dict()
    return out


def fair_share_figures(policy, queue) -> dict | None:
    """Each team's recent (decayed) GPU use against its weight (docs/fair-share.md): team
    figures only, which every reader of the status may see. None while fair share is off."""
    ledger = getattr(queue, "fair", None)
    if policy.fair is None or ledger is None:
        return None
    used = ledger.teams()
    groups: dict[str, float] = {}
    for t in policy.teams:
        groups[t.cohort or ""] = groups.get(t.cohort or "", 0.0) + used.get(t.name, 0.0)
    rows = []
    for t in policy.teams:
        mine = used.get(t.name, 0.0)
        total = groups[t.cohort or ""]
        share = policy.share_of(t)
        of_use = mine / total if total else 0.0
        rows.append(
            {
                "name": t.name,
                "label": t.label,
                "cohort": t.cohort,
                "weight": t.weight,
                "share_pct": round(100 * share, 1),
                "recent_gpu_hours": round(mine / 3600, 1),
                "use_pct": round(100 * of_use, 1),
                # above 1: used more than its share lately (its requests go after the others')
                "use_per_share": round(of_use / share, 2) if share else None,
            }
        )
    return {"half_life": format_duration(policy.fair.half_life), "users": policy.fair.users, "teams": rows}


def holders_of_gpus(queue) -> list:
    return [a for a in queue.holdings() if any(k.startswith("gpu/") and v for k, v in a.demand.items())]


def _holder_lines(broker, holders, records, flavor_names, now, see_all, own_teams, me) -> list[dict]:
    """The devices table on Kubernetes: Kueue admits GPU counts per flavor, nodes hold the devices."""
    out = []
    for adm in sorted(holders, key=lambda a: a.since):
        rec = records.get(adm.key)
        busy = getattr(rec, "gpu_last_busy", None)
        gpu_idle = format_duration(now - busy) if busy else None
        for k, v in adm.demand.items():
            if not k.startswith("gpu/") or not v:
                continue
            flavor = k[4:]
            entry = {
                "id": f"{adm.key} {flavor}",
                "flavor": flavor,
                "flavor_name": flavor_names.get(flavor, flavor),
                "name": f"{v} × {flavor_names.get(flavor, flavor)}",
                "virtual": False,
                "held": True,
                "key": adm.key,
                "user": adm.user,
                "team": adm.team,
                "profile": adm.profile,
                "held_for": format_duration(now - adm.since),
                "idle_for": gpu_idle if gpu_idle != "0s" else None,
                "idle_words": idle_words(adm is not None, busy, gpu_idle),
                "stops_at": getattr(getattr(rec, "state", None), "deadline", None),
            }
            if not see_all and adm.team not in own_teams and adm.user != me:
                entry.update(dict.fromkeys(_HIDDEN))
            out.append(entry)
    return out


class _StatusMixin:
    if TYPE_CHECKING:
        # What jupyterhub's BaseHandler (a tornado RequestHandler) gives the handlers this mixin goes before.
        config: Config
        current_user: Any  # jupyterhub.user.User, or the service (untyped)

    def snapshot_for_request(self) -> dict:
        if not allowed(self, STATUS):
            raise web.HTTPError(403, f"This needs the scope {STATUS}.")
        broker = app_of(self).admission_view(self.config)
        user = self.current_user
        groups = [g.name for g in getattr(user, "groups", [])] if getattr(user, "kind", "user") == "user" else []
        policy = broker.policy
        members = {t.name for t in teams_for(policy, groups)}
        leads = {t.name for t in policy.teams if set(groups) & set(t.leads)} if allowed(self, LEAD) else set()
        me = getattr(user, "name", None) if getattr(user, "kind", "user") == "user" else None
        return status_snapshot(broker, allowed(self, STATUS_ALL), leads, me=me, member_teams=members)


class StatusAPIHandler(_StatusMixin, APIHandler):
    @web.authenticated
    def get(self):
        self.write(json.dumps(self.snapshot_for_request()))


class StatusPageHandler(_StatusMixin, BaseHandler):
    @web.authenticated
    async def get(self):
        snap = self.snapshot_for_request()
        # Drain / uncordon buttons: the same API and scope as `gpuhub gpu drain|uncordon`
        # (hub/gpus_api.py checks it again on every POST); one machine only.
        gpu_actions = (
            self.has_scope("admin:servers") and getattr(app_of(self).admission_view(self.config), "gpu_health", None) is not None
        )
        html = await self.render_template("gpuhub_status.html", snap=snap, user=self.current_user, gpu_actions=gpu_actions)
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


def viewer_only(user) -> bool:
    """Template variable and ``viewer_home``: ``user`` is a viewer (the policy's
    ``roles.viewers``) in no team and no admin: they read usage and may start nothing, so their
    home shows no start controls and their landing page is the usage page."""
    if user is None or getattr(user, "admin", False) or not hasattr(user, "groups"):
        return False
    if not PolicyStore.initialized():
        return False
    policy = PolicyStore.instance().current
    groups = {g.name for g in user.groups}
    return bool(groups & set(policy.roles.viewers)) and not teams_for(policy, groups)


def viewer_home(handler) -> str | None:
    """``JupyterHub.default_url``: a viewer lands on the usage page (not on a spawn form whose
    Start would refuse them); everyone else where JupyterHub sends them (None)."""
    user = handler.current_user
    if viewer_only(user):
        return f"{handler.hub.base_url}gpuhub/usage"
    return None


extra_handlers = [
    (r"/gpuhub/?", StatusPageHandler),
    (r"/api/gpuhub/status", StatusAPIHandler),
]
