"""The Monday-morning crowd against real hubs, each figure against a baseline from the same run.

What is real: JupyterHub 6.1 started with gpuhub's own config (tests/support/hub.py), its
proxy (the Node configurable-http-proxy by default), the demo login, gpuhub's spawner,
queue and devices (virtual GPUs). To fit hundreds of servers on one small machine, the
single-user servers in ``storm``/``pages``/``handoff`` are a tiny HTTP process
(``tiny_server.py``) on both sides of each comparison; ``spawn`` uses real
``jupyterhub-singleuser`` servers.

    .venv/bin/python tests/benchmarks/crowd.py storm   [--users 200] [--gpus 16] [--proxy node|python|python-capped]
                                                       [--equal-work [--before REV]] [--cpu]
    .venv/bin/python tests/benchmarks/crowd.py pages   [--users 500]
    .venv/bin/python tests/benchmarks/crowd.py handoff [--rounds 5]
    .venv/bin/python tests/benchmarks/crowd.py spawn   [--rounds 3]

``storm``: N users ask for a GPU at once through the public URL. Probes of the hub API run
all along, through the public URL and on the hub's own port. Baseline: the same hub and
proxy with JupyterHub's stock ``SimpleLocalProcessSpawner`` instead of gpuhub's, same storm.
``--proxy python-capped`` reproduces the proxy before this change (tornado's 10 clients).

``storm --equal-work`` reports both comparisons in one run, in interleaved rounds against the
same stock hubs: the Monday-morning storm as users meet it (gpuhub with ``--gpus`` GPUs starts
that many servers and queues the rest; the stock hub starts every one) and equal work
(gpuhub with a GPU for every user: as many launches as the stock hub, each isolated when the
hub runs as root). ``--before REV`` adds a gpuhub hub with the package as it was at REV
(``git archive``, first on ``PYTHONPATH``) doing the equal work, in the same rounds. Every
hub runs ``loop_clock.py``: how long each server's launch held its event loop (the launch's
steps, not its waits), printed beside the probes' mean, p50, p95, p99 and how many probes
were answered in the window (the probes are a closed loop: fewer answers, slower answers on
the whole). ``--cpu`` adds, per hub run, where the machine's CPU went over the window
(``cpu_share.py``: the hub's loop thread and its other threads, servers with their
launchers, the proxy, the benchmark itself), how long the loop waited for a CPU while
runnable, and how many threads were runnable. ``--stacks DIR`` loads ``stall_sampler.py`` into every hub too (diagnosis, not figures: it costs CPU) and
writes, per hub run, where the loop's busy time went over the storm, by function.

``pages``: N waiting users keep their spawn page (progress stream) open through the public
URL; probes while they are open vs before they were opened; then one GPU is freed and the
time until every open page has shown its new state is measured.

``handoff``: a stop frees a GPU; time from the stop request to the next user's page saying
"Admitted" and to that server being ready, vs a stock spawn (request to ready) in the same hub.

``spawn``: request-to-ready of a real jupyterhub-singleuser server, gpuhub's spawner vs stock.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import conftest  # noqa: E402,F401  (resolves *.localhost and keeps its cookies, as browsers do)
from revisions import extract  # noqa: E402
from support.hub import Hub, wait_for  # noqa: E402

TINY = HERE / "tiny_server.py"


def policy(gpus: int) -> str:
    return f"""\
flavors:
  - name: gpu
    local: {{virtual: {gpus}}}
teams:
  - name: crowd
    displayName: Crowd
    groups: [crowd]
    quota: {{gpus: {{gpu: {{nominal: {gpus}}}}}}}
profiles:
  - {{slug: cpu, displayName: CPU only, teams: "*", default: true}}
  - {{slug: gpu-1, displayName: One GPU, gpu: {{count: 1, flavor: gpu}}, teams: [crowd]}}
defaults:
  queueTimeout: 2h
