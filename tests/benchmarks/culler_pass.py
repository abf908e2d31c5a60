"""Culler passes over N running servers (default 5,000) on real hubs: this tree vs a baseline.

What is real: JupyterHub 6.1 (a subprocess per design, sqlite), the Node
configurable-http-proxy with a route per server, gpuhub's culling API and CullBoard with
the example policy, the culler service's pass (``GpuHubCuller.cull_pass``, in a worker
process that keeps its state between passes, as the service does) with the service's
role and scopes. What is not: the N servers. Their users, spawner rows and server rows are
written into each hub's database before it starts (with JupyterHub's own ORM), and a
benchmark spawner whose ``poll()`` says "running" makes the hub adopt them; every route
points at one small HTTP process that answers as an idle jupyter server does.

``--before REV`` starts a second hub from ``git archive REV`` (its ``spawner/`` first on
``PYTHONPATH``, for the hub and for its culler worker) with the same database and state
file; the passes of the two designs are interleaved, round by round, against hubs that
are otherwise idle. Three kinds of pass, ``--rounds`` of each per design:

- *none due, warnings pending*: nothing to stop, ``--due`` x ``--rounds`` servers warned
  (their stops come later): the hub decides every server and reads the proxy's routes
  for the warned ones' fresh activity;
- *``--due`` due*: one batch of warned servers reaches its deadline (a batch every
  ``--gap`` s from ``--due-in`` s after the databases are written) and is stopped. The
  stops are checked afterwards through the hub's API (not timed);
- *none due, quiet*: after the last batch, nothing is pending.

Each pass reports its wall time (the worker's ``cull_pass``), the time of the decision
request, the hub's **event-loop time** (CPU time of the hub's main thread, where its
asyncio loop runs, during the pass, less what the probe below costs when the hub is idle),
the hub's whole CPU (threads included) and the longest answer of a probe request
(``GET /hub/api/`` every 50 ms) during the pass: the stall a user's request feels.

    .venv/bin/python tests/benchmarks/culler_pass.py --before a0eb490      # ~12 min at 5,000
    .venv/bin/python tests/benchmarks/culler_pass.py --servers 500 --due-in 60 --gap 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from support.ports import free_port  # noqa: E402

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
# The culler's pass runs in the benchmark's worker (timed there), not as a hub-managed
# process: the same service name and role (configure_culler's scopes), a known token.
c.JupyterHub.services = [dict(name="gpuhub-culler", api_token={token!r})]
# ... checked as the hub checks the token it generates for a managed service (one hash
# round): a token from the config is otherwise hashed 16,384 times on every request,
# ~10 ms of the hub's loop per request that production does not pay.
c.JupyterHub.trust_user_provided_tokens = True
"""

# One design's culler, kept alive between passes (the old design remembered whether the
# previous answer announced a stop). Reads a line per pass, answers one JSON line.
WORKER = textwrap.dedent(
    """
    import asyncio, inspect, json, os, sys, time
    from functools import partial
    from gpuhub_spawner.culling.service import GpuHubCuller
    url, page, conc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    culler = GpuHubCuller(url=url, api_page_size=page, concurrency=conc, cull_every=60)
    batch = "cull" in inspect.signature(GpuHubCuller.cull_pass).parameters  # idle-culler lists and stops
    if batch:
        from jupyterhub_idle_culler import cull_idle
        cull = partial(cull_idle, url=url, api_token=os.environ["JUPYTERHUB_API_TOKEN"], inactive_limit=1,
                       logger=culler.log, max_age=0, concurrency=conc, api_page_size=page,
                       remove_named_servers=False, cull_users=False)
    else:
        culler.configure_client()
    seen = {}
    fetch = type(culler).fetch_decisions
    async def timed_fetch():
        t = time.perf_counter()
        seen["answer"] = await fetch(culler)
        seen["decide"] = time.perf_counter() - t
        return seen["answer"]
    culler.fetch_decisions = timed_fetch
    loop = asyncio.new_event_loop()
    print(json.dumps({"design": "list-and-stop (idle-culler)" if batch else "stop what is due"}), flush=True)
    for line in sys.stdin:
        seen.clear()
        t0 = time.perf_counter()
        counts = loop.run_until_complete(culler.cull_pass(cull) if batch else culler.cull_pass())
        wall = time.perf_counter() - t0
        a = seen.get("answer")
        print(json.dumps({"wall": wall, "decide": seen.get("decide"), "servers": a.servers if a else None,
                          "to_stop": a.to_cull if a else None, "counts": counts}), flush=True)
    """
)


