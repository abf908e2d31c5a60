"""`gpuhub validate` end to end, as a user runs it: the command's wall time in a fresh process.

    .venv/bin/python tests/benchmarks/validate_cli.py [--rounds 15] [--before REV]

Each round runs, in a shuffled order, ``.venv/bin/gpuhub validate`` on the 500-team,
2,000-profile policy (``bigpolicy.py``) and on the example policy
(``jupyterhub_config/profiles.yaml``), and ``python -c pass`` (the floor: starting Python).
With ``--before REV`` the same two commands also run the package as it was at REV (extracted
with ``git archive`` and put first on ``PYTHONPATH``), in the same rounds. Prints medians
(and p10/p90) of the wall time per command, the median CPU time (user + system, which
another process's load changes less), and the ratios; on a shared machine only figures from the same
run compare. Both packages run from their bytecode, as installed (``compileall`` first, and
``PYTHONDONTWRITEBYTECODE`` is dropped for the runs): without it each run of the extracted
``--before`` package would compile all of it from source, and time the compiler.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from bigpolicy import big_policy  # noqa: E402
from revisions import extract  # noqa: E402

GPUHUB = Path(sys.executable).parent / "gpuhub"
EXAMPLE = REPO / "jupyterhub_config" / "profiles.yaml"


def compile_tree(package: Path) -> None:
    """Write the package's bytecode (as ``pip install`` does), quietly."""
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(package)],
        check=True,
        stdout=subprocess.DEVNULL,
        env=dict(os.environ, PYTHONDONTWRITEBYTECODE=""),
    )


def timed(cmd: list[str], env: dict) -> tuple[float, float]:
    """Wall seconds, and CPU seconds (user + system) of the command's process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    took = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} exited {proc.returncode}:\n{proc.stderr}")
    return took, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--before", default=None, help="also time the package at this git revision")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        big = Path(tmp) / "big.yaml"
        big.write_text(big_policy())
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        # As installed: pip writes the bytecode at install time. Without it (this machine sets
        # PYTHONDONTWRITEBYTECODE) every run would compile the changed modules (or, for --before,
        # the whole extracted package) from source and time the compiler.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        runs: dict[str, tuple[list[str], dict]] = {
            "python -c pass (floor)": ([sys.executable, "-c", "pass"], env),
            "validate 500 teams": ([str(GPUHUB), "validate", str(big)], env),
            "validate example": ([str(GPUHUB), "validate", str(EXAMPLE)], env),
        }
        compile_tree(REPO / "spawner" / "gpuhub_spawner")
        if args.before:
            before = extract(args.before, Path(tmp) / "before")
            compile_tree(before / "gpuhub_spawner")
            old = dict(env, PYTHONPATH=str(before))
            runs[f"validate 500 teams @{args.before}"] = ([str(GPUHUB), "validate", str(big)], old)
            runs[f"validate example @{args.before}"] = ([str(GPUHUB), "validate", str(EXAMPLE)], old)
        for cmd, e in runs.values():  # warm the page cache and the bytecode once, untimed
            timed(cmd, e)
        times: dict[str, list[float]] = {name: [] for name in runs}
        cpu: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            order = list(runs)
            random.shuffle(order)
            for name in order:
                wall, used = timed(*runs[name])
                times[name].append(wall)
                cpu[name].append(used)
        print(
            f"`gpuhub validate` end to end, {args.rounds} interleaved rounds "
            f"({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end)"
        )
        for name, ts in times.items():
            print(
                f"  {name:<40} median {statistics.median(ts):5.2f}s  p10 {pct(ts, 10):5.2f}  p90 {pct(ts, 90):5.2f}"
                f"   CPU median {statistics.median(cpu[name]):5.2f}s"
            )
        med = {name: statistics.median(ts) for name, ts in times.items()}
        print(f"  500 teams / example: {med['validate 500 teams'] / med['validate example']:.2f}x (goal: 500 teams <= 1 s)")
        if args.before:
            b = f"validate 500 teams @{args.before}"
            e = f"validate example @{args.before}"
            print(
                f"  now / @{args.before}: 500 teams {med['validate 500 teams'] / med[b]:.2f}x, "
                f"example {med['validate example'] / med[e]:.2f}x"
            )


if __name__ == "__main__":
    main()