"""


def users_config(names) -> str:
    return (
        "c.DemoAuthenticator.demo_users = dict(c.DemoAuthenticator.demo_users, "
        f"**{{n: {{'groups': ['crowd']}} for n in {list(names)!r}}})\n"
    )


def tiny_config() -> str:
    return f"c.Spawner.cmd = [{sys.executable!r}, {str(TINY)!r}]\n"


BEFORE_GROUP = "gpuhub-bench-before"  # the servers' cgroup group of the --before hub
STOCK = "c.JupyterHub.spawner_class = 'jupyterhub.spawner.SimpleLocalProcessSpawner'\n"

PROXIES = {
    "node": {},
    "python": {"GPUHUB_PROXY_COMMAND": str(Path(sys.executable).parent / "gpuhub-proxy"), "GPUHUB_SUBDOMAINS": "0"},
    "python-capped": {
        "GPUHUB_PROXY_COMMAND": str(Path(sys.executable).parent / "gpuhub-proxy"),
        "GPUHUB_SUBDOMAINS": "0",
        "GPUHUB_PROXY_MAX_CLIENTS": "10",
    },
}


def pct(values, p):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


class Prober:
    """Ordinary requests all along: a user's model from the hub API, timed, errors counted."""

    def __init__(self, hub: Hub, user, threads: int = 2):
        self.hub, self.user = hub, user
        self.samples: dict[str, list[tuple[float, float, int]]] = {"public": [], "hub-port": []}
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, i):
        s = requests.Session()
        s.headers["Authorization"] = f"token {self.user.token}"
        urls = {
            "public": f"{self.hub.url}/hub/api/users/{self.user.name}",
            "hub-port": f"http://{self.hub.users_reach_hub_at()}:{self.hub.hub_port}/hub/api/users/{self.user.name}",
        }
        while not self._stop.is_set():
            for where, url in urls.items():
                t0 = time.perf_counter()
                try:
                    # a new connection each time on both paths, as the proxy opens one per request
                    code = s.get(url, timeout=120, headers={"Connection": "close"}).status_code
                except requests.RequestException:
                    code = 0
                self.samples[where].append((time.time(), time.perf_counter() - t0, code))
            time.sleep(0.05)

    def start(self):
        for t in self.threads:
            t.start()
        return self

    def stop(self):
        self._stop.set()
        for t in self.threads:
            t.join()

    def window(self, where, t0, t1):
        rows = [r for r in self.samples[where] if t0 <= r[0] <= t1]
        return [r[1] for r in rows if r[2] == 200], [r[2] for r in rows if r[2] != 200]


def login_all(hub: Hub, names, threads=16):
    with ThreadPoolExecutor(threads) as pool:
        return dict(zip(names, pool.map(hub.login, names)))


def ready_count(hub: Hub, admin) -> int:
    r = admin.api.get(admin.url("/users?state=ready&limit=10000"), timeout=120)
    return len(r.json()) if r.ok else -1


# -- storm ------------------------------------------------------------------------------
def clock_config(path: Path) -> str:
    """loop_clock.py in the hub: the loop time of each server's launch, one JSON line each."""
    return f"import sys; sys.path.insert(0, {str(HERE)!r}); import loop_clock; loop_clock.install({str(path)!r})\n"


def storm_once(
    label: str, extra: str, env: dict, users: int, gpus: int, window: float, stacks: str | None = None, cpu: bool = False
) -> dict:
    import cpu_share
    import loop_clock

    names = [f"s{i:03d}" for i in range(users)]
    with tempfile.TemporaryDirectory() as tmp:
        clock = Path(tmp) / "launches.jsonl"
        sampler = ""
        if stacks:  # diagnosis: where the loop's time goes (stall_sampler.py), not for the figures
            sampler = f"import sys; sys.path.insert(0, {str(HERE)!r}); import stall_sampler; stall_sampler.install({stacks!r})\n"
        hub = Hub(
            Path(tmp),
            policy(gpus),
            extra_config=users_config(names) + tiny_config() + extra + clock_config(clock) + sampler,
            env=env,
            lab=True,
        )
        load0 = os.getloadavg()[0]
        hub.start()
        try:
            crowd = login_all(hub, names)
            admin = hub.login("admin")
            probe = Prober(hub, admin, threads=4).start()
            if stacks:
                Path(stacks + ".reset").touch()  # the sampler forgets the start-up at its next flush (5 s)
            time.sleep(5)
            t_idle = time.time()
            barrier = threading.Barrier(users)

            def ask(n):
                barrier.wait()
                try:
                    return crowd[n].start("gpu-1").status_code
                except requests.RequestException:
                    return 0

            share = cpu_share.CpuShare(hub.proc.pid, window).start() if cpu else None
            t0 = time.time()
            with ThreadPoolExecutor(users) as pool:
                codes = list(pool.map(ask, names))
            answered = time.time() - t0
            accepted = sum(1 for c in codes if c in (201, 202))  # a request the proxy refused never spawns
            expect = accepted if "Simple" in extra else min(accepted, gpus)
            wait_for(lambda: ready_count(hub, admin) >= expect, 600, f"{expect} servers ready", interval=1)
            ready = time.time() - t0
            time.sleep(max(0.0, t0 + window - time.time()))
            t1 = t0 + window  # the same window on both hubs
            cpu_used = share.stop() if share is not None else None
            probe.stop()
            if stacks:
                time.sleep(6)  # its next flush
            out = {
                "label": label,
                "answered_s": answered,
                "ready_s": ready,
                "codes": {c: codes.count(c) for c in sorted(set(codes))},
                "launches": loop_clock.read(str(clock)),
                "load": (load0, os.getloadavg()[0]),
                "cpu": cpu_used,
            }
            for where in ("public", "hub-port"):
                idle, _ = probe.window(where, t_idle - 5, t_idle)
                lat, errors = probe.window(where, t0, t1)
                out[where] = {"idle": idle, "lat": lat, "errors": errors}
            return out
        finally:
            hub.stop()


