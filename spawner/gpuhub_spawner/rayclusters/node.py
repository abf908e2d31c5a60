"""A Ray cluster's processes on one machine: ``python -I -m gpuhub_spawner.rayclusters.node``.

Started by the hub as a job's command (``local.ray_manager``), so it already runs as the
user's Unix account, in the cluster's cgroup, with exactly the admitted GPUs
(``CUDA_VISIBLE_DEVICES`` holds their ids) and the user's private ``/tmp``. It starts the
head (``ray start --head --block``) and, if asked, workers (``ray start --address ...
--block``), each worker with its share of the GPUs; with no worker the head holds them
all. Its processes run behind the wall around their user (``local.user_network``: the
user's own network namespace), so no other user reaches any of its ports, whether Ray
checks a token there or not (Ray 2.52's dashboard agent does not). Token authentication is
on as well (``RAY_AUTH_MODE=token``, the user's token from the hub in ``RAY_AUTH_TOKEN``):
every Ray RPC and the dashboard refuse a caller without the token. The token is also
written to ``~/.ray/auth_token`` (0600, the private home) where the user's kernels find it.

When the head is up it prints one line the hub reads from the attempt's log::

    [gpuhub-ray] ready {"address": "127.0.0.1:PORT", "dashboard_port": PORT, "gpus": [...]}

It ends when any of its Ray processes ends (``--block``) or on ``SIGTERM`` (the hub's stop:
the whole cgroup goes after 5 s anyway).

**A Ray job** (``kind: ray`` in a job file, docs/jobs.md) is the same cluster with an
entrypoint (after ``--``): once ready, the entrypoint is submitted to it through Ray's job submission
API (``JobSubmissionClient`` on the cluster's own dashboard, with the user's token), its
output is followed into the attempt's log, and the cluster is stopped when the entrypoint
ends; the exit code is the driver's (0 when Ray says SUCCEEDED). Why submission rather than
running the driver here against ``RAY_ADDRESS``: it is what Ray recommends for running work
on a cluster and what KubeRay's ``RayJob`` does, so ``entrypoint`` and ``runtimeEnv`` mean
the same on both backends; Ray applies the runtime environment (``working_dir``,
``env_vars``, ``pip``, ``py_modules``) to the driver itself, where a driver started by hand
gets it only for its tasks; and Ray keeps the driver's status and exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

READY = "[gpuhub-ray] ready "
SUBMITTED = "[gpuhub-ray] submitted "
ENDED = "[gpuhub-ray] entrypoint ended "


NODE_PORTS = (
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port",
    "--metrics-export-port",
    "--node-manager-port",
    "--object-manager-port",
)


def node_ports(ports: list[int]) -> list[str]:
    """Every port a Ray node opens besides the head's, named: free ones, not Ray's defaults.

    Ray's defaults are the same for every cluster (the dashboard agent's 52365, the metrics
    and runtime-env agents' ...): a second cluster in the same network finds them taken and
    runs without the service (no ``ray job submit``). Behind the wall each user has a network
    of their own, but one user's two clusters still share it. The node's address is the
    loopback of the user's namespace: nothing of it listens where the hub's side could
    reach it, except what Ray binds to every address (its metrics).

    ``ports`` come from one :func:`free_ports` draw for the whole cluster: two draws let the
    kernel hand out a port again once the first draw's sockets closed (CI saw the head's client
    server and its runtime-env agent both on 36723, and the head refused to start)."""
    assert len(ports) == len(NODE_PORTS)
    out = ["--node-ip-address", "127.0.0.1"]
    for name, port in zip(NODE_PORTS, ports):
        out += [name, str(port)]
    return out


def free_ports(n: int) -> list[int]:
    """``n`` different free ports (held together while picked, so none is picked twice)."""
    held = []
    try:
        for _ in range(n):
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def cluster_ports(workers: int) -> tuple[list[int], list[list[int]]]:
    """The head's four ports (GCS, dashboard, client server, autoscaler monitor) and each
    node's :data:`NODE_PORTS` (head first), all from one draw so that none repeats.

    Ray's client server defaults to 10001 in every cluster, so it is drawn too."""
    per = len(NODE_PORTS)
    ports = free_ports(4 + per * (1 + workers))
    return ports[:4], [ports[4 + i * per : 4 + (i + 1) * per] for i in range(1 + workers)]


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def shares(devices: list[str], gpus: int, workers: int) -> list[list[str]]:
    """GPU ids per worker (round robin); the head's share when there is no worker."""
    if workers == 0:
        return [devices[:gpus] if devices else []]
    out: list[list[str]] = [[] for _ in range(workers)]
    for i, d in enumerate(devices[:gpus]):
        out[i % workers].append(d)
    return out


