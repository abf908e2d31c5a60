"""The timeline of one idle GPU in a real hub: idle start, warning, stop, next user admitted.

Runs the shipped example policy (jupyterhub_config/profiles.yaml) in a real hub with its
idle rules scaled down by ``--scale`` (default 60: minutes become seconds), and the hub's
own clocks scaled the same way: the culler pass 60 s -> 1 s (``GPUHUB_CULL_EVERY``), the
hub's activity sync 300 s -> 5 s (``JupyterHub.last_activity_interval`` and the servers'
``JUPYTERHUB_ACTIVITY_INTERVAL``). GPUs come from the fake ``pynvml`` (3 "A100", 2 "L4"),
so the hub reads them through the same NVML code as on a real machine.

The scene: carol (NLP) starts a 1x A100 server and leaves it untouched; alice and bob
(Vision) train on the other two A100s (NVML reads 90 %); dave (NLP) asks for an A100 and
waits in the queue. The timeline is read back from the hub's own log.

    .venv/bin/python tests/benchmarks/culler_timeline.py [--scale 60]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from datetime import datetime
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "spawner"))
import conftest  # noqa: E402,F401  (resolve *.localhost and keep cookies as a browser does, as in the tests)
from support.hub import Hub, wait_for  # noqa: E402

from gpuhub_spawner.policy.quantities import format_duration, parse_duration  # noqa: E402

DURATIONS = ("timeout", "gpuIdleTimeout", "maxAge", "warning", "snooze")


def scaled_policy(scale: float) -> tuple[str, dict]:
    data = yaml.safe_load((REPO / "jupyterhub_config" / "profiles.yaml").read_text())
    blocks = [data.setdefault("defaults", {}).setdefault("idle", {})] + [p.setdefault("idle", {}) for p in data["profiles"]]
    for idle in blocks:
        for key in DURATIONS:
            if key in idle:
                idle[key] = f"{max(1, round(parse_duration(idle[key]) / scale))}s"
    a100 = next(p for p in data["profiles"] if p["slug"] == "a100-1")
    effective = {**data["defaults"]["idle"], **a100["idle"]}
    return yaml.safe_dump(data, sort_keys=False), effective


def stamp(line: str) -> float:
    m = re.search(r"\[\w (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)", line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()


def first(log: list[str], *needles: str) -> tuple[float, str]:
    for line in log:
        if all(n in line for n in needles):
            return stamp(line), line.split("] ", 1)[-1].strip()
    raise LookupError(needles)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=60)
    args = ap.parse_args(argv)
    policy, rules = scaled_policy(args.scale)
    work = Path(tempfile.mkdtemp(prefix="gpuhub-timeline-"))
    work.chmod(0o755)  # as a pytest tmp dir: servers may run as their own Unix users
    nvml = work / "nvml.json"
    devices = [{"uuid": f"GPU-a100-{i}", "name": "NVIDIA Fake A100", "utilization": 0} for i in range(3)] + [
        {"uuid": f"GPU-l4-{i}", "name": "NVIDIA Fake L4", "utilization": 0} for i in range(2)
    ]
    nvml.write_text(json.dumps({"devices": devices}))
    every = max(1, round(60 / args.scale))
    sync = max(1, round(300 / args.scale))
    hub = Hub(
        work,
        policy,
        extra_config=f"c.JupyterHub.last_activity_interval = {sync}\n"
        f"c.Spawner.environment = dict(c.Spawner.environment, JUPYTERHUB_ACTIVITY_INTERVAL='{sync}')\n",
        env={
            "PYTHONPATH": str(REPO / "tests" / "support" / "fake_nvml"),
            "GPUHUB_FAKE_NVML": str(nvml),
            "GPUHUB_CULL_EVERY": str(every),
        },
        lab=True,
    )
    print(f"example policy scaled 1/{args.scale:g}: 1x A100 rules {rules}; culler pass {every}s, activity sync {sync}s")
    hub.start()
    try:
        users = {n: hub.login(n) for n in ("alice", "bob", "carol", "dave")}

        def busy(name):
            snap = users[name].api.get(hub.url + "/hub/api/gpuhub/status").json()
            dev = next(d["id"] for d in snap["devices"] if d["user"] == name)
            for d in devices:
                if d["uuid"] == dev:
                    d["utilization"] = 90
            nvml.write_text(json.dumps({"devices": devices}))

        users["carol"].start("a100-1", team="nlp")
        users["carol"].wait_ready()
        for n in ("alice", "bob"):
            users[n].start("a100-1", team="vision")
            users[n].wait_ready()
            busy(n)
        users["dave"].start_background("a100-1", team="nlp")
        wait_for(lambda: '"event": "queued", "key": "dave/"' in hub.log.read_text(), 60, "dave to queue")
        users["dave"].wait_ready(timeout=600)
        busy("dave")
        log = hub.log.read_text(errors="replace").splitlines()
        t0, started = first(log, '"event": "started"', '"key": "carol/"')
        events = [
            ("idle start (carol's server started; NVML reads 0 %)", t0, started),
            ("carol's server ready (she never touches it)", *first(log, "Adding user carol to proxy")),
            ("dave asks for an A100 and waits in the queue", *first(log, '"event": "queued"', '"key": "dave/"')),
            ("warning", *first(log, "Warning carol/")),
            ("stop decided", *first(log, "Culling carol/")),
            ("carol's GPU released", *first(log, "Releasing", "for carol/")),
            ("dave admitted", *first(log, "Admitted dave/")),
            ("dave's server ready", *first(log, "Adding user dave to proxy")),
        ]
        print(f"\nhub log: {hub.log}")
        print(f"{'event':<52} {'t (s)':>7} {'x' + format(args.scale, 'g') + ' (prod.)':>14}")
        for what, t, line in sorted(events, key=lambda e: e[1]):
            print(f"{what:<52} {t - t0:7.1f} {format_duration((t - t0) * args.scale):>14}   {line[:110]}")
    finally:
        hub.stop()
    return 0


if __name__ == "__main__":
    from support.lifetime import end_on_sigterm

    end_on_sigterm()  # stopped by `timeout`: its hubs and servers go with it
    raise SystemExit(main())