def populate(db_url: str, n: int, fake_port: int, batches: list[tuple[int, float]], now: datetime) -> None:
    """N users, each with a running default server, written with JupyterHub's ORM.

    ``batches``: (size, deadline) — servers u00000... in that order, past the maximum age
    (7d) with a warning restored from the state file that runs out at ``deadline`` (as a
    hub restart restores it), so each batch is stopped by the first pass after its deadline.
    The others (10 h old, active within the hour) are quiet for the run: CPU servers by
    their 8h timeout, GPU servers (virtual GPUs: no reading) by a busy GPU reading restored
    from the state file at the time of writing (their GPU-idle rule fires 30 min later).
    """
    from jupyterhub import orm

    db = orm.new_session_factory(db_url)()
    rng = random.Random(1)
    profiles = ["cpu", "cpu", "cpu", "a100-1", "l4-1"]
    warned = sum(size for size, _ in batches)
    for i in range(n):
        name = f"u{i:05d}"
        user = orm.User(name=name)
        db.add(user)
        server = orm.Server(ip="127.0.0.1", port=fake_port, base_url=f"/user/{name}/")
        spawner = orm.Spawner(name="", user=user, server=server)
        old = i < warned
        spawner.started = now - (timedelta(days=8) if old else timedelta(hours=10))
        spawner.last_activity = now - timedelta(minutes=rng.randint(0, 60))
        spawner.user_options = {"profile": "cpu" if old else profiles[i % len(profiles)]}
        spawner.state = {}
        db.add(spawner)
    db.commit()
    db.close()
    started = (now - timedelta(days=8)).replace(tzinfo=timezone.utc).timestamp()
    ten_hours = (now - timedelta(hours=10)).replace(tzinfo=timezone.utc).timestamp()
    records = {
        f"u{i:05d}/": {"started": ten_hours, "state": {}, "gpu_last_busy": time.time()}
        for i in range(warned, n)
        if profiles[i % len(profiles)] != "cpu"
    }
    i = 0
    for size, deadline in batches:
        for _ in range(size):
            records[f"u{i:05d}/"] = {
                "started": started,
                "state": {
                    "warned_at": deadline - 900,
                    "deadline": deadline,
                    "reason": "it reached the maximum age of 7d",
                    "rule": "max-age",
                    "idle_since": started,
                    "snoozes": 0,
                    "hard": True,
                    "returned": 0,
                },
            }
            i += 1
    Path(db_url[len("sqlite:///") :]).with_name("gpuhub-culling.json").write_text(json.dumps({"records": records}))


