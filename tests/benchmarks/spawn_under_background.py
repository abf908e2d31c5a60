"""Spawn-to-ready while the machine runs background work at the lowest priority: run on demand,
as root.

    .venv/bin/python tests/benchmarks/spawn_under_background.py [--rounds 3] [--burners 8] [--weights 0.125,1]

Background work at ``nice 19`` (a Go build, a backup, ``make -j``) is meant to use only the
CPU nobody else wants. Every isolated server sits in the ``gpuhub`` cgroup group, which the
kernel weighs as one entity against every other process (cgroup v1) or every other top-level
group (v2), at ``IsolatedProcessSpawner.servers_cpu_weight`` times the kernel's default. This
runs real hubs, one per weight, each with real isolated ``jupyterhub-singleuser`` servers,
and measures one spawn (API request to server ready) at a time: first on a quiet machine,
then beside ``--burners`` CPU-bound processes at nice 19, interleaving the hubs in rounds.
Printed: medians per weight, and each ratio against the same hub's quiet median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

import conftest  # noqa: E402,F401  (*.localhost resolves to loopback, as in the tests)
from isolation_spawn import POLICY, spawn_once  # noqa: E402
from support.hub import Hub  # noqa: E402

BURN = "import os\nos.nice(19)\nwhile True:\n    pass\n"
GAVE_UP = 120.0  # spawn_once's wait for ready


def timed_spawn(hub: Hub, name: str) -> float:
    """Spawn to ready, or GAVE_UP when the server was not ready by then (it is stopped)."""
    try:
        return spawn_once(hub, name)
    except TimeoutError:
        hub.stop_servers(name)
        return GAVE_UP


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--burners", type=int, default=8, help="CPU-bound processes at nice 19 (default 8)")
    ap.add_argument("--weights", default="0.125,1", help="servers_cpu_weight values, comma-separated")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: isolated servers need accounts and cgroups")
    weights = [float(w) for w in a.weights.split(",")]
    hubs = {}
    try:
        for w in weights:
            h = Hub(
                Path(tempfile.mkdtemp(prefix="bench-bg-")),
                POLICY,
                extra_config=f"c.IsolatedProcessSpawner.servers_cpu_weight = {w!r}\n",
                lab=True,
            )
            hubs[w] = h.start()
        quiet = {w: [] for w in weights}
        loaded = {w: [] for w in weights}
        for r in range(a.rounds):
            for w, h in hubs.items():
                quiet[w].append(timed_spawn(h, "alice"))
            burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(a.burners)]
            try:
                time.sleep(1)
                for w, h in hubs.items():
                    loaded[w].append(timed_spawn(h, "bob"))
            finally:
                for p in burners:
                    p.kill()
                    p.wait()
            print(
                f"round {r + 1}: "
                + "  ".join(
                    f"weight {w:g}: quiet {quiet[w][-1]:.1f} s, beside nice-19 work {loaded[w][-1]:.1f} s" for w in weights
                ),
                flush=True,
            )
        print(f"\n{a.burners} CPU-bound processes at nice 19 on {os.cpu_count()} CPUs, {a.rounds} rounds, spawn to ready:")
        for w in weights:
            q, l_ = statistics.median(quiet[w]), statistics.median(loaded[w])
            gave_up = sum(t >= GAVE_UP for t in loaded[w])
            print(
                f"  servers_cpu_weight {w:g}: quiet {q:.1f} s, beside nice-19 work {l_:.1f} s ({l_ / q:.1f}x)"
                + (f"; {gave_up} of {a.rounds} not ready after {GAVE_UP:.0f} s" if gave_up else "")
            )
    finally:
        for h in hubs.values():
            h.stop()


if __name__ == "__main__":
    from support.lifetime import end_on_sigterm

    end_on_sigterm()  # stopped by `timeout`: its hubs and servers go with it
    main()