def _pump(pr: subprocess.Popen, joined: threading.Event) -> None:
    """Copy a Ray node's output to ours; note when its ``ray start`` has finished (the head:
    the cluster is up; a worker: it has joined the cluster)."""
    assert pr.stdout is not None  # started with stdout=PIPE
    for line in pr.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        if "Ray runtime started" in line:
            joined.set()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The launcher's arguments. A Ray job's entrypoint comes last, after ``--``: it is the
    user's text, and as an option's value argparse would read one starting with ``-`` as an
    option of ours (``--entrypoint --x``: "expected one argument"). ``--entrypoint VALUE``
    is still read, for the commands of jobs recorded before."""
    p = argparse.ArgumentParser(prog="gpuhub-ray-node")
    p.add_argument("--gpus", type=int, default=0)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--cpus", type=int, default=1, help="logical CPUs Ray schedules on (the profile's)")
    p.add_argument("--name", default="ray")
    p.add_argument("--virtual", action="store_true", help="the GPUs are the hub's virtual stand-ins (no CUDA)")
    p.add_argument("--entrypoint", default=None, help=argparse.SUPPRESS)
    p.add_argument("--runtime-env", default="{}", help="a Ray job: Ray's runtime_env, as JSON")
    p.add_argument(
        "job_entrypoint",
        nargs="?",
        default=None,
        metavar="-- ENTRYPOINT",
        help="a Ray job: the shell command submitted once the cluster is ready (after '--')",
    )
    args = p.parse_args(argv)
    if args.job_entrypoint is not None:
        args.entrypoint = args.job_entrypoint
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    devices = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    token = os.environ.get("RAY_AUTH_TOKEN", "")
    if token:
        ray_dir = os.path.expanduser("~/.ray")
        os.makedirs(ray_dir, mode=0o700, exist_ok=True)
        fd = os.open(os.path.join(ray_dir, "auth_token"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
    env = dict(
        os.environ,
        RAY_AUTH_MODE="token" if token else os.environ.get("RAY_AUTH_MODE", "disabled"),
        RAY_USAGE_STATS_ENABLED="0",
        # Ray gives its dashboard 60 s to register; on a loaded machine the imports alone
        # take longer, and the head then exits. The hub bounds the start instead.
        RAY_DASHBOARD_STARTUP_TIMEOUT_S=os.environ.get("RAY_DASHBOARD_STARTUP_TIMEOUT_S", "600"),
        RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT=os.environ.get(
            "RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT", "600"
        ),
    )
    ray = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats"]
    (gcs, dash, client, monitor), per_node = cluster_ports(args.workers)
    # The head's autoscaler monitor serves metrics on 0.0.0.0:44217 in every cluster: a
    # second cluster in the user's network would find it taken.
    env["AUTOSCALER_METRIC_PORT"] = str(monitor)
    per = shares(devices, args.gpus, args.workers)
    head_gpus = per[0] if args.workers == 0 else []
    procs: list[subprocess.Popen] = []

    def stop(*_):
        for pr in procs:
            if pr.poll() is None:
                pr.terminate()

    signal.signal(signal.SIGTERM, lambda *a: (stop(), sys.exit(143)))
    head_env = dict(env, CUDA_VISIBLE_DEVICES=",".join(head_gpus), PYTHONUNBUFFERED="1")
    procs.append(
        subprocess.Popen(
            ray
            + [
                "--head",
                "--port",
                str(gcs),
                "--dashboard-host",
                "127.0.0.1",
                "--dashboard-port",
                str(dash),
                "--ray-client-server-port",
                str(client),
                "--num-gpus",
                str(len(head_gpus)),
                "--num-cpus",
                str(args.cpus if args.workers == 0 else 0),
                "--include-dashboard",
                "true",
                *node_ports(per_node[0]),
            ],
            env=head_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    )
    # Ready means `ray start --head` finished: it says "Ray runtime started." once its raylet
    # is up, and then records the cluster where a plain `ray.init()` finds it
    # (/tmp/ray/ray_current_cluster, the user's private /tmp). Its GCS and dashboard listen well
    # before; a cluster reported ready then was not one (fresh-clone run 37: alice's kernel, a moment
    # early, found no cluster, started a Ray of its own without GPUs, and her 2-GPU task waited
    # until the idle rule stopped her real cluster). Not the file itself: the user's clusters
    # and Ray jobs share it, and one starting at the same moment overwrites it.
    head_started = threading.Event()
    threading.Thread(target=_pump, args=(procs[0], head_started), daemon=True).start()
    deadline = time.time() + 600
    while not (listening(gcs) and listening(dash) and head_started.is_set()):
        if procs[0].poll() is not None:
            print(f"[gpuhub-ray] the head exited with {procs[0].returncode} before it was ready", flush=True)
            return procs[0].returncode or 1
        if time.time() > deadline:
            print("[gpuhub-ray] the head was not ready within 10 minutes", flush=True)
            stop()
            return 1
        time.sleep(0.2)
    joined: list[threading.Event] = []
    for i, share in enumerate(per if args.workers else []):
        pr = subprocess.Popen(
            ray
            + [
                "--address",
                f"127.0.0.1:{gcs}",
                "--num-gpus",
                str(len(share)),
                "--num-cpus",
                str(max(1, args.cpus // max(1, args.workers))),
                *node_ports(per_node[1 + i]),
            ],
            env=dict(env, CUDA_VISIBLE_DEVICES=",".join(share), PYTHONUNBUFFERED="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        procs.append(pr)
        joined.append(threading.Event())
        threading.Thread(target=_pump, args=(pr, joined[-1]), daemon=True).start()
    # Ready means every worker joined: a driver connecting earlier sees only the head.
    while not all(e.is_set() for e in joined):
        ended = next((pr for pr in procs if pr.poll() is not None), None)
        if ended is not None or time.time() > deadline:
            print("[gpuhub-ray] a worker did not join the cluster" + (f" (exit {ended.returncode})" if ended else ""), flush=True)
            stop()
            return 1
        time.sleep(0.2)
    print(
        READY
        + json.dumps(
            {
                "address": f"127.0.0.1:{gcs}",
                "dashboard_port": dash,
                "gpus": devices[: args.gpus],
                "workers": args.workers,
                "virtual": args.virtual,
            }
        ),
        flush=True,
    )
    driver: dict = {}
    done = threading.Event()
    if args.entrypoint is not None:
        threading.Thread(
            target=_submit, args=(dash, args.entrypoint, json.loads(args.runtime_env), args.name, driver, done), daemon=True
        ).start()
    while True:
        if done.wait(1):
            stop()
            print(ENDED + json.dumps(driver), flush=True)
            return int(driver.get("exit_code", 1))
        for pr in procs:
            if pr.poll() is not None:
                print(f"[gpuhub-ray] a Ray process ended (exit {pr.returncode}); stopping the cluster", flush=True)
                stop()
                if args.entrypoint is not None:
                    return pr.returncode or 1  # the entrypoint could not finish on a broken cluster
                return 0 if pr.returncode == 0 else pr.returncode


def _submit(dash: int, entrypoint: str, runtime_env: dict, name: str, out: dict, done: threading.Event) -> None:
    """Submit ``entrypoint`` to the cluster's own dashboard, follow its output, and note how
    it ended in ``out`` (``status``, ``exit_code``, ``message``); ``done`` when it has."""
    import asyncio

    try:
        from ray.job_submission import JobStatus, JobSubmissionClient  # lazy: heavy optional dependency

        client = JobSubmissionClient(f"http://127.0.0.1:{dash}")
        sid = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env or None, submission_id=f"{name}-{os.getpid()}")
        out["submission_id"] = sid
        print(SUBMITTED + json.dumps({"submission_id": sid, "entrypoint": entrypoint}), flush=True)

        async def follow() -> None:
            async for lines in client.tail_job_logs(sid):
                sys.stdout.write(lines)
                sys.stdout.flush()

        try:
            asyncio.run(follow())
        except Exception as e:  # noqa: BLE001 - the log stream is best effort; the status below decides
            print(f"[gpuhub-ray] following the entrypoint's output stopped: {e}", flush=True)
        info = client.get_job_info(sid)
        while info.status not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            time.sleep(0.5)  # the log stream ended first (it does when the driver's output closes)
            info = client.get_job_info(sid)
        out["status"] = str(info.status.value)
        code = info.driver_exit_code
        if info.status == JobStatus.SUCCEEDED:
            out["exit_code"] = 0
        else:
            out["exit_code"] = code if isinstance(code, int) and 0 < code < 256 else 1
        out["message"] = (info.message or "")[:500]
    except Exception as e:  # noqa: BLE001 - the job must end, with the reason in its log
        out.update(status="FAILED", exit_code=1, message=f"could not submit the entrypoint to the cluster: {e}"[:500])
    finally:
        done.set()


if __name__ == "__main__":
    sys.exit(main())
