"""One culler pass over N running servers (default 5,000): the batch design vs the old one.

What is real: a real JupyterHub 6.1 (subprocess, sqlite), the real Node
configurable-http-proxy with a route per server, gpuhub's culling API and CullBoard, the
example policy, jupyterhub-idle-culler 2.0 driven by ``GpuHubCuller.cull_pass``.
What is not: the N servers. Their users, spawner rows and server rows are written into
the hub's database before it starts (with JupyterHub's own ORM), and a benchmark spawner
whose ``poll()`` says "running" makes the hub adopt them; every route points at one small
HTTP process answering ``api/kernels``, ``api/terminals`` and ``gpuhub/activity`` the way
an idle jupyter server does (``[]``, ``[]``, ``{"gpus": []}``).

Measured in the same run, against the same hub:

- new: ``GpuHubCuller.cull_pass`` as the service runs it: one
  ``POST /hub/api/gpuhub/cull-decisions`` (the hub decides all N in-process), then
  idle-culler lists and stops only if something is due. ``--due`` servers are due at the
  first pass (stopped after the answer: listing, then stops); ``--later`` more come due
  ``--later-in`` seconds after the database is written, announced by the pass before (so
  idle-culler lists while the hub decides); one pass has nothing to stop;
- old: the previous design's arbiter, per server: ``api/kernels``, ``api/terminals``,
  ``gpuhub/activity`` through the proxy and one decision request to the hub, inside
  idle-culler's pass (``--old-servers`` of them; the time per server is printed so a
  sample can be scaled honestly).

    .venv/bin/python tests/benchmarks/culler_pass.py [--servers 5000] [--old-servers 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import datetime, timedelta, timezone
from functools import partial
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from support.hub import free_port  # noqa: E402

FAKE_SERVER = textwrap.dedent(
    """
    import sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def do_GET(self):
            body = b'{"gpus": []}' if self.path.endswith("gpuhub/activity") else b"[]"
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """
)

HUB_CONFIG = """
import sys
sys.path.insert(0, {tests!r})
from jupyterhub.spawner import Spawner
from gpuhub_spawner.wiring.config import configure_culler

class BenchSpawner(Spawner):
    '''A server that is always running at the fake server (the benchmark's stand-in).'''
    async def start(self):
        return ("127.0.0.1", {fake_port})
    async def stop(self, now=False):
        return None
    async def poll(self):
        return None if self.server else 0

c = get_config()
c.JupyterHub.bind_url = "http://127.0.0.1:{port}"
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api}"
c.ConfigurableHTTPProxy.command = [{chp!r}]
c.ConfigurableHTTPProxy.auth_token = {proxy_token!r}
c.JupyterHub.db_url = "sqlite:///{data}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "{data}/cookie_secret"
c.JupyterHub.spawner_class = BenchSpawner
c.JupyterHub.cleanup_servers = False
c.JupyterHub.allow_named_servers = True
c.JupyterHub.last_activity_interval = 3600
c.JupyterHub.authenticator_class = "dummy"
c.PolicyStore.policy_file = {policy!r}
configure_culler(c, cull_every=60, state_dir={data!r})
c.JupyterHub.api_page_max_limit = max(200, {page_size})
# The culler runs in the benchmark process (timed there), not as a hub-managed process.
c.JupyterHub.services = [dict(name="gpuhub-culler", api_token={token!r})]
"""


def populate(db_url: str, n: int, fake_port: int, due: int, later: int = 0, later_at: float = 0.0) -> None:
    """N users, each with a running default server, written with JupyterHub's ORM."""
    from jupyterhub import orm

    db = orm.new_session_factory(db_url)()
    now = datetime.now(timezone.utc).replace(tzinfo=None)
    rng = random.Random(1)
    profiles = ["cpu", "cpu", "cpu", "a100-1", "l4-1"]
    for i in range(n):
        name = f"u{i:05d}"
        user = orm.User(name=name)
        db.add(user)
        server = orm.Server(ip="127.0.0.1", port=fake_port, base_url=f"/user/{name}/")
        spawner = orm.Spawner(name="", user=user, server=server)
        # `due` servers past the maximum age (7d) and its warning: stopped this pass (a rule
        # no activity changes: a fresh proxy's route timestamps all read "now")
        idle = timedelta(minutes=rng.randint(0, 60))
        old = i < due + later
        spawner.started = now - (timedelta(days=8) if old else timedelta(hours=10))
        spawner.last_activity = now - idle
        spawner.user_options = {"profile": "cpu" if old else profiles[i % len(profiles)]}
        spawner.state = {}
        db.add(spawner)
    db.commit()
    db.close()
    # Their warnings ran out before this run (as restored after a restart): stopped this pass.
    started = (now - timedelta(days=8)).replace(tzinfo=timezone.utc).timestamp()
    # ... and `later` more whose warning runs out at `later_at` (for the pass that expects them)
    records = {
        f"u{i:05d}/": {"started": started, "state": {
            "warned_at": time.time() - 1000, "deadline": time.time() - 100 if i < due else later_at,
            "reason": "it reached the maximum age of 7d",
            "rule": "max-age", "idle_since": started, "snoozes": 0, "hard": True, "returned": 0}}
        for i in range(due + later)
    }
    Path(db_url[len("sqlite:///"):]).with_name("gpuhub-culling.json").write_text(json.dumps({"records": records}))