def _ms(values, p):
    return f"{pct(values, p):.1f}" if values else "-"


def remove_group(name: str) -> None:
    """The --before hub's servers' group, and what its servers left in it (their processes are gone)."""
    for group in [*Path("/sys/fs/cgroup").glob(f"*/{name}"), Path("/sys/fs/cgroup", name)]:  # v1, v2
        if group.is_dir():
            for leaf in group.iterdir():
                if leaf.is_dir():
                    try:
                        leaf.rmdir()
                    except OSError:
                        pass
            try:
                group.rmdir()
            except OSError:
                pass


def storm(args):
    """Rounds alternate the hubs on the same machine; percentiles pool every round's probes."""
    import cpu_share

    env = PROXIES[args.proxy]
    stock = f"stock spawner ({args.proxy} proxy)"
    monday = f"gpuhub, {args.gpus} GPUs ({args.proxy} proxy)"
    variants = [(monday, "", env, args.gpus)]
    comparisons = [
        (
            f"Monday morning: {args.users} users, {args.gpus} GPUs (gpuhub starts {min(args.gpus, args.users)}, "
            f"queues the rest; stock starts all)",
            monday,
            stock,
        )
    ]
    tmp_src = None
    if args.equal_work:
        equal = f"gpuhub, {args.users} GPUs ({args.proxy} proxy)"
        variants.append((equal, "", env, args.users))
        comparisons.append((f"equal work: {args.users} launches on both", equal, stock))
        if args.before:
            tmp_src = tempfile.TemporaryDirectory()
            old = str(extract(args.before, Path(tmp_src.name)))
            before = f"gpuhub @{args.before}, {args.users} GPUs ({args.proxy} proxy)"
            env_before = dict(env, PYTHONPATH=old + os.pathsep + os.environ.get("PYTHONPATH", ""))
            # its servers in a group of their own: the CPU weight one version sets on its
            # servers' group (servers_cpu_weight) must not carry over to the other's
            variants.append((before, f"c.IsolatedProcessSpawner.cgroup_group = {BEFORE_GROUP!r}\n", env_before, args.users))
            comparisons.append(("equal work, before", before, stock))
            comparisons.append(("equal work, now vs before", equal, before))
    elif args.before:
        raise SystemExit("--before goes with --equal-work")
    variants.append((stock, STOCK, env, args.users))
    runs: dict[str, list[dict]] = {label: [] for label, *_ in variants}
    load_start = os.getloadavg()
    try:
        for i in range(args.rounds):
            # ABBA: every other round runs the hubs in the reverse order, so no hub always
            # follows the same one (and what that one left the machine busy with)
            for label, extra, env_v, gpus in variants if i % 2 == 0 else variants[::-1]:
                stacks = None
                if args.stacks:
                    Path(args.stacks).mkdir(parents=True, exist_ok=True)
                    slug = "-".join("".join(c if c.isalnum() else " " for c in label.split(" (")[0]).split())
                    stacks = str(Path(args.stacks).resolve() / f"{slug}-r{i + 1}.txt")
                runs[label].append(storm_once(label, extra, env_v, args.users, gpus, args.window, stacks, cpu=args.cpu))
    finally:
        if tmp_src is not None:
            tmp_src.cleanup()
            remove_group(BEFORE_GROUP)
    load_end = os.getloadavg()
    print(
        f"\nstorm: {args.users} users ask for one GPU at once; probes over the first {args.window:.0f}s "
        f"of each storm; {args.rounds} round(s), the hubs alternating (ABBA); tiny servers; "
        f"load average {load_start[0]:.1f} at the start, {load_end[0]:.1f} at the end "
        f"(per hub run: "
        + "; ".join(
            f"{label.split(' (')[0]}: " + ", ".join(f"{r['load'][0]:.1f}-{r['load'][1]:.1f}" for r in rs)
            for label, rs in runs.items()
        )
        + ")"
    )
    summary = {}
    for label, rs in runs.items():
        codes: dict = {}
        for r in rs:
            for c, n in r["codes"].items():
                codes[c] = codes.get(c, 0) + n
        answered = ", ".join(f"{r['answered_s']:.1f}" for r in rs)
        ready = ", ".join(f"{r['ready_s']:.1f}" for r in rs)
        print(
            f"{label}: spawn requests answered after {answered}s; servers it starts ready after {ready}s; "
            f"POST codes {json.dumps(codes)}"
        )
        for where in ("public", "hub-port"):
            idle = [x for r in rs for x in r[where]["idle"]]
            lat = [x for r in rs for x in r[where]["lat"]]
            errors = [x for r in rs for x in r[where]["errors"]]
            per_round = ", ".join(f"{pct(r[where]['lat'], 99) * 1000:.0f}" for r in rs)
            summary[label, where] = {p: pct(lat, p) for p in (50, 95, 99)}
            summary[label, where]["mean"] = statistics.fmean(lat) if lat else float("nan")
            summary[label, where]["answered"] = len(lat) / len(rs)
            mean = statistics.fmean(lat) * 1000 if lat else float("nan")
            print(
                f"  {where:9} idle p99 {pct(idle, 99) * 1000:5.0f}ms | storm mean {mean:5.0f}ms p50 {pct(lat, 50) * 1000:5.0f}ms "
                f"p95 {pct(lat, 95) * 1000:6.0f}ms p99 {pct(lat, 99) * 1000:6.0f}ms (p99 per round: {per_round}) | "
                f"errors {len(errors)}/{len(lat) + len(errors)} {sorted(set(errors))}"
            )
        summary[label, "503"] = codes.get(503, 0) + sum(r["public"]["errors"].count(503) for r in rs)
        for kind, what in (("launch", "launch (the process's start)"), ("start", "whole start (queue + launch)")):
            rows = [x for r in rs for x in r["launches"] if x["kind"] == kind and x["outcome"] == "ok"]
            if not rows:
                continue
            loop = [x["loop_ms"] for x in rows]
            cpu = [x["cpu_ms"] for x in rows]
            longest = [x["longest_ms"] for x in rows]
            summary[label, kind] = statistics.median(loop)
            print(
                f"  loop held per {what}: median {_ms(loop, 50)} ms, p95 {_ms(loop, 95)}, max {max(loop):.1f} "
                f"(its CPU: median {_ms(cpu, 50)} ms); longest single step median {_ms(longest, 50)} ms; "
                f"{len(rows) / len(rs):.0f} per storm, {sum(loop) / len(rs) / 1000:.2f} s of loop per storm"
            )
        shares = [r["cpu"] for r in rs if r.get("cpu")]
        if shares:  # --cpu: CPU seconds over the window per kind of process, mean of the rounds
            keys = sorted(
                {k for c in shares for k in c} - set(cpu_share.NOT_CPU), key=lambda k: -sum(c.get(k, 0) for c in shares)
            )
            mean = {k: sum(c.get(k, 0) for c in shares) / len(shares) for k in keys + list(cpu_share.NOT_CPU)}
            print(
                f"  CPU over the {mean['window_s']:.0f}s window: machine busy {mean['machine busy']:.1f} of "
                f"{mean['machine capacity']:.1f} CPU-s ({mean['machine busy'] / mean['machine capacity']:.0%}), "
                f"{mean['runnable threads (mean)']:.1f} threads runnable on average; the hub's loop waited "
                f"{mean['loop waited for a CPU']:.1f} s for a CPU; CPU-s used: "
                + ", ".join(f"{k} {mean[k]:.1f}" for k in keys if abs(mean[k]) >= 0.05)
            )
    print()
    for title, a, b in comparisons:
        parts = []
        for where in ("public", "hub-port"):
            ratios = " ".join(
                f"{p if isinstance(p, str) else f'p{p}'} {summary[a, where][p] / summary[b, where][p]:.2f}x"
                for p in ("mean", 50, 95, 99, "answered")
            )
            parts.append(f"{where}: {ratios}")
        launch = ""
        if (a, "launch") in summary and (b, "launch") in summary:
            launch = f"; loop per launch {summary[a, 'launch']:.1f} / {summary[b, 'launch']:.1f} ms"
        print(f"{title}, {a.split(' (')[0]} / {b.split(' (')[0]}: API " + " | ".join(parts) + launch)
    g = monday
    print(
        f"API p99, public URL / hub's own port (the proxy's share), {g.split(' (')[0]}: "
        f"{summary[g, 'public'][99] / summary[g, 'hub-port'][99]:.2f}x"
    )
    print(
        "503s through the public URL (spawn requests and probes): "
        + ", ".join(f"{label.split(' (')[0]} {summary[label, '503']}" for label in runs)
    )


