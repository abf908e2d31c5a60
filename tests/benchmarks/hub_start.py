"""A real hub's start, as an operator's restart (or a test module) pays it: the hub process's CPU
and the wall time until it first answers.

    .venv/bin/python tests/benchmarks/hub_start.py [--rounds 5] [--before REV]

Each round starts the one-machine hub of ``tests/support/hub.py`` (the example policy, MLflow
off; as root its servers would run isolated) and stops it once ``/hub/api/`` answers. It reads
the hub process's CPU (user + system, with its children that exited: the proxy's own start is
counted apart, it stays running) from ``/proc`` at that moment. With ``--before REV`` the
package as it was at REV (extracted with ``git archive``, first on ``PYTHONPATH``) starts in
the same rounds, alternating, so that both meet the same machine. Prints the medians and the
ratio; on a shared machine only figures from the same run compare.
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

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))
import conftest  # noqa: E402,F401  (*.localhost resolves to loopback, as in the tests)
from revisions import extract  # noqa: E402
from support.hub import Hub  # noqa: E402

POLICY = (REPO / "jupyterhub_config" / "profiles.yaml").read_text()


def process_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and of its children it has waited for."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def one_start(work: Path, env: dict) -> tuple[float, float]:
    hub = Hub(work, POLICY, mlflow=False, env=env, lab=True)
    t0 = time.perf_counter()
    hub.start()
    took = time.perf_counter() - t0
    try:
        return process_cpu(hub.proc.pid), took
    finally:
        hub.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--before", default=None, help="also start the package at this git revision")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        versions = {"HEAD": {}}
        if args.before:
            old = extract(args.before, Path(tmp) / "before")
            subprocess.run(
                [sys.executable, "-m", "compileall", "-q", str(old)],
                check=True,
                stdout=subprocess.DEVNULL,
                env=dict(os.environ, PYTHONDONTWRITEBYTECODE=""),
            )
            versions[args.before] = {"PYTHONPATH": str(old)}
        figures: dict[str, list[tuple[float, float]]] = {name: [] for name in versions}
        for r in range(args.rounds):
            order = list(versions) if r % 2 == 0 else list(reversed(versions))
            for name in order:
                work = Path(tmp) / f"{name}-{r}"
                work.mkdir()
                figures[name].append(one_start(work, versions[name]))
                print(
                    f"round {r + 1} {name}: {figures[name][-1][0]:.2f} CPU-s, answered after {figures[name][-1][1]:.2f} s",
                    flush=True,
                )
    print()
    medians = {name: (statistics.median(c for c, _ in f), statistics.median(w for _, w in f)) for name, f in figures.items()}
    for name, (c, w) in medians.items():
        print(f"{name:>12}: hub CPU to first answer median {c:.2f} s; wall {w:.2f} s ({args.rounds} starts)")
    if args.before:
        (c0, w0), (c1, w1) = medians["HEAD"], medians[args.before]
        print(f"HEAD / {args.before}: CPU {c0 / c1:.2f}x, wall {w0 / w1:.2f}x")


if __name__ == "__main__":
    from support.lifetime import end_on_sigterm

    end_on_sigterm()  # stopped by `timeout`: its hubs and servers go with it
    main()
