"""Spawn-to-ready against the server's own start-up: run on demand, as root.

    .venv/bin/python tests/benchmarks/spawn_ready.py [N]    # N spawns of each kind (default 20)

Four real hubs in one run, same policy (isolated behind the wall around each user, isolated without it, not isolated, stock), real ``jupyterhub-singleuser`` servers:
gpuhub isolated (own Unix account, cgroup, private /dev: the default as root), gpuhub
without isolation, and JupyterHub's stock ``SimpleLocalProcessSpawner``. Interleaved, in
rounds: the server's own start-up (the same command run directly, with the environment
a hub gives it and a real token of that hub: process start to its port accepting a
connection, looked at every 5 ms), then one spawn on each hub (the API request to the
server being ready). Printed: medians, each as a ratio of the own start-up's median, and
the gpuhub hubs' log breakdown (process start to listening, as the listen watcher saw it;
listening to ready).
"""

from __future__ import annotations

import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from isolation_spawn import POLICY, spawn_once  # noqa: E402  (its policy: a CPU profile of every core)
from support.hub import Hub  # noqa: E402

STOCK = "c.JupyterHub.spawner_class = 'jupyterhub.spawner.SimpleLocalProcessSpawner'\nc.Spawner.args = ['--allow-root']\n"
SINGLEUSER = str(Path(sys.executable).parent / "jupyterhub-singleuser")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_start(hub: Hub, token: str, home: Path) -> float:
    """The server's own start-up: process start to its port accepting, run directly."""
    port = free_port()
    env = dict(
        os.environ,
        HOME=str(home),
        JUPYTERHUB_API_TOKEN=token,
        JUPYTERHUB_API_URL=f"http://{hub.users_reach_hub_at()}:{hub.hub_port}/hub/api",
        JUPYTERHUB_USER="alice",
        JUPYTERHUB_CLIENT_ID="jupyterhub-user-alice",
        JUPYTERHUB_SERVICE_PREFIX="/user/alice/",
        JUPYTERHUB_BASE_URL="/",
        JUPYTERHUB_OAUTH_CALLBACK_URL="/user/alice/oauth_callback",
        JUPYTERHUB_SERVICE_URL=f"http://127.0.0.1:{port}/user/alice/",
        JUPYTERHUB_SERVER_NAME="",
        JUPYTERHUB_OAUTH_SCOPES="[]",
        JUPYTERHUB_OAUTH_ACCESS_SCOPES="[]",
    )
    t0 = time.perf_counter()
    proc = subprocess.Popen([SINGLEUSER, "--allow-root"], env=env, cwd=home, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return time.perf_counter() - t0
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(proc.stderr.read().decode(errors="replace")[-2000:]) from None
                time.sleep(0.005)
    finally:
        proc.terminate()
        proc.wait(30)


def breakdown(hub: Hub) -> tuple[list[float], list[float]]:
    """(process start -> listening, hub's total start) from a gpuhub hub's log."""
    text = hub.log.read_text(errors="replace")
    listen = [float(m) for m in re.findall(r"alice: listening ([0-9.]+)s after its process started", text)]
    total = [float(m) for m in re.findall(r"User alice took ([0-9.]+) seconds to start", text)]
    return listen, total


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    if os.geteuid() != 0:
        print("run as root: isolation needs it", file=sys.stderr)
        sys.exit(2)
    work = Path(tempfile.mkdtemp(prefix="gpuhub-spawn-ready-"))
    hubs = {
        "gpuhub, isolated + wall": Hub(work / "isolated", POLICY, lab=True),
        "gpuhub, isolated, no wall": Hub(
            work / "nowall", POLICY, extra_config="c.LocalGpuSpawner.network_wall = 'off'\n", lab=True
        ),
        "gpuhub, no isolation": Hub(work / "plain", POLICY, extra_config="c.LocalGpuSpawner.isolation = 'off'\n", lab=True),
        "stock SimpleLocalProcessSpawner": Hub(work / "stock", POLICY, extra_config=STOCK, lab=True),
    }
    try:
        for h in hubs.values():
            h.start()
        direct_hub = hubs["gpuhub, no isolation"]
        token = direct_hub.login("alice").token
        home = work / "direct-home"
        home.mkdir()
        times: dict[str, list[float]] = {"own start-up (run directly)": [], **{k: [] for k in hubs}}
        for i in range(n):
            times["own start-up (run directly)"].append(own_start(direct_hub, token, home))
            for label, hub in hubs.items():
                times[label].append(spawn_once(hub, "alice"))
            print(f"round {i + 1}/{n}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
        base = statistics.median(times["own start-up (run directly)"])
        print(f"\nreal jupyterhub-singleuser, {n} interleaved rounds on {os.cpu_count()} cores (request -> ready)")
        for label, values in times.items():
            q = statistics.quantiles(values, n=10)
            print(
                f"{label:34} median {statistics.median(values):.2f}s  p10 {q[0]:.2f}  p90 {q[-1]:.2f}  "
                f"{statistics.median(values) / base:.2f}x own start-up"
            )
        for label in ("gpuhub, isolated + wall", "gpuhub, isolated, no wall", "gpuhub, no isolation"):
            listen, total = breakdown(hubs[label])
            if listen and total:
                print(
                    f"{label}: process start -> listening median {statistics.median(listen):.2f}s; "
                    f"the hub's whole start (its log) median {statistics.median(total):.2f}s"
                )
    finally:
        for h in hubs.values():
            h.stop()


if __name__ == "__main__":
    from support.lifetime import end_on_sigterm

    end_on_sigterm()  # stopped by `timeout`: its hubs and servers go with it
    main()
