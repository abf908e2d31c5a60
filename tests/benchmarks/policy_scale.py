"""A large policy (500 teams, 2,000 profiles) and a long queue: validation, reload, queue events.

Every figure has a baseline from the same run on the same machine:

- validate: today's loader (libyaml, one parse) vs the same loader parsing the way it did
  before (PyYAML's pure-Python parser, twice: once for positions, once for data); and the
  ``gpuhub validate FILE`` command end to end.
- reload: the longest stall of the event loop while the store picks up an edit, with the
  reload in a thread (what the hub does for a policy this size) vs inline.
- queue: the cost of one queue event (a request arrives, then leaves) with 10 and with
  1,000 requests waiting across the teams, today's queue vs the queue before this change
  (``admission/queue.py`` as of ``--before`` in git, run on today's policy model); and
  1,000 submits in a row.

    .venv/bin/python tests/benchmarks/policy_scale.py [--teams 500] [--profiles 2000] [--before c34a54b^]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from bigpolicy import big_policy  # noqa: E402

from gpuhub_spawner.admission import AdmissionQueue, Ticket  # noqa: E402
from gpuhub_spawner.local.devices import DeviceTable  # noqa: E402
from gpuhub_spawner.policy import PolicyStore, loader, parse_policy  # noqa: E402


def best(fn, n=3):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def old_parse(text):
    return yaml.compose(text, Loader=yaml.SafeLoader), yaml.safe_load(text)


def validate(text, path):
    new = best(lambda: parse_policy(text))
    current = loader._compose_and_construct
    loader._compose_and_construct = old_parse
    try:
        before = best(lambda: parse_policy(text), n=1)
    finally:
        loader._compose_and_construct = current
    t0 = time.perf_counter()
    proc = subprocess.run([str(Path(sys.executable).parent / "gpuhub"), "validate", str(path)], capture_output=True, text=True)
    cli = time.perf_counter() - t0
    print(
        f"validate: {new:.2f}s (pure-Python parser, twice: {before:.2f}s; {before / new:.1f}x faster); "
        f"`gpuhub validate` end to end {cli:.2f}s, exit {proc.returncode} (goal <= 1 s)"
    )


async def stall_during_reload(path: Path, text: str, inline: bool) -> tuple[float, float]:
    store = PolicyStore(policy_file=str(path), inline_reload_budget=1e9 if inline else 0.0)
    worst = 0.0
    stop = False

    async def ticker():
        nonlocal worst
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            worst = max(worst, now - last)
            last = now

    task = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.05)
    worst = 0.0
    path.write_text(text.replace("Team 7\n", f"Team {time.time()}\n"))
    t0 = time.perf_counter()
    store.refresh()
    await store.fresh()
    took = time.perf_counter() - t0
    await asyncio.sleep(0.05)
    stop = True
    await task
    PolicyStore.clear_instance()
    return worst, took


def load_queue_module(rev: str):
    try:
        src = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{rev}:spawner/gpuhub_spawner/admission/queue.py"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None
    tmp = Path(tempfile.mkdtemp()) / "gpuhub_queue_before.py"
    tmp.write_text(
        src.replace("from ..policy.model", "from gpuhub_spawner.policy.model")
        .replace("from .quota", "from gpuhub_spawner.admission.quota")
        .replace(
            "from prometheus_client import Gauge, Histogram",  # its metrics in a registry of their own
            "from functools import partial\nfrom prometheus_client import CollectorRegistry, Gauge, Histogram\n"
            "_reg = CollectorRegistry()\nGauge, Histogram = partial(Gauge, registry=_reg), partial(Histogram, registry=_reg)",
        )
    )
    spec = importlib.util.spec_from_file_location("gpuhub_queue_before", tmp)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


async def queue_events(policy, Queue, TicketCls, waiting: int, events: int = 100) -> tuple[float, float]:
    table = DeviceTable(lambda: policy, discover=lambda: [])
    q = Queue(lambda: policy, table)
    teams = [t for t in policy.teams]
    flavor_of = {t.name: next(iter(t.quota.gpus)) for t in teams}
    # fill every device, so that whatever comes next waits
    n = 0
    for t in teams:
        while True:
            f = flavor_of[t.name]
            if not table.free_devices(f):
                break
            tk = TicketCls(key=f"fill{n}/", user=f"fill{n}", team=t.name, profile="p", demand={f"gpu/{f}": 1})
            q.submit(tk)
            n += 1
            if tk.admission is None:
                q.cancel(tk.key)
                break
    t0 = time.perf_counter()
    for i in range(waiting):
        t = teams[i % len(teams)]
        q.submit(TicketCls(key=f"w{i}/", user=f"w{i}", team=t.name, profile="p", demand={f"gpu/{flavor_of[t.name]}": 1}))
    submits = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(events):
        t = teams[(i * 37) % len(teams)]
        q.submit(TicketCls(key=f"e{i}/", user=f"e{i}", team=t.name, profile="p", demand={f"gpu/{flavor_of[t.name]}": 1}))
        q.cancel(f"e{i}/")
    return (time.perf_counter() - t0) / (2 * events), submits


async def main_async(args):
    text = big_policy(args.teams, args.profiles)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "policy.yaml"
        path.write_text(text)
        print(f"policy: {args.teams} teams, {args.profiles} profiles, {len(text) / 1e6:.1f} MB of YAML")
        validate(text, path)
        thread_stall, thread_took = await stall_during_reload(path, text, inline=False)
        inline_stall, inline_took = await stall_during_reload(path, text, inline=True)
        print(
            f"hot reload: longest event-loop stall {thread_stall * 1000:.0f}ms with the reload in a thread "
            f"(new policy in force after {thread_took:.2f}s) vs {inline_stall * 1000:.0f}ms inline "
            f"({inline_stall / thread_stall:.0f}x; goal <= 50ms)"
        )
    policy = parse_policy(text)
    before = load_queue_module(args.before)
    rows = [("today", AdmissionQueue, Ticket)]
    if before is not None:
        rows.append((f"before ({args.before})", before.AdmissionQueue, before.Ticket))
    print("queue: one event (a request arrives, or leaves), mean; and 1,000 submits in a row")
    results = {}
    for label, Q, T in rows:
        for waiting in (10, args.waiting):
            per_event, submits = await queue_events(policy, Q, T, waiting)
            results[label, waiting] = per_event
            extra = f"; {waiting} submits took {submits:.2f}s" if waiting == args.waiting else ""
            print(f"  {label:22} {waiting:>5} waiting: {per_event * 1000:7.2f}ms per event{extra}")
    today = results["today", args.waiting]
    print(
        f"  today, {args.waiting} vs 10 waiting: {today / results['today', 10]:.1f}x (O(all waiting) would be ~{args.waiting / 10:.0f}x)"
    )
    if before is not None:
        print(f"  before / today at {args.waiting} waiting: {results[rows[1][0], args.waiting] / today:.0f}x")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teams", type=int, default=500)
    ap.add_argument("--profiles", type=int, default=2000)
    ap.add_argument("--waiting", type=int, default=1000)
    ap.add_argument("--before", default="c34a54b^", help="git revision of the queue to compare with")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
