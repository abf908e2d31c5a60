"""Run code in a real kernel of a real single-user server, the way JupyterLab does:
create a session (which starts the kernel in the notebook's directory, with
``JPY_SESSION_NAME``), then talk the Jupyter messaging protocol over the websocket.

The websocket is read all the time by a thread of its own, as a browser reads it: jupyter-server
pings every 30 s and closes a kernel's websocket whose pings went unanswered for 90 s, and a
websocket-client connection answers pings only while something reads it. A test that left its
kernel idle for longer than that (the Ray test, waiting for a cull between two cells) lost the
websocket: "the kernel's websocket closed while it ran the code"."""

from __future__ import annotations

import json
import queue
import threading
import time

import requests
import websocket


class KernelSession:
    def __init__(self, hub_url: str, server_url: str, token: str, notebook_path: str, kernel: str = "python3"):
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
                "kernel": {"name": kernel},
            },
        )
        r.raise_for_status()
        self.session = r.json()
        self.kernel_id = self.session["kernel"]["id"]
        ws_url = self.base.replace("http", "ws", 1) + f"api/kernels/{self.kernel_id}/channels"
        self.ws = websocket.create_connection(
            ws_url, header=[f"Authorization: token {token}"], timeout=120, enable_multithread=True
        )
        self._messages: queue.Queue = queue.Queue()
        self._closed: Exception | None = None
        threading.Thread(target=self._read, name=f"kernel-ws-{self.kernel_id[:8]}", daemon=True).start()

    def _read(self) -> None:
        """Every message into the queue; reading is what answers the server's pings."""
        while True:
            try:
                opcode, data = self.ws.recv_data()
            except websocket.WebSocketTimeoutException:
                continue  # idle: nothing came, the connection is fine
            except Exception as e:  # noqa: BLE001 - closed, reset: execute() says which
                self._messages.put(e)
                return
            if opcode == websocket.ABNF.OPCODE_CLOSE:
                self._messages.put(websocket.WebSocketConnectionClosedException("the server closed the websocket"))
                return
            if opcode in (websocket.ABNF.OPCODE_TEXT, websocket.ABNF.OPCODE_BINARY):
                self._messages.put(json.loads(data))

    def send_execute(self, code: str) -> str:
        """Send ``code`` to the kernel without waiting; return the request's message id."""
        from gpuhub_spawner.ops.loadtest import execute_request

        msg_id, request = execute_request(code, "test")
        self.ws.send(json.dumps(request))
        return msg_id

    def execute(self, code: str, timeout: float = 120) -> str:
        """Run ``code``; return its stdout; raise with the traceback if it failed."""
        if self._closed is not None:
            raise ConnectionError(f"the kernel's websocket had closed before this cell ({self.state()})") from self._closed
        msg_id = self.send_execute(code)
        out, error, done_reply, idle = [], None, False, False
        deadline = time.monotonic() + timeout
        while not (done_reply and idle):
            try:
                msg = self._messages.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"kernel did not finish in {timeout}s; output so far: {''.join(out)}") from None
            if isinstance(msg, Exception):
                self._closed = msg
                raise ConnectionError(
                    f"the kernel's websocket closed while it ran the code ({self.state()}); output so far: {''.join(out)!r}"
                ) from msg
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