async def listing(url: str, page_size: int) -> float:
    """idle-culler's listing alone: every page of ``/users?state=ready``."""
    from tornado.httpclient import AsyncHTTPClient, HTTPRequest

    t0 = time.perf_counter()
    next_url = f"{url}/users?state=ready&limit={page_size}"
    while next_url:
        r = await AsyncHTTPClient().fetch(HTTPRequest(next_url, headers={
            "Authorization": f"token {os.environ['JUPYTERHUB_API_TOKEN']}",
            "Accept": "application/jupyterhub-pagination+json"}, request_timeout=60))
        nxt = json.loads(r.body)["_pagination"]["next"]
        next_url = nxt["url"] if nxt else None
    return time.perf_counter() - t0


def make_culler(url: str, page_size: int, concurrency: int):
    from jupyterhub_idle_culler import cull_idle

    from gpuhub_spawner.culling.service import GpuHubCuller

    culler = GpuHubCuller(url=url, api_page_size=page_size, concurrency=concurrency, cull_every=60)
    cull = partial(
        cull_idle, url=url, api_token=os.environ["JUPYTERHUB_API_TOKEN"], inactive_limit=1, logger=culler.log,
        max_age=0, concurrency=concurrency, api_page_size=page_size,
    )
    return culler, cull


async def new_pass(culler, cull) -> tuple[float, dict]:
    """One pass exactly as the service runs it (``GpuHubCuller.cull_pass``), timed."""
    seen: dict = {}
    fetch = type(culler).fetch_decisions

    async def timed_fetch():
        t = time.perf_counter()
        seen["answer"] = await fetch(culler)
        seen["decide"] = time.perf_counter() - t
        return seen["answer"]

    culler.fetch_decisions = timed_fetch
    t0 = time.perf_counter()
    await culler.cull_pass(cull)
    answer = seen["answer"]
    return time.perf_counter() - t0, {"decide": seen["decide"], "servers": answer.servers, "culled": answer.to_cull}


