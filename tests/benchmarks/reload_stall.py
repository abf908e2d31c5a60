"""A policy edit on a real hub with every listener on: the longest stall a user's request feels.

    .venv/bin/python tests/benchmarks/reload_stall.py [--rounds 4] [--window 20] [--mlflow] [--before REV]
        [--stacks FILE] [--keep DIR]

A real JupyterHub with gpuhub's own configuration (``tests/support/hub.py``: the one-machine
broker and queue, the usage recorder, audit trail and metrics, the policy's roles followed
into the hub's database, the culler and reclaimer, batch jobs; ``--mlflow`` adds the MLflow
service) runs the 500-team, 2,000-profile policy (``bigpolicy.py``). A probe thread asks the
hub for ``GET /hub/api/`` (the cheapest request it answers, on its own port, keep-alive)
every 5 ms and records each answer's latency.

Each round has two windows of ``--window`` seconds, in a shuffled order: one in which the
policy file is edited once (a team renamed and given a lead group: a diff for the audit
trail, a role change for the database), and one in which nothing happens (the baseline,
same hub, same run). The figure is the longest latency in each window; the hub picks up
the edit within ``PolicyStore.check_interval`` (2 s), and the window covers the reload,
every listener and the audit's diff (the benchmark checks that both the "Loaded policy"
line and the ``policy_reloaded`` entry came within the window).

``--stacks FILE`` loads ``stall_sampler.py`` into the hub of "now" and writes where its loop
stalled (the main thread's stacks, looks delayed by a thread holding the GIL with that
thread's stack, garbage collections over 10 ms, the objects ``gc.freeze`` hides and, at the
end, what they hide that is garbage), and prints when each window's longest answer was sent;
diagnosis only (it costs the hub CPU). ``--keep DIR`` keeps the hubs' directories (their logs).

``--before REV`` runs a second hub with the package as it was at REV (``git archive``, first
on ``PYTHONPATH``), in the same rounds, so the two compare on one machine at one time.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from bigpolicy import big_policy  # noqa: E402
from revisions import extract  # noqa: E402
from support.hub import Hub  # noqa: E402

_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class Probe:
    """``GET /hub/api/`` every ``every`` seconds; (sent at, latency) of each answer."""

    def __init__(self, url: str, every: float = 0.005):
        self.url, self.every = url, every
        self.samples: list[tuple[float, float]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        s = requests.Session()
        next_at = time.perf_counter()
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                ok = s.get(self.url, timeout=30).status_code == 200
            except requests.RequestException:
                ok = False
            took = time.perf_counter() - t0
            if ok:
                self.samples.append((t0, took))
            else:
                self.errors += 1
            next_at = max(next_at + self.every, time.perf_counter())
            time.sleep(max(0.0, next_at - time.perf_counter()))

    def start(self) -> "Probe":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def window(self, t0: float, t1: float) -> list[float]:
        """Latencies of the requests sent in [t0, t1), once the one in flight at t1 has come
        back (a stall that ends the window is in it, however long)."""
        deadline = time.perf_counter() + 120
        while not (self.samples and self.samples[-1][0] >= t1) and time.perf_counter() < deadline:
            time.sleep(0.01)
        return [lat for at, lat in self.samples if t0 <= at < t1]


class Subject:
    """One hub under test, its policy's data, its probe."""

    def __init__(self, label: str, workdir: Path, text: str, mlflow: bool, env: dict, stacks: str | None = None):
        self.label = label
        self.data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        extra = ""
        if stacks:  # where the loop stalls: stall_sampler.py in the hub's process
            extra = f"\nimport sys; sys.path.insert(0, {str(HERE)!r}); import stall_sampler; stall_sampler.install({stacks!r})\n"
        self.hub = Hub(workdir, text, extra_config=extra, mlflow=mlflow, env=env, lab=True)
        self.edits = 0
        self.probe: Probe | None = None
        self.edit_max: list[float] = []
        self.idle_max: list[float] = []
        self.edit_p99: list[float] = []
        self.idle_p99: list[float] = []
        self.applied: list[float] = []  # write -> "Loaded policy" in the log (s)
        self.audited: list[float] = []  # write -> the policy_reloaded entry in the audit trail (s)
        self._seen = {"loaded": [0, 0], "reloaded": [0, 0]}  # (bytes read, count) per file
        self.late = 0  # edits not applied and audited within the window
        self.verbose = bool(stacks)

    def start(self) -> None:
        self.hub.start(timeout=180)
        self.probe = Probe(f"http://127.0.0.1:{self.hub.hub_port}/hub/api/").start()

    def count(self, what: str) -> int:
        """How many "Loaded policy" lines the log has, or policy_reloaded entries the audit trail
        (read on from where the last look stopped: the probe's requests fill the log)."""
        path, needle = (
            (self.hub.log, b"Loaded policy ")
            if what == "loaded"
            else (self.hub.data / "gpuhub-audit.jsonl", b'"event": "policy_reloaded"')
        )
        seen = self._seen[what]
        try:
            with open(path, "rb") as f:
                f.seek(seen[0])
                chunk = f.read()
        except OSError:
            return seen[1]
        end = chunk.rfind(b"\n") + 1  # whole lines only
        seen[0] += end
        seen[1] += chunk[:end].count(needle)
        return seen[1]

    def next_edit(self) -> str:
        """The edited file's text, made before the window opens: libyaml's dump of the whole
        policy holds this process's interpreter lock for 0.1-0.4 s, and the probe is a thread
        of this process, so an edit made inside the window timed the benchmark's own dump as
        the hub's stall (the longest answers came 0.1-0.2 s after the write, before the hub
        had even seen the file change)."""
        self.edits += 1
        i = self.edits
        data = copy.deepcopy(self.data)
        team = data["teams"][i % len(data["teams"])]
        team["displayName"] = f"{team['displayName']} (edit {i})"
        team["leads"] = [f"lead-{i}"]
        return yaml.dump(data, Dumper=_Dumper, sort_keys=False)

    def window(self, seconds: float, edit: bool) -> None:
        loaded, reloaded = self.count("loaded"), self.count("reloaded")
        text = self.next_edit() if edit else None
        time.sleep(1)  # the probe's requests held up by the dump are answered before the window
        t0, wall0 = time.perf_counter(), time.time()
        if text is not None:
            self.hub.policy.write_text(text)  # one write, the lock released while it writes
        applied = audited = None
        while time.perf_counter() < t0 + seconds:
            if edit and applied is None and self.count("loaded") > loaded:
                applied = time.perf_counter() - t0
            if edit and audited is None and self.count("reloaded") > reloaded:
                audited = time.perf_counter() - t0
            time.sleep(0.1)
        lat = self.probe.window(t0, t0 + seconds)
        assert lat, f"{self.label}: no probe answered in the window"
        top, p99 = max(lat), sorted(lat)[int(0.99 * (len(lat) - 1))]
        if self.verbose:  # to match with --stacks' times: when the window's longest wait began
            at = next(a for a, v in self.probe.samples if t0 <= a < t0 + seconds and v == top)
            print(
                f"  {self.label}: {'edit' if edit else 'idle'} window from {_clock(wall0)}, its longest "
                f"answer {top * 1000:.0f} ms sent at {_clock(wall0 + at - t0)}",
                flush=True,
            )
        if edit:
            if applied is None or audited is None:  # the hub is that slow: wait it out, say so
                deadline = time.perf_counter() + 180
                while (self.count("loaded") <= loaded or self.count("reloaded") <= reloaded) and time.perf_counter() < deadline:
                    time.sleep(0.2)
                lat = self.probe.window(t0, time.perf_counter())
                top = max(lat)
                done = time.perf_counter() - t0
                applied, audited = applied or done, audited or done
                self.late += 1
                print(
                    f"  {self.label}: the edit took {done:.1f} s to be applied and audited (> the "
                    f"{seconds:.0f} s window); its stall is taken over that time",
                    flush=True,
                )
            self.edit_max.append(top)
            self.edit_p99.append(p99)
            self.applied.append(applied)
            self.audited.append(audited)
        else:
            self.idle_max.append(top)
            self.idle_p99.append(p99)

    def stop(self) -> None:
        if self.probe is not None:
            self.probe.stop()
        self.hub.stop()


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


