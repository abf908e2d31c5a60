"""What fair share costs the hub's event loop per admission, at 500 teams (issue 41).

One machine, ``--teams`` teams in cohorts of ``--cohort`` (as the 500-team scale policy,
tests/benchmarks/bigpolicy.py), one GPU each of nominal quota, ``--waiting`` requests
waiting per team, every GPU held. Each event releases one holder; the queue admits the next
request and refreshes the waiting messages of the touched teams, as in the hub. The same
events run with the policy's ``fairShare`` section and without it (today's FIFO), in this
run, so the ratio compares like with like on this machine; times are the thread's CPU time
(``time.thread_time``), so other work on a shared machine does not inflate them. Printed,
never asserted.

Also timed: seeding the decayed usage from ``--history`` recorded allocations (what a hub
restart does once, ``UsageLedger.seed``).

Run: ``.venv/bin/python tests/benchmarks/fair_share_cost.py`` (a few minutes on 2 busy cores).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "spawner"))

from gpuhub_spawner.admission import AdmissionQueue, Ticket  # noqa: E402
from gpuhub_spawner.admission.fairshare import Interval  # noqa: E402
from gpuhub_spawner.local.devices import DeviceTable  # noqa: E402
from gpuhub_spawner.policy import parse_policy  # noqa: E402


def policy_yaml(teams: int, fair: bool, cohort: int = 10, users: bool = False) -> str:
    out = [f"flavors:\n  - name: a100\n    local: {{virtual: {teams}}}\nteams:\n"]
    for i in range(teams):
        out.append(
            f"  - name: team-{i:03d}\n    groups: [g{i}]\n    cohort: lab-{i // cohort:03d}\n"
            + (f"    weight: {1 + i % 5}\n" if fair else "")
            + "    quota: {gpus: {a100: {nominal: 1}}}\n"
        )
    out.append("profiles:\n  - {slug: g1, displayName: g1, gpu: {count: 1, flavor: a100}, teams: '*'}\n")
    if fair:
        out.append(f"fairShare: {{users: {str(users).lower()}}}\n")
    return "".join(out)


def run(teams: int, waiting: int, events: int, fair: bool, seed: int, cohort: int, users: bool = False) -> list[float]:
    rnd = random.Random(seed)
    policy = parse_policy(policy_yaml(teams, fair, cohort, users))
    now = {"t": 1_000_000.0}
    queue = AdmissionQueue(lambda: policy, DeviceTable(lambda: policy, discover=lambda: []), clock=lambda: now["t"])
    # a week of history: every team's users held GPUs for a while (the decayed usage differs)
    queue.fair.seed(
        [
            Interval(
                f"team-{i:03d}",
                f"u{i}-{j}",
                "a100",
                1,
                now["t"] - rnd.uniform(1, 7) * 86400,
                now["t"] - rnd.uniform(0, 1) * 86400,
            )
            for i in range(teams)
            for j in range(3)
        ],
        policy,
    )
    n = 0

    def ask(team: int) -> None:
        nonlocal n
        n += 1
        user = f"u{team}-{rnd.randrange(3)}"
        queue.submit(Ticket(f"{user}/{n}", user, f"team-{team:03d}", "g1", {"gpu/a100": 1}, created=now["t"] + n * 1e-3))

    queue.held = True  # filled first, admitted in one pass (as after a restart)
    for _ in range(waiting + 1):
        for i in range(teams):
            ask(i)
    queue.held = False
    queue.schedule()  # every GPU held (within nominal), the rest waits
    times = []
    for _ in range(events):
        now["t"] += rnd.uniform(1, 120)
        key = rnd.choice(list(queue.admitted))
        team = queue.admitted[key].team
        t0 = time.thread_time()  # CPU time of this thread: others' load on a shared machine does not count
        queue.release(key)  # frees a GPU: the next request is admitted, touched statuses refreshed
        times.append(time.thread_time() - t0)
        ask(int(team[5:]))  # its user comes back (outside the timing)
    return times


def seed_cost(teams: int, history: int) -> float:
    policy = parse_policy(policy_yaml(teams, True))
    queue = AdmissionQueue(lambda: policy, None)
    rnd = random.Random(1)
    rows = [
        Interval(f"team-{rnd.randrange(teams):03d}", f"u{rnd.randrange(5000)}", "a100", rnd.choice((1, 2)), t, t + 3600)
        for t in (1_000_000.0 - rnd.uniform(0, 10 * 86400) for _ in range(history))
    ]
    t0 = time.thread_time()
    queue.fair.seed(rows, policy)
    return time.thread_time() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teams", type=int, default=500)
    ap.add_argument("--waiting", type=int, default=2, help="requests waiting per team")
    ap.add_argument("--cohort", type=int, default=10, help="teams per cohort")
    ap.add_argument("--events", type=int, default=100)
    ap.add_argument("--history", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of all three modes, in turn")
    a = ap.parse_args(argv)
    modes = [("FIFO", False, False), ("fair share", True, False), ("+ users", True, True)]
    results: dict[str, list[float]] = {name: [] for name, _f, _u in modes}
    # Rounds in turn (FIFO first, then second, then last): on a shared machine a busy spell
    # then slows every mode alike instead of one of them.
    for r in range(a.rounds):
        for name, fair, users in modes[r % 3 :] + modes[: r % 3]:
            results[name] += run(a.teams, a.waiting, a.events, fair, seed=7 + r, cohort=a.cohort, users=users)
    for name, _fair, _users in modes:
        t = results[name]
        print(
            f"{name:11} {a.teams} teams in cohorts of {a.cohort}, {a.teams * a.waiting} waiting: CPU per admission "
            f"median {statistics.median(t) * 1e3:.2f} ms, p95 {sorted(t)[int(0.95 * len(t))] * 1e3:.2f} ms, "
            f"max {max(t) * 1e3:.2f} ms ({len(t)} events)"
        )
    fifo = statistics.median(results["FIFO"])
    print(f"fair share with users: true / FIFO per admission (median): {statistics.median(results['+ users']) / fifo:.2f}x")
    ratio = statistics.median(results["fair share"]) / fifo
    print(
        f"seeding decayed usage from {a.history} recorded allocations: {seed_cost(a.teams, a.history) * 1e3:.0f} ms (once, at start)"
    )
    print(f"fair share / FIFO per admission (median): {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
