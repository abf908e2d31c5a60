"""The culler service: jupyterhub-idle-culler 2.0 with a GPU-aware arbiter hook.

idle-culler does what it is good at — listing ready servers page by page, running its
pass every ``cull_every`` seconds, stopping servers through the hub API (named servers
are stopped, never removed; homes are never touched). Its ``cull_arbiter_hook`` cannot
express warnings, snoozes or GPU activity on its own, so the hook here gathers each
server's kernel/terminal activity (and, in pods, the GPU activity the notebook-side
package reports) and asks the hub's ``/api/gpuhub/cull-decision``, which holds the
warning/snooze state and reads the GPUs it assigned.

Scopes (least needed): list:users, read:users:activity, read:servers, delete:servers
(idle-culler) and access:servers (to read kernels and GPU activity from servers).
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from urllib.parse import unquote

from jupyterhub_idle_culler import IdleCuller, parse_date
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from traitlets import Unicode, default


def _seconds_since(iso: str | None, now: datetime) -> float | None:
    if not iso:
        return None
    return max(0.0, (now - parse_date(iso)).total_seconds())


def owner_of(server: dict, base_url: str) -> str:
    """The user name from a server model's URL (``{base}user/{name}/{server}/``)."""
    path = server["url"]
    prefix = base_url.rstrip("/") + "/user/"
    if not path.startswith(prefix):
        raise ValueError(f"unexpected server url {path!r}")
    return unquote(path[len(prefix):].split("/", 1)[0])


class GpuHubCuller(IdleCuller):
    public_url = Unicode(
        os.environ.get("GPUHUB_PUBLIC_URL", "http://127.0.0.1:8000"),
        help="Where single-user servers are reached (the proxy), to read their activity.",
    ).tag(config=True)

    @default("cull_arbiter_hook")
    def _gpuhub_arbiter(self):
        return self.arbiter

    def _headers(self) -> dict:
        return {"Authorization": f"token {os.environ['JUPYTERHUB_API_TOKEN']}"}

    async def _get_json(self, url: str) -> object | None:
        resp = await AsyncHTTPClient().fetch(
            HTTPRequest(url, headers=self._headers(), request_timeout=10), raise_error=False
        )
        if resp.code != 200:
            return None
        return json.loads(resp.body)

    async def server_activity(self, server: dict, now: datetime) -> tuple[float | None, list[dict] | None]:
        """Seconds since kernel/terminal activity (0 if a kernel is busy), reported GPUs."""
        base = self.public_url.rstrip("/") + server["url"]
        kernels = await self._get_json(base + "api/kernels")
        terminals = await self._get_json(base + "api/terminals")
        activity = await self._get_json(base + "gpuhub/activity")
        if kernels is None and terminals is None:
            return None, None
        if any(k.get("execution_state") == "busy" for k in kernels or []):
            idle = 0.0
        else:
            stamps = [k.get("last_activity") for k in kernels or []] + [t.get("last_activity") for t in terminals or []]
            ages = [_seconds_since(s, now) for s in stamps if s]
            started = _seconds_since(server.get("started"), now)
            idle = min(ages) if ages else started
        gpus = activity.get("gpus") if isinstance(activity, dict) else None
        return idle, gpus

    async def arbiter(self, *, inactive, inactive_limit, server, **kwargs) -> bool:
        now = datetime.now(timezone.utc)
        user = owner_of(server, os.environ.get("JUPYTERHUB_BASE_URL", "/"))
        kernels_idle, gpus = await self.server_activity(server, now)
        body = {
            "user": user,
            "server": server.get("name", ""),
            "inactive": inactive.total_seconds() if inactive is not None else None,
            "kernels_idle": kernels_idle,
            "age": _seconds_since(server.get("started"), now),
            "gpus": gpus,
        }
        resp = await AsyncHTTPClient().fetch(
            HTTPRequest(
                self.url.rstrip("/") + "/gpuhub/cull-decision",
                method="POST",
                headers=self._headers(),
                body=json.dumps(body),
                request_timeout=10,
            ),
            raise_error=False,
        )
        if resp.code != 200:
            self.log.error("cull decision for %s/%s failed: %s %s", user, body["server"], resp.code, resp.body[:200])
            return False
        return json.loads(resp.body)["action"] == "cull"


def main():
    GpuHubCuller.launch_instance()


if __name__ == "__main__":
    main()