def thread_cpu(pid: int, tid: int | None = None) -> float:
    """CPU seconds of a process (or of one of its threads: the main thread is ``tid == pid``)."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Design:
    """One hub (this tree or a baseline) and its culler worker."""

    def __init__(self, label: str, spawner_dir: Path, work: Path, args, token: str, fake_port: int):
        self.label, self.work, self.token = label, work, token
        self.data = work / "data"
        self.data.mkdir(parents=True)
        port, hub_port, proxy_api = free_port(), free_port(), free_port()
        self.url, self.public = f"http://127.0.0.1:{port}/hub/api", f"http://127.0.0.1:{port}"
        self.env = dict(
            os.environ,
            JUPYTERHUB_API_TOKEN=token,
            PYTHONPATH=os.pathsep.join([str(spawner_dir), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        )
        chp = REPO / ".venv" / "node" / "node_modules" / ".bin" / "configurable-http-proxy"
        (work / "jupyterhub_config.py").write_text(
            HUB_CONFIG.format(
                tests=str(REPO / "tests"),
                fake_port=fake_port,
                port=port,
                hub_port=hub_port,
                proxy_api=proxy_api,
                chp=str(chp) if chp.exists() else "configurable-http-proxy",
                proxy_token=secrets.token_hex(16),
                data=str(self.data),
                policy=str(REPO / "jupyterhub_config" / "profiles.yaml"),
                token=token,
                page_size=args.page_size,
            )
        )
        self.hub = self.worker = None
        self.passes: dict[str, list[dict]] = {}
        self.probe_rate = 0.0

    def start_hub(self) -> None:
        self.log_path = self.work / "hub.log"
        self.hub = subprocess.Popen(
            [sys.executable, "-m", "jupyterhub", "-f", str(self.work / "jupyterhub_config.py")],
            cwd=self.work,
            env=self.env,
            stdout=open(self.log_path, "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def adopted(self, n: int) -> bool:
        if self.hub.poll() is not None:
            raise SystemExit(f"{self.label}: hub exited; see {self.log_path}")
        try:
            if requests.get(self.url + "/", timeout=2).status_code != 200:
                return False
        except requests.RequestException:
            return False
        # JupyterHub finishes adopting slow servers in the background after init_spawners_timeout
        return self.log_path.read_text(errors="replace").count("Adding user") >= n

    def start_worker(self, args) -> None:
        self.worker = subprocess.Popen(
            [sys.executable, "-c", WORKER, self.url, str(args.page_size), str(args.concurrency)],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.work / "worker.log", "wb"),
            text=True,
        )
        self.design = json.loads(self.worker.stdout.readline())["design"]

    def loop_cpu(self) -> float:
        return thread_cpu(self.hub.pid, self.hub.pid)

    def stop(self) -> None:
        if self.worker:
            self.worker.kill()
        if self.hub:
            try:
                os.killpg(self.hub.pid, signal.SIGTERM)
                self.hub.wait(30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self.hub.pid, signal.SIGKILL)


async def probe(url: str, stop: asyncio.Event, every: float = 0.05) -> float:
    """Longest answer to ``GET /hub/api/`` while ``stop`` is not set (a request's wait)."""
    from tornado.httpclient import AsyncHTTPClient

    client, worst = AsyncHTTPClient(force_instance=True), 0.0
    while not stop.is_set():
        t = time.perf_counter()
        await client.fetch(url + "/", raise_error=False, request_timeout=120)
        worst = max(worst, time.perf_counter() - t)
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass
    client.close()
    return worst


async def idle_probe_rate(d: Design, windows: int = 5, seconds: float = 1.0) -> float:
    """Loop CPU per second the probe alone costs an idle hub (subtracted from each pass):
    the least of a few windows, as the hub's own periodic work (route checks) may fall
    into one."""
    rates = []
    for _ in range(windows):
        stop = asyncio.Event()
        c0 = d.loop_cpu()
        task = asyncio.ensure_future(probe(d.url, stop))
        await asyncio.sleep(seconds)
        stop.set()
        await task
        rates.append((d.loop_cpu() - c0) / seconds)
    return min(rates)


async def one_pass(d: Design, kind: str) -> dict:
    stop = asyncio.Event()
    loop0, cpu0 = d.loop_cpu(), thread_cpu(d.hub.pid)
    task = asyncio.ensure_future(probe(d.url, stop))
    d.worker.stdin.write("pass\n")
    d.worker.stdin.flush()
    line = await asyncio.get_running_loop().run_in_executor(None, d.worker.stdout.readline)
    stop.set()
    stall = await task
    r = json.loads(line)
    r["loop_raw"] = d.loop_cpu() - loop0
    r["loop"] = max(0.0, r["loop_raw"] - d.probe_rate * r["wall"])
    r["cpu"] = thread_cpu(d.hub.pid) - cpu0
    r["stall"] = stall
    d.passes.setdefault(kind, []).append(r)
    return r


def still_running(d: Design, names: list[str]) -> int:
    h = {"Authorization": f"token {d.token}"}
    return sum(1 for n in names if requests.get(f"{d.url}/users/{n}/server", headers=h, timeout=30).json().get("ready"))


def fmt(r: dict) -> str:
    stops = "" if not r.get("counts") else " (" + ", ".join(f"{n} {k}" for k, n in sorted(r["counts"].items())) + ")"
    return (
        f"wall {r['wall']:6.2f} s  decide {r['decide'] or 0:5.2f} s  hub loop {r['loop']:5.2f} s "
        f"(raw {r['loop_raw']:5.2f})  "
        f"hub CPU {r['cpu']:5.2f} s  longest probe {r['stall'] * 1000:6.0f} ms  to stop {r['to_stop']}{stops}"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", type=int, default=5000)
    ap.add_argument("--due", type=int, default=50, help="servers stopped in each pass with stops")
    ap.add_argument("--rounds", type=int, default=3, help="passes of each kind per design")
    ap.add_argument("--before", metavar="REV", help="also run the design at this git revision (interleaved)")
    ap.add_argument(
        "--due-in",
        type=float,
        default=900,
        help="seconds after the databases are written when the first batch comes due (covers the hubs' adoption)",
    )
    ap.add_argument(
        "--gap", type=float, default=120, help="seconds between batches (longer than both designs' passes with stops)"
    )
    ap.add_argument("--concurrency", type=int, default=20, help="the culler's concurrent hub requests (the service runs with 20)")
    ap.add_argument("--page-size", type=int, default=200, help="users per page of idle-culler's listing (the baseline's)")
    args = ap.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="gpuhub-culler-bench-"))
    token = secrets.token_hex(16)
    fake_port = free_port()
    fake = subprocess.Popen([sys.executable, "-c", FAKE_SERVER, str(fake_port)])
    designs = [Design("this tree", REPO / "spawner", root / "after", args, token, fake_port)]
    if args.before:
        rev = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", args.before], check=True, capture_output=True, text=True
        ).stdout.strip()
        src = root / "before-src"
        src.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "spawner"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        designs.append(Design(f"before ({rev})", src / "spawner", root / "before", args, token, fake_port))
    now = datetime.now(timezone.utc).replace(tzinfo=None)
    t_write = time.time()
    deadlines = [t_write + args.due_in + r * args.gap for r in range(args.rounds)]
    batch_users = [[f"u{r * args.due + i:05d}" for i in range(args.due)] for r in range(args.rounds)]
    try:
        for d in designs:
            t0 = time.perf_counter()
            populate(f"sqlite:///{d.data}/jupyterhub.sqlite", args.servers, fake_port, [(args.due, dl) for dl in deadlines], now)
            print(f"{d.label}: wrote {args.servers} users with running servers in {time.perf_counter() - t0:.1f} s", flush=True)
        t0 = time.perf_counter()
        for d in designs:
            d.start_hub()
        while not all(d.adopted(args.servers) for d in designs):
            if time.perf_counter() - t0 > 1200:
                raise SystemExit("the hubs did not adopt the servers within 20 minutes")
            time.sleep(2)
        print(
            f"hubs adopted {args.servers} servers each and answer after {time.perf_counter() - t0:.1f} s ({root}/*/hub.log)",
            flush=True,
        )
        for d in designs:
            d.start_worker(args)
            d.probe_rate = asyncio.run(idle_probe_rate(d))
            print(
                f"  {d.label}: the probe alone costs the idle hub's loop {d.probe_rate * 1000:.0f} ms/s "
                f"(subtracted from 'hub loop'; 'loop raw' keeps it)",
                flush=True,
            )
        load = [os.getloadavg()[0]]

        def rounds(kind: str, r: int) -> None:
            order = designs if r % 2 == 0 else designs[::-1]
            for d in order:
                res = asyncio.run(one_pass(d, kind))
                print(f"  {kind:<34} {d.label:<16} {fmt(res)}", flush=True)
                load.append(os.getloadavg()[0])

        print("passes (designs interleaved, order alternating):", flush=True)
        for r in range(args.rounds):
            if time.time() > deadlines[0] - 62:
                print("  (no time left for passes with warnings pending before the first batch: raise --due-in)")
                break
            rounds("none due, warnings pending", r)
        for r in range(args.rounds):
            time.sleep(max(0.0, deadlines[r] + 0.5 - time.time()))
            late = r + 1 < args.rounds and time.time() > deadlines[r + 1]
            rounds(f"{args.due} due" + (" (late: more batches due)" if late else ""), r)
            for d in designs:
                left = still_running(d, batch_users[r])
                if left:
                    print(f"    {d.label}: {left} of batch {r}'s {args.due} servers still ready after the pass")
        for r in range(args.rounds):
            rounds("none due, quiet", r)

        print(
            f"\nculler passes over {args.servers} running servers, median of {args.rounds} "
            f"(load average {min(load):.1f}-{max(load):.1f} on {os.cpu_count()} cores):"
        )
        kinds = list(designs[0].passes)
        for kind in kinds:
            for d in designs:
                rs = d.passes.get(kind, [])
                if not rs:
                    continue
                med = {
                    k: statistics.median(r[k] or 0 for r in rs) for k in ("wall", "decide", "loop", "loop_raw", "cpu", "stall")
                }
                print(
                    f"  {kind:<34} {d.label:<16} wall {med['wall']:6.2f} s  hub loop {med['loop']:5.2f} s "
                    f"(raw {med['loop_raw']:5.2f})  hub CPU {med['cpu']:5.2f} s  decide {med['decide']:5.2f} s  "
                    f"longest probe {med['stall'] * 1000:5.0f} ms"
                )
            if len(designs) == 2 and designs[1].passes.get(kind):
                a, b = (statistics.median(r["wall"] for r in d.passes[kind]) for d in designs)
                la, lb = (statistics.median(r["loop"] for r in d.passes[kind]) for d in designs)
                print(f"  {'':<34} {'ratio':<16} wall {a / b:6.2f}x    hub loop {la / lb if lb else float('nan'):5.2f}x")
    finally:
        for d in designs:
            d.stop()
        fake.terminate()
    return 0


if __name__ == "__main__":
    from support.lifetime import end_on_sigterm

    end_on_sigterm()  # stopped by `timeout`: its hubs and servers go with it
    raise SystemExit(main())
