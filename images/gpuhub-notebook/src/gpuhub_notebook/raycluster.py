"""``gpuhub_notebook.ray_cluster``: a Ray cluster from the team's GPU queue, in a notebook.

    import ray, gpuhub_notebook
    with gpuhub_notebook.ray_cluster(gpus=2) as address:
        ray.init(address)
        ...

The same request as ``gpuhub ray up`` (docs/ray.md), sent to the hub with this server's own
token (``JUPYTERHUB_API_URL``, ``JUPYTERHUB_API_TOKEN``). While the cluster waits in the
queue, the hub's words are printed when they change; when it runs, the address is yielded
and ``RAY_ADDRESS`` and ``RAY_AUTH_MODE=token`` are set in this kernel (the cluster's token
is in ``~/.ray/auth_token``, where Ray looks). On leaving the block, Ray is shut down in
this kernel and the cluster is stopped, so its GPUs go back to the queue. ``keep=True``
leaves it running (stop it with ``gpuhub ray down NAME``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import urllib.error
import urllib.request


class RayClusterError(RuntimeError):
    pass


def _call(method: str, path: str, body: dict | None = None) -> dict:
    base = os.environ.get("JUPYTERHUB_API_URL", "").rstrip("/")
    token = os.environ.get("JUPYTERHUB_API_TOKEN", "")
    if not base or not token:
        raise RayClusterError("not inside a gpuhub server (JUPYTERHUB_API_URL / JUPYTERHUB_API_TOKEN are not set)")
    req = urllib.request.Request(
        f"{base}/gpuhub/ray{path}",
        method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"token {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read() or b"{}").get("message") or e.reason
        except ValueError:
            message = e.reason
        raise RayClusterError(f"{message} (HTTP {e.code})") from None


@contextlib.contextmanager
def ray_cluster(
    gpus: int | None = None,
    workers: int = 0,
    profile: str | None = None,
    name: str | None = None,
    timeout: float | None = None,
    keep: bool = False,
    out=None,
):
    out = out or sys.stdout
    body = {k: v for k, v in {"gpus": gpus, "workers": workers, "profile": profile, "name": name}.items() if v is not None}
    view = _call("POST", "", body)
    name, last = view["name"], None
    deadline = time.time() + timeout if timeout else None
    try:
        while view["state"] in ("queued", "starting"):
            if view["status"] != last:
                print(f"Ray cluster {name}: {view['status']}", file=out, flush=True)
                last = view["status"]
            if deadline and time.time() > deadline:
                raise RayClusterError(f"Ray cluster {name} still {view['state']} after {timeout:g}s")
            time.sleep(1)
            view = _call("GET", f"/{name}")
        if view["state"] != "running":
            raise RayClusterError(f"Ray cluster {name}: {view['status']}")
        print(f"Ray cluster {name}: {view['status']}", file=out, flush=True)
        os.environ["RAY_ADDRESS"] = view["address"]
        os.environ["RAY_AUTH_MODE"] = "token"
        if view.get("dashboard"):
            # Ray's own link (``ray.init``'s "View the dashboard at 127.0.0.1:<port>") points
            # inside the machine, where the browser cannot go: the working one is on the user's
            # own origin, through their server (gpuhub_notebook.ray_dashboard).
            os.environ["RAY_OVERRIDE_DASHBOARD_URL"] = view["dashboard"]
            print(f"Ray dashboard: {view['dashboard']}", file=out, flush=True)
        yield view["address"]
    finally:
        if not keep:
            with contextlib.suppress(Exception):
                import ray  # lazy: only where the user uses Ray

                if ray.is_initialized():
                    ray.shutdown()
            with contextlib.suppress(RayClusterError):
                _call("POST", f"/{name}/stop")
            if os.environ.get("RAY_ADDRESS") == view.get("address"):
                os.environ.pop("RAY_ADDRESS", None)
            if view.get("dashboard") and os.environ.get("RAY_OVERRIDE_DASHBOARD_URL") == view["dashboard"]:
                os.environ.pop("RAY_OVERRIDE_DASHBOARD_URL", None)