# -- pages --------------------------------------------------------------------------------
class Page:
    def __init__(self, user):
        self.user = user
        self.resp = user.api.get(user.url(f"/users/{user.name}/server/progress"), stream=True, timeout=(30, 600))
        self.resp.raise_for_status()
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for line in self.resp.iter_lines(decode_unicode=True):
                if line and line.startswith("data:"):
                    self.events.put((time.time(), json.loads(line[5:])))
        except Exception:
            pass
        self.events.put((time.time(), None))

    def until(self, pred, timeout=300):
        while True:
            t, evt = self.events.get(timeout=timeout)
            if evt is None:
                raise EOFError(self.user.name)
            if pred(evt):
                return t, evt

    def close(self):
        try:
            self.resp.raw.connection.sock.shutdown(socket.SHUT_RDWR)
        except (AttributeError, OSError):
            pass
        self.resp.close()


def pos(evt):
    return (evt.get("gpuhub") or {}).get("position")


def pages(args):
    names = [f"p{i:03d}" for i in range(args.users + 1)]
    with tempfile.TemporaryDirectory() as tmp:
        hub = Hub(Path(tmp), policy(1), extra_config=users_config(names) + tiny_config(), env=PROXIES[args.proxy], lab=True)
        hub.start()
        opened = []
        try:
            crowd = login_all(hub, names)
            admin = hub.login("admin")
            holder = crowd[names[0]]
            holder.start("gpu-1")
            holder.wait_ready()
            with ThreadPoolExecutor(64) as pool:
                codes = list(pool.map(lambda n: crowd[n].start("gpu-1").status_code, names[1:]))
            probe = Prober(hub, admin).start()
            time.sleep(10)
            t_before = time.time()
            t_open = time.time()
            with ThreadPoolExecutor(64) as pool:
                opened = list(pool.map(lambda n: Page(crowd[n]), names[1:]))
            first = {}
            for p in opened:
                first[p.user.name] = pos(p.until(lambda e: pos(e) is not None)[1])
            t_all_open = time.time()
            time.sleep(10)
            t_mid = time.time()
            # one GPU frees: the head is admitted, everyone else moves up one
            t_stop = time.time()
            holder.stop()
            seen = []
            for p in opened:
                want = first[p.user.name] - 1
                t, _ = p.until(lambda e: ("Admitted" in e.get("message", "")) if want == 0 else pos(e) == want)
                seen.append(t - t_stop)
            time.sleep(2)
            probe.stop()
            before, err_b = probe.window("public", t_before - 10, t_before)
            during, err_d = probe.window("public", t_all_open, t_mid)
            print(f"\npages: {args.users} waiting users with their spawn page open ({args.proxy} proxy)")
            print(
                f"spawn requests: {json.dumps({c: codes.count(c) for c in sorted(set(codes))})}; "
                f"all {len(opened)} pages open after {t_all_open - t_open:.1f}s; positions 1..{max(first.values())}"
            )
            print(
                f"API through the public URL, no pages open: p50 {pct(before, 50) * 1000:.0f}ms p99 {pct(before, 99) * 1000:.0f}ms errors {len(err_b)}"
            )
            print(
                f"API through the public URL, {len(opened)} pages open: p50 {pct(during, 50) * 1000:.0f}ms p99 {pct(during, 99) * 1000:.0f}ms errors {len(err_d)} "
                f"({pct(during, 99) / pct(before, 99):.2f}x)"
            )
            print(
                f"one GPU freed -> every open page shows its new state: median {statistics.median(seen) * 1000:.0f}ms, "
                f"max {max(seen) * 1000:.0f}ms (goal <= 1000ms)"
            )
        finally:
            for p in opened:
                p.close()
            hub.stop()


