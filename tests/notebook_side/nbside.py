"""Helpers for the notebook-side tests: a real ``jupyter server`` with gpuhub_notebook's extension
(enabled by its installed config, not by the command line), the fake NVML first on PYTHONPATH,
and a small stand-in for the hub's culling API. Free ports only: other suites run servers at the
same time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import requests

from support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
FAKE_NVML_DIR = REPO / "tests" / "support" / "fake_nvml"
USER = "alice"
SERVER_NAME = "gpu1"
HUB_TOKEN = "server-token-" + uuid.uuid4().hex  # what the hub gave this server
VISIBLE = "GPU-fake-2,0"  # of three fake devices: index 1 stays hidden

DEVICES = [
    {"uuid": "GPU-fake-0", "name": "NVIDIA Fake A100", "memory_total": 85899345920, "memory_used": 0, "utilization": 0},
    {"uuid": "GPU-fake-1", "name": "NVIDIA Fake A100", "memory_total": 85899345920, "memory_used": 7, "utilization": 99},
    {"uuid": "GPU-fake-2", "name": "NVIDIA Fake H100", "memory_total": 85899345920, "memory_used": 0, "utilization": 0},
]


class FakeNvml:
    """The JSON file the fake ``pynvml`` re-reads on every call."""

    def __init__(self, path: Path):
        self.path = path
        self.set(DEVICES)

    def set(self, devices) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"devices": devices}))
        os.replace(tmp, self.path)  # atomic: the server never reads half a file

    def update(self, index: int, **values) -> None:
        devices = json.loads(self.path.read_text())["devices"]
        devices[index].update(values)
        self.set(devices)


class HubStandIn:
    """``GET/POST {api}/gpuhub/culling/{user}[/snooze|/seen]``, ``GET {api}/gpuhub/profiles`` and ``POST
    {api}/gpuhub/jobs`` as the hub serves them, nothing else."""

    def __init__(self):
        self.warnings: dict[str, dict] = {}
        self.gpu_failed: dict[str, dict] = {}
        self.teams: list[dict] = [
            {"name": "vision", "displayName": "Vision Lab", "profiles": [{"slug": "gpu-1", "displayName": "One GPU"}]}
        ]
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                with stand_in.lock:
                    stand_in.requests.append(
                        {
                            "method": method,
                            "path": self.path,
                            "auth": self.headers.get("Authorization"),
                            "body": json.loads(raw) if raw else None,
                        }
                    )
                    if self.headers.get("Authorization") != f"token {HUB_TOKEN}":
                        return self._reply(403, {"message": "bad token"})
                    path = self.path.split("?")[0]
                    # "Run as job": the hub's profile list and job submission, answered as the hub does.
                    if method == "GET" and path == "/hub/api/gpuhub/profiles":
                        return self._reply(200, {"user": USER, "teams": stand_in.teams})
                    if method == "POST" and path == "/hub/api/gpuhub/jobs":
                        view = {"id": "job-0123456789", "status": "queued: position 1 of 1 in Vision Lab's queue"}
                        if (json.loads(raw) or {}).get("stop_server") is not None:
                            view["stopped_server"] = "stopping"
                        return self._reply(201, view)
                    prefix = "/hub/api/gpuhub/culling/"  # ?gpu_wait= (a long poll): this stand-in answers at once
                    if not path.startswith(prefix):
                        return self._reply(404, {"message": "Not Found"})
                    rest = path[len(prefix) :].split("/")
                    if unquote(rest[0]) != USER:
                        return self._reply(403, {"message": "not your servers"})
                    if method == "GET" and len(rest) == 1:
                        # It answers at once: gpu_wait 0, as a hub that does not hold the long poll.
                        return self._reply(
                            200,
                            {
                                "servers": dict(stand_in.warnings),
                                "culled": {},
                                "gpu_failed": dict(stand_in.gpu_failed),
                                "gpu_wait": 0,
                            },
                        )
                    if method == "POST" and rest[1:] == ["snooze"]:
                        name = json.loads(raw)["server"]
                        w = stand_in.warnings.get(name)
                        if w is None:
                            return self._reply(404, {"message": f"server {name!r} is not warned"})
                        if w["snoozes_left"] <= 0:
                            return self._reply(409, {"message": "No snoozes left: this server will be stopped as announced."})
                        w["snoozes_left"] -= 1
                        w["deadline"] += w["snooze_seconds"]
                        return self._reply(200, {"message": "Snoozed", "deadline": w["deadline"]})
                    if method == "POST" and rest[1:] == ["seen"]:
                        name = json.loads(raw)["server"]  # the hub stamps its own time
                        return self._reply(200, {"recorded": name in stand_in.warnings})
                    return self._reply(404, {"message": "Not Found"})

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.api_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hub/api"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def warn(
        self,
        server: str = SERVER_NAME,
        minutes: float = 10,
        reason: str = "GPU idle for 30 min",
        snoozes_left: int = 2,
        snooze_seconds: float = 1800,
    ) -> dict:
        now = time.time()
        w = {
            "deadline": now + minutes * 60,
            "reason": reason,
            "snoozes_left": snoozes_left,
            "snooze_seconds": snooze_seconds,
            "warned_at": now,
        }
        with self.lock:
            self.warnings[server] = w
        return w

    def reset(self) -> None:
        with self.lock:
            self.warnings.clear()
            self.gpu_failed.clear()
            self.requests.clear()

    def posts(self) -> list[dict]:
        with self.lock:
            return [r for r in self.requests if r["method"] == "POST"]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class NotebookServer:
    def __init__(self, workdir: Path, env_overrides: dict[str, str | None], base_url: str):
        self.workdir = workdir
        self.token = uuid.uuid4().hex
        self.base_url = base_url
        self.runtime_dir = workdir / "runtime"
        for d in ("root", "config", "data", "runtime"):
            (workdir / d).mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTERHUB_", "JPY_", "CUDA_", "GPUHUB_"))}
        env.update(
            PYTHONPATH=os.pathsep.join(
                [str(FAKE_NVML_DIR)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
            ),
            # Isolated user dirs; the sys.prefix config (where the package put its JSON) still applies.
            JUPYTER_CONFIG_DIR=str(workdir / "config"),
            JUPYTER_DATA_DIR=str(workdir / "data"),
            JUPYTER_RUNTIME_DIR=str(self.runtime_dir),
            HOME=str(workdir),
        )
        for k, v in env_overrides.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        self.env = env
        self.log_path = workdir / "server.log"
        self.proc = None
        self.port = 0

    def start(self, timeout: float = 40) -> "NotebookServer":
        for _attempt in range(3):  # a free port can be taken between probe and bind
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}{self.base_url}"
            log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "jupyter_server",
                    "--no-browser",
                    f"--port={self.port}",
                    "--ServerApp.port_retries=0",
                    "--allow-root",
                    "--ip=127.0.0.1",
                    f"--ServerApp.base_url={self.base_url}",
                    f"--IdentityProvider.token={self.token}",
                    f"--ServerApp.root_dir={self.workdir / 'root'}",
                ],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
            )
            deadline = time.time() + timeout
            while time.time() < deadline and self.proc.poll() is None:
                try:
                    if self.get("api/status").status_code == 200:
                        return self
                except requests.ConnectionError:
                    pass
                time.sleep(0.2)
            self.stop()
        raise RuntimeError("jupyter server did not start:\n" + self.tail())

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def headers(self) -> dict:
        return {"Authorization": f"token {self.token}"}

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(self.url + path, headers=self.headers(), timeout=20, **kw)

    def post(self, path: str, **kw) -> requests.Response:
        return requests.post(self.url + path, headers=self.headers(), timeout=20, **kw)

    def delete(self, path: str, **kw) -> requests.Response:
        return requests.delete(self.url + path, headers=self.headers(), timeout=20, **kw)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