def ms(values) -> str:
    return ", ".join(f"{v * 1000:.0f}" for v in values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--window", type=float, default=20.0, help="seconds per window (the edit must be applied in it)")
    ap.add_argument("--mlflow", action="store_true", help="also run the MLflow service (~450 MiB, ~10 s of CPU)")
    ap.add_argument("--before", default=None, help="a second hub with the package at this git revision")
    ap.add_argument(
        "--stacks",
        default=None,
        metavar="FILE",
        help="sample the hub's main thread (stall_sampler.py) and write where its stalls went to FILE",
    )
    ap.add_argument("--keep", default=None, metavar="DIR", help="run the hubs in DIR and keep it (their logs)")
    args = ap.parse_args()
    text = big_policy()
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    with contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory() as tmp:
        subjects = [Subject("now", Path(tmp) / "now", text, args.mlflow, {}, args.stacks)]
        if args.before:
            old = str(extract(args.before, Path(tmp) / "before-src"))
            subjects.append(
                Subject(
                    f"@{args.before}",
                    Path(tmp) / "before",
                    text,
                    args.mlflow,
                    {"PYTHONPATH": old + os.pathsep + os.environ.get("PYTHONPATH", "")},
                )
            )
        try:
            for s in subjects:
                s.start()
            time.sleep(5)  # the start's own work (roles, reconcile) out of the way
            if args.stacks:
                Path(args.stacks + ".reset").touch()
                time.sleep(6)
            for r in range(args.rounds):
                plan = [(s, edit) for s in subjects for edit in (False, True)]
                random.shuffle(plan)
                for s, edit in plan:
                    s.window(args.window, edit)
                print(
                    f"round {r + 1}: "
                    + "; ".join(
                        f"{s.label} edit max {s.edit_max[-1] * 1000:.0f} ms, idle max {s.idle_max[-1] * 1000:.0f} ms "
                        f"(applied after {s.applied[-1]:.1f} s, audited after {s.audited[-1]:.1f} s)"
                        for s in subjects
                    ),
                    flush=True,
                )
        finally:
            if args.stacks:  # what the frozen objects hide (stall_sampler.py): before the hub stops
                Path(args.stacks + ".leak").touch()
                deadline = time.time() + 60
                while Path(args.stacks + ".leak").exists() and time.time() < deadline:
                    time.sleep(0.5)
                time.sleep(6)
            for s in subjects:
                s.stop()
    print(
        f"\nreload of a 500-team, 2,000-profile policy on a real hub, every listener on"
        f"{' (MLflow too)' if args.mlflow else ''}; probe GET /hub/api/ every 5 ms; {args.rounds} rounds "
        f"of {args.window:.0f} s windows ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end)"
    )
    for s in subjects:
        print(
            f"  {s.label:<10} longest stall with an edit: median {statistics.median(s.edit_max) * 1000:6.0f} ms "
            f"(each: {ms(s.edit_max)}); without: median {statistics.median(s.idle_max) * 1000:4.0f} ms "
            f"(each: {ms(s.idle_max)}); ratio {statistics.median(s.edit_max) / statistics.median(s.idle_max):.2f}x"
        )
        print(
            f"  {'':<10} p99 with an edit {statistics.median(s.edit_p99) * 1000:.0f} ms, without "
            f"{statistics.median(s.idle_p99) * 1000:.0f} ms; write -> new policy in force "
            f"{statistics.median(s.applied):.1f} s, -> its audit entry {statistics.median(s.audited):.1f} s (medians); "
            f"probe errors {s.probe.errors}; edits later than the window {s.late}"
        )
    print("goal: the longest stall with an edit <= 50 ms")
    if args.stacks:
        print(f"where the loop of 'now' stalled: {args.stacks}")


if __name__ == "__main__":
    from support.lifetime import end_on_sigterm

    end_on_sigterm()  # stopped by `timeout`: its hubs and servers go with it
    main()