# -- handoff and spawn ----------------------------------------------------------------------
def handoff(args):
    names = ["h0", "h1", "h2"]
    with tempfile.TemporaryDirectory() as tmp:
        hub = Hub(Path(tmp), policy(1), extra_config=users_config(names) + tiny_config(), env=PROXIES[args.proxy], lab=True)
        hub.start()
        try:
            u = login_all(hub, names)
            stock, admitted, ready = [], [], []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                u["h2"].start("cpu")
                u["h2"].wait_ready()
                stock.append(time.perf_counter() - t0)
                u["h2"].stop()
                u["h2"].wait_gone()
                u["h0"].start("gpu-1")
                u["h0"].wait_ready()
                u["h1"].start_background("gpu-1")
                wait_for(lambda: u["h1"].server(), 30, "h1's spawn to be pending", interval=0.1)
                page = Page(u["h1"])
                page.until(lambda e: pos(e) == 1)
                t0 = time.perf_counter()
                u["h0"].stop()
                page.until(lambda e: "Admitted" in e.get("message", ""))
                admitted.append(time.perf_counter() - t0)
                u["h1"].wait_ready()
                ready.append(time.perf_counter() - t0)
                page.close()
                for n in ("h0", "h1"):
                    u[n].stop()
                    u[n].wait_gone()
            med = statistics.median
            print(f"\nhandoff over {args.rounds} rounds (tiny servers, {args.proxy} proxy)")
            print(f"stop -> next user's page says Admitted: median {med(admitted) * 1000:.0f}ms max {max(admitted) * 1000:.0f}ms")
            print(f"stop -> next user's server ready:       median {med(ready) * 1000:.0f}ms")
            print(f"a CPU spawn, request -> ready (baseline): median {med(stock) * 1000:.0f}ms")
            print(f"handoff / plain spawn: {med(ready) / med(stock):.2f}x")
        finally:
            hub.stop()


