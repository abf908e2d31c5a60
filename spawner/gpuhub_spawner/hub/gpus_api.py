"""GPU health for admins and for the holders of a failed GPU (docs/gpu-health.md).

- ``GET  /hub/api/gpuhub/gpus`` — every device of this machine with its health, drain and
  holder (``custom:gpuhub:status:all``: admins).
- ``POST /hub/api/gpuhub/gpus/{id}/drain`` — nobody gets the device once its holder is done
  (``admin:servers``: hub admins and the policy's ``roles.admins``); audited.
- ``POST /hub/api/gpuhub/gpus/{id}/uncordon`` — back into admission: clears the drain and the
  marks of past XIDs; what the error counters still say stays (``admin:servers``); audited.

Home page: ``gpuhub_gpu_failures(user)`` lists the reader's own servers that hold a device
that went bad, in plain words (files kept, a restart gets a healthy GPU). The same entries go
to JupyterLab through ``GET /hub/api/gpuhub/culling/{user}`` (``gpu_failed``, culling_api.py).
"""

from __future__ import annotations

import json

from jupyterhub.apihandlers import APIHandler
from tornado import web

from ..admission.health import BAD
from ..policy.scopes import STATUS_ALL, allowed
from .context import GpuHubApp, app_of


def _monitor(handler):
    broker = app_of(handler).admission_view(handler.config)
    monitor = getattr(broker, "gpu_health", None)
    if monitor is None:
        raise web.HTTPError(404, "GPU health is read by the cluster on Kubernetes (docs/gpu-health.md)")
    return monitor


class GpuListHandler(APIHandler):
    @web.authenticated
    def get(self):
        if not allowed(self, STATUS_ALL):
            raise web.HTTPError(403, f"This needs the scope {STATUS_ALL}.")
        self.write(json.dumps({"gpus": _monitor(self).listing()}))


class GpuActionHandler(APIHandler):
    @web.authenticated
    def post(self, device, action):
        if not self.has_scope("admin:servers"):
            raise web.HTTPError(403, "Only admins may drain or uncordon a GPU (scope admin:servers).")
        monitor = _monitor(self)
        if device not in {d.id for d in monitor.table.devices}:
            raise web.HTTPError(404, f"no GPU {device!r} on this machine")
        by = getattr(self.current_user, "name", "?")
        changed = monitor.drain(device, by) if action == "drain" else monitor.uncordon(device, by)
        h = monitor.book.of(device)
        if action == "drain":
            holder = monitor.table.owner.get(device)
            message = (
                f"{device} was already drained"
                if not changed
                else f"{device} drained: {holder} keeps it until it stops, then nobody gets it"
                if holder
                else f"{device} drained: nobody gets it until it is uncordoned"
            )
        elif h.state == BAD:
            message = f"{device} is uncordoned but still out of service: {h.reason}"
        else:
            message = f"{device} is back in service ({h.state}{': ' + h.reason if h.reason else ''})"
        self.write(json.dumps({"message": message, "changed": changed, "gpu": h.as_dict()}))


MAX_REASON = 200  # what one notice carries of a device's reason (the hub's own words; bounded all the same)


def gpu_failures_of(app: GpuHubApp, config, user_name: str) -> list[dict]:
    """The servers of ``user_name`` holding a device that went bad, in plain data (never anyone
    else's, never a batch job's: a job's attempt ends ``gpu-failed`` on its own). One entry per
    server: ``{"server", "devices", "since", "reason", "xid"}``, the earliest failure first."""
    try:
        broker = app.admission_view(config)
    except RuntimeError:
        return []
    cluster = getattr(broker, "node_health", None)
    if cluster is not None:  # Kubernetes: server pods on a node whose health taint says its GPUs failed
        return [dict(f, reason=(f.get("reason") or "")[:MAX_REASON]) for f in cluster.failures_of(user_name)]
    monitor = getattr(broker, "gpu_health", None)
    if monitor is None:
        return []
    out = []
    for adm in broker.queue.holdings():
        if adm.user != user_name or adm.key.startswith("job:"):
            continue
        bad = [(d, monitor.book.of(d)) for d in adm.devices if monitor.book.of(d).state == BAD]
        if bad:
            first = min((h for _, h in bad), key=lambda h: h.since or 0)
            out.append(
                {
                    "server": adm.key.partition("/")[2],
                    "devices": [d for d, _ in bad],
                    "since": first.since,
                    "reason": (first.reason or "")[:MAX_REASON],
                    "xid": first.xid,
                }
            )
    return out


def health_monitor(app: GpuHubApp, config):
    """What a long poll for ``gpu_failed`` waits on (``wait_change``): the one-machine monitor,
    the Kubernetes capacity keeper (kube/capacity.py, reading the nodes' health taints), or None."""
    try:
        broker = app.admission_view(config)
    except RuntimeError:
        return None
    return getattr(broker, "gpu_health", None) or getattr(broker, "node_health", None)


def template_vars(app: GpuHubApp, config) -> dict:
    def gpu_failures(user) -> list[dict]:
        """The reader's own servers holding a device that went bad (never anyone else's)."""
        if user is None or not hasattr(user, "spawners"):
            return []
        return gpu_failures_of(app, config, user.name)

    return {"gpuhub_gpu_failures": gpu_failures}


handlers = [
    (r"/api/gpuhub/gpus", GpuListHandler),
    (r"/api/gpuhub/gpus/([^/]+)/(drain|uncordon)", GpuActionHandler),
]
