"""Run code in a real kernel of a real single-user server, the way JupyterLab does:
create a session (which starts the kernel in the notebook's directory, with
``JPY_SESSION_NAME``), then talk the Jupyter messaging protocol over the websocket."""

from __future__ import annotations

import json
import time
import uuid

import requests
import websocket


class KernelSession:
    def __init__(self, hub_url: str, server_url: str, token: str, notebook_path: str):
        # server_url: a server model's url, absolute with per-user origins (else a path)
        self.base = server_url if "://" in server_url else hub_url + server_url
        self.token = token
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"token {token}"
        r = self.http.post(
            self.base + "api/sessions",
            json={
                "path": notebook_path,
                "name": notebook_path.rsplit("/", 1)[-1],
                "type": "notebook",
                "kernel": {"name": "python3"},
            },
        )
        r.raise_for_status()
        self.session = r.json()
        self.kernel_id = self.session["kernel"]["id"]
        ws_url = self.base.replace("http", "ws", 1) + f"api/kernels/{self.kernel_id}/channels"
        self.ws = websocket.create_connection(ws_url, header=[f"Authorization: token {token}"], timeout=120)

    def execute(self, code: str, timeout: float = 120) -> str:
        """Run ``code``; return its stdout; raise with the traceback if it failed."""
        msg_id = uuid.uuid4().hex
        self.ws.send(
            json.dumps(
                {
                    "header": {
                        "msg_id": msg_id,
                        "username": "test",
                        "session": uuid.uuid4().hex,
                        "msg_type": "execute_request",
                        "version": "5.3",
                    },
                    "parent_header": {},
                    "metadata": {},
                    "channel": "shell",
                    "content": {
                        "code": code,
                        "silent": False,
                        "store_history": False,
                        "user_expressions": {},
                        "allow_stdin": False,
                        "stop_on_error": True,
                    },
                }
            )
        )
        out, error, done_reply, idle = [], None, False, False
        deadline = time.monotonic() + timeout
        while not (done_reply and idle):
            self.ws.settimeout(max(1.0, deadline - time.monotonic()))
            try:
                msg = json.loads(self.ws.recv())
            except websocket.WebSocketConnectionClosedException as e:
                raise ConnectionError(
                    f"the kernel's websocket closed while it ran the code ({self.state()}); output so far: {''.join(out)!r}"
                ) from e
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = msg["header"]["msg_type"]
            if kind == "stream":
                out.append(msg["content"]["text"])
            elif kind == "error":
                error = "\n".join(msg["content"]["traceback"])
            elif kind == "execute_reply":
                done_reply = True
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                idle = True
            if time.monotonic() > deadline:
                raise TimeoutError(f"kernel did not finish in {timeout}s; output so far: {''.join(out)}")
        if error:
            raise RuntimeError(f"kernel code failed:\n{error}\nstdout:\n{''.join(out)}")
        return "".join(out)

    def state(self) -> str:
        """What the server says of this kernel now (for an error: did the kernel die, or the server?)."""
        try:
            r = self.http.get(self.base + f"api/kernels/{self.kernel_id}", timeout=10)
        except requests.RequestException as e:
            return f"the server does not answer: {e}"
        if r.status_code != 200:
            return f"the server answers {r.status_code} for the kernel"
        k = r.json()
        return f"kernel {k.get('execution_state')}, last activity {k.get('last_activity')}"

    def close(self):
        try:
            self.ws.close()
        finally:
            self.http.delete(self.base + f"api/sessions/{self.session['id']}")