async def old_pass(url: str, public: str, limit: int) -> tuple[float, int]:
    """The previous design's pass: idle-culler with the per-server probing arbiter."""
    from jupyterhub_idle_culler import cull_idle
    from tornado.httpclient import AsyncHTTPClient, HTTPRequest

    headers = {"Authorization": f"token {os.environ['JUPYTERHUB_API_TOKEN']}"}
    seen = 0

    async def get(u):
        r = await AsyncHTTPClient().fetch(HTTPRequest(u, headers=headers, request_timeout=30), raise_error=False)
        return json.loads(r.body) if r.code == 200 else None

    async def arbiter(*, inactive, inactive_limit, server, **kw):
        nonlocal seen
        seen += 1
        if seen > limit:
            return False
        base = public + server["url"]
        await get(base + "api/kernels")
        await get(base + "api/terminals")
        await get(base + "gpuhub/activity")
        r = await AsyncHTTPClient().fetch(
            HTTPRequest(url + "/gpuhub/cull-decisions", method="POST", headers=headers,
                        body=json.dumps({"servers": [server["full_name"]]}), request_timeout=30),
            raise_error=False,
        )
        return json.loads(r.body)["decisions"].get(server["full_name"], {}).get("action") == "cull"

    t0 = time.perf_counter()
    await cull_idle(url=url, api_token=os.environ["JUPYTERHUB_API_TOKEN"], inactive_limit=1,
                    logger=__import__("logging").getLogger("old"), max_age=0, concurrency=10,
                    api_page_size=200, cull_arbiter=arbiter)
    return time.perf_counter() - t0, min(seen, limit)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", type=int, default=5000)
    ap.add_argument("--old-servers", type=int, default=5000, help="servers the old design probes (a sample if fewer)")
    ap.add_argument("--due", type=int, default=50, help="servers due to be stopped in the first new pass")
    ap.add_argument("--later", type=int, default=50, help="servers whose announced stop comes due during the run")
    ap.add_argument("--later-in", type=float, default=300, help="seconds after writing the database when those come due")
    ap.add_argument("--concurrency", type=int, default=20, help="idle-culler's concurrent hub requests (the service runs with 20)")
    ap.add_argument("--page-size", type=int, default=200, help="users per page of idle-culler's listing (the hub allows up to 200 by default)")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="gpuhub-culler-bench-"))
    data = work / "data"
    data.mkdir()
    fake_port, port, hub_port, proxy_api = (free_port() for _ in range(4))
    token = secrets.token_hex(16)
    os.environ["JUPYTERHUB_API_TOKEN"] = token
    chp = REPO / ".venv" / "node" / "node_modules" / ".bin" / "configurable-http-proxy"
    (work / "jupyterhub_config.py").write_text(HUB_CONFIG.format(
        tests=str(REPO / "tests"), fake_port=fake_port, port=port, hub_port=hub_port, proxy_api=proxy_api,
        chp=str(chp) if chp.exists() else "configurable-http-proxy", proxy_token=secrets.token_hex(16),
        data=str(data), policy=str(REPO / "jupyterhub_config" / "profiles.yaml"), token=token, page_size=args.page_size,
    ))
    fake = subprocess.Popen([sys.executable, "-c", FAKE_SERVER, str(fake_port)])
    t0 = time.perf_counter()
    later_at = time.time() + args.later_in
    populate(f"sqlite:///{data}/jupyterhub.sqlite", args.servers, fake_port, args.due, args.later, later_at)
    print(f"wrote {args.servers} users with running servers into the hub database in {time.perf_counter() - t0:.1f} s")
    log = open(work / "hub.log", "wb")
    hub = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", str(work / "jupyterhub_config.py")],
                           cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url, public = f"http://127.0.0.1:{port}/hub/api", f"http://127.0.0.1:{port}"
    try:
        t0 = time.perf_counter()
        while True:
            if hub.poll() is not None:
                raise SystemExit(f"hub exited; see {work / 'hub.log'}")
            try:
                if requests.get(url + "/", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.5)
        # JupyterHub finishes adopting slow servers in the background after init_spawners_timeout
        hub_log = work / "hub.log"
        while hub_log.read_text(errors="replace").count("Adding user") < args.servers and time.perf_counter() - t0 < 600:
            time.sleep(1)
        print(f"hub adopted them and answers after {time.perf_counter() - t0:.1f} s (log: {hub_log})")

        t_list = asyncio.run(listing(url, args.page_size))
        culler, cull = make_culler(url, args.page_size, args.concurrency)
        cpu0 = cpu_seconds(hub.pid)
        new_first, info = asyncio.run(new_pass(culler, cull))
        cpu_first = cpu_seconds(hub.pid) - cpu0
        warm = None
        if later_at - time.time() > 3:
            time.sleep(max(0.0, later_at - time.time() - 3))
        cpu0 = cpu_seconds(hub.pid)
        new_steady, info2 = asyncio.run(new_pass(culler, cull))  # also announces the stops due in 3 s
        cpu_steady = cpu_seconds(hub.pid) - cpu0
        if info2["culled"] == 0 and culler._expect_stops:
            time.sleep(max(0.0, later_at - time.time() + 0.5))
            cpu0 = cpu_seconds(hub.pid)
            warm_time, warm = asyncio.run(new_pass(culler, cull))
            cpu_warm = cpu_seconds(hub.pid) - cpu0
        cpu0 = cpu_seconds(hub.pid)
        old_time, old_n = asyncio.run(old_pass(url, public, args.old_servers))
        cpu_old = cpu_seconds(hub.pid) - cpu0
        per_server = old_time / max(1, old_n)
        old_full = per_server * info2["servers"]
        print()
        print(f"culler pass over {info['servers']} running servers (same hub, same run):")
        print(f"  new, {info['culled']} to stop: {new_first:6.2f} s wall (decide {info['decide']:.2f} s), hub CPU {cpu_first:.2f} s")
        print(f"  (idle-culler's listing alone, {args.page_size} users a page: {t_list:.2f} s)")
        if warm:
            print(f"  new, {warm['culled']} to stop, announced by the pass before (listing while the hub decides): "
                  f"{warm_time:6.2f} s wall (decide {warm['decide']:.2f} s), hub CPU {cpu_warm:.2f} s")
        else:
            print("  (the announced stops came due before the run reached them: raise --later-in)")
        print(f"  new, none to stop: {new_steady:6.2f} s wall (decide {info2['decide']:.2f} s), hub CPU {cpu_steady:.2f} s")
        print(f"  old, per server:   {old_time:6.2f} s wall for {old_n} servers = {per_server * 1000:.1f} ms/server, hub CPU {cpu_old:.2f} s"
              f"{'' if old_n >= info2['servers'] else f' (sample; {old_full:.0f} s scaled to all)'}")
        print(f"  ratio old/new: {old_full / new_first:.0f}x (pass with stops), {old_full / new_steady:.0f}x (pass without)")
    finally:
        os.killpg(hub.pid, signal.SIGTERM)
        try:
            hub.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(hub.pid, signal.SIGKILL)
        fake.terminate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