def spawn(args):
    out = {}
    for label, extra in (("gpuhub spawner", ""), ("stock SimpleLocalProcessSpawner", STOCK)):
        with tempfile.TemporaryDirectory() as tmp:
            hub = Hub(Path(tmp), policy(1), extra_config=users_config(["w0"]) + extra, env=PROXIES[args.proxy], lab=True)
            hub.start()
            try:
                u = hub.login("w0")
                times = []
                for _ in range(args.rounds):
                    t0 = time.perf_counter()
                    u.start("cpu")
                    u.wait_ready(timeout=120)
                    times.append(time.perf_counter() - t0)
                    u.stop()
                    u.wait_gone()
                out[label] = times
            finally:
                hub.stop()
    print(f"\nspawn of a real jupyterhub-singleuser, request -> ready, {args.rounds} rounds")
    for label, times in out.items():
        print(f"{label:34} median {statistics.median(times):.2f}s  all {', '.join(f'{t:.2f}' for t in times)}")
    g, s = (statistics.median(v) for v in out.values())
    print(f"gpuhub / stock: {g / s:.2f}x")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["storm", "pages", "handoff", "spawn"])
    ap.add_argument("--users", type=int)
    ap.add_argument("--gpus", type=int, default=16)
    ap.add_argument("--rounds", type=int, help="default: 2 for storm, 3 otherwise")
    ap.add_argument("--window", type=float, default=40.0, help="storm: seconds of probes from the first request")
    ap.add_argument("--proxy", choices=sorted(PROXIES), default="node")
    ap.add_argument(
        "--equal-work", action="store_true", help="storm: also gpuhub with a GPU per user (as many launches as the stock hub)"
    )
    ap.add_argument(
        "--stacks",
        default=None,
        metavar="DIR",
        help="storm: load stall_sampler.py into every hub and write where its loop's time went to DIR "
        "(diagnosis: it costs the hub CPU)",
    )
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="storm: also where the machine's CPU went over the window, per kind of process (cpu_share.py)",
    )
    ap.add_argument(
        "--before",
        default=None,
        metavar="REV",
        help="storm --equal-work: also a gpuhub hub with the package at this git revision",
    )
    args = ap.parse_args()
    if args.rounds is None:
        args.rounds = 2 if args.what == "storm" else 3
    if args.users is None:
        args.users = {"storm": 200, "pages": 500}.get(args.what, 0)
    {"storm": storm, "pages": pages, "handoff": handoff, "spawn": spawn}[args.what](args)


if __name__ == "__main__":
    from support.lifetime import end_on_sigterm

    end_on_sigterm()  # stopped by `timeout`: its hubs and servers go with it
    main()
