"""Memory of the MLflow service while an artifact is uploaded and downloaded through it.

Starts a real hub (this tree's config) with the real MLflow service, logs in ``alice``,
creates a run, and PUTs ``--mb`` MiB (generated on the fly, never held in the client)
to ``api/2.0/mlflow-artifacts/artifacts/...`` on the service port notebooks use, then
reads it back, while sampling the service process's VmRSS every 50 ms. Prints the
resident set before, the peak during each transfer, and the peak as a ratio of the
baseline (before) measured in the same run.

    .venv/bin/python tests/benchmarks/mlflow_upload_rss.py --mb 400

Works against an older tree too (for a before/after comparison): run it with
``PYTHONPATH=<old tree>/spawner`` from a copy of that tree's ``tests/`` with this file
beside it; ``--max-upload-mb`` is only passed where the service has that setting.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: support.hub

try:  # *.localhost resolution and browser-like cookies for the demo's per-user origins
    import conftest  # noqa: E402,F401  (tests/conftest.py)
except ImportError:
    pass
from support.hub import REPO, Hub  # noqa: E402
from support.ports import free_port  # noqa: E402

MiB = 2**20


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise LookupError(pid)


class Sampler(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop_flag = pid, rss(pid), threading.Event()

    def run(self):
        while not self.stop_flag.is_set():
            self.peak = max(self.peak, rss(self.pid))
            time.sleep(0.05)

    def stop(self) -> int:
        self.stop_flag.set()
        self.join()
        return self.peak


def service_pid(hub: Hub) -> int:
    import psutil

    for p in psutil.Process(hub.proc.pid).children(recursive=True):
        if "gpuhub_spawner.mlflow" in " ".join(p.cmdline()):
            return p.pid
    raise LookupError("no MLflow service process")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=400, help="artifact size in MiB")
    ap.add_argument("--max-upload-mb", type=int, default=None, help="MlflowService.max_upload_size in MiB")
    args = ap.parse_args()

    port = free_port()
    options = f", service_options={{'max_upload_size': {args.max_upload_mb * MiB}}}" if args.max_upload_mb else ""
    extra = (
        "from gpuhub_spawner.wiring.mlflow import configure as _configure_mlflow\n"
        "import os as _os\n"
        f"_configure_mlflow(c, data_dir=_os.path.join(_os.environ['GPUHUB_DATA_DIR'], 'mlflow'), port={port},\n"
        f"                  policy_path=_os.environ['GPUHUB_POLICY']{options})\n"
    )
    policy = (REPO / "jupyterhub_config" / "profiles.yaml").read_text()
    with tempfile.TemporaryDirectory() as tmp:
        hub = Hub(Path(tmp), policy, extra_config=extra, lab=True)
        hub.start(timeout=90)
        try:
            run(hub, port, args.mb * MiB)
        finally:
            hub.stop()


def request(port: int, method: str, path: str, token: str, body: dict | None = None) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request(
        method,
        path,
        body=json.dumps(body) if body is not None else None,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    r = conn.getresponse()
    data = r.read()
    conn.close()
    if r.status != 200:
        raise RuntimeError(f"{method} {path}: {r.status} {data[:300]!r}")
    return json.loads(data)


def run(hub: Hub, port: int, size: int) -> None:
    token = hub.login("alice").token
    api = "/services/mlflow/api/2.0/mlflow"
    deadline = time.time() + 240
    while True:
        try:
            request(port, "GET", api + "/experiments/search?max_results=1", token)
            break
        except (RuntimeError, OSError):
            if time.time() > deadline:
                raise
            time.sleep(0.5)
    exp = request(port, "POST", api + "/experiments/create", token, {"name": f"users/alice/rss-{time.time_ns()}"})
    run_ = request(port, "POST", api + "/runs/create", token, {"experiment_id": exp["experiment_id"], "start_time": 0})
    run_id = run_["run"]["info"]["run_id"]
    path = f"/services/mlflow/api/2.0/mlflow-artifacts/artifacts/{exp['experiment_id']}/{run_id}/artifacts/big.bin"
    pid = service_pid(hub)
    time.sleep(1)
    before = rss(pid)

    block = hashlib.sha256(b"gpuhub").digest() * (MiB // 32)
    sampler = Sampler(pid)
    sampler.start()
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.putrequest("PUT", path)
    conn.putheader("Authorization", f"Bearer {token}")
    conn.putheader("Content-Length", str(size))
    conn.endheaders()
    sent = 0
    while sent < size:
        piece = block[: min(len(block), size - sent)]
        conn.send(piece)
        sent += len(piece)
    r = conn.getresponse()
    r.read()
    conn.close()
    up_s = time.perf_counter() - t0
    up_peak = sampler.stop()
    if r.status != 200:
        raise RuntimeError(f"upload: {r.status}")
    after_up = rss(pid)

    sampler = Sampler(pid)
    sampler.start()
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
    r = conn.getresponse()
    got = 0
    while chunk := r.read(MiB):
        got += len(chunk)
    conn.close()
    down_s = time.perf_counter() - t0
    down_peak = sampler.stop()
    if got != size:
        raise RuntimeError(f"download returned {got} of {size} bytes")

    print(f"artifact {size // MiB} MiB through the MLflow service (service port)")
    print(f"  service RSS before       {before / MiB:8.0f} MiB   (baseline 1.00)")
    print(f"  peak during upload       {up_peak / MiB:8.0f} MiB   ({up_peak / before:.2f} x baseline, {up_s:.1f} s)")
    print(f"  after upload             {after_up / MiB:8.0f} MiB   ({after_up / before:.2f} x baseline)")
    print(f"  peak during download     {down_peak / MiB:8.0f} MiB   ({down_peak / before:.2f} x baseline, {down_s:.1f} s)")


if __name__ == "__main__":
    from support.lifetime import end_on_sigterm

    end_on_sigterm()  # stopped by `timeout`: its hubs and servers go with it
    main()
