"""Start a real JupyterHub (our config, our spawner) as a subprocess, on free ports.

Tests talk to it the way users do: log in through the login form, then use the REST
API with a token of their own. Every single-user server started by the hub carries
``GPUHUB_TEST_RUN`` in its environment so teardown can find and kill leftovers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import requests

from support.ports import free_port, reserve

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "jupyterhub_config" / "jupyterhub_config.py"
PASSWORD = "test-password-123"


def wait_for(predicate, timeout: float, what: str, interval: float = 0.5, hub: Hub | None = None):
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` (and ``hub``'s
    last log lines, where the wait was on a hub's work)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f"\n{hub.tail(80)}" if hub else ""))


def waiter(timeout: float, interval: float = 0.2):
    """A module's ``until(predicate, timeout=<its default>, what=..., hub=None)``: the
    Kubernetes files poll watched objects more often than a hub's pages, each with the
    deadline its scenario allows."""

    def until(predicate, timeout: float = timeout, what: str = "condition", hub: Hub | None = None):
        return wait_for(predicate, timeout, what, interval=interval, hub=hub)

    return until


def alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie not yet reaped counts as ended)."""
    try:
        st = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return st[st.rindex(")") + 2] not in "ZX"


def processes_with_env(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


PRIVATE_TMP_PARENT = Path("/tmp/gpuhub")  # the product's default IsolatedProcessSpawner.tmp_dir_template


def remove_private_tmps(prefix: str) -> None:
    """The private /tmp folders (``/tmp/gpuhub/<account>``) of this prefix's accounts, which go
    with the accounts (a benchmark day left 1,015 of them). ``rmtree`` follows no link."""
    import shutil

    if not prefix or not PRIVATE_TMP_PARENT.is_dir():
        return
    for entry in PRIVATE_TMP_PARENT.iterdir():
        if entry.name.startswith(prefix) and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)


def browser_like_session() -> requests.Session:
    """A session that, like a browser, retries an idempotent request once its kept-alive
    connection turns out closed (the Node proxy closes idle ones after 5 s; a request sent
    at that moment is reset). Never retries a POST."""
    from requests.adapters import HTTPAdapter
    from urllib3.util.retry import Retry

    retry = Retry(
        total=2,
        connect=2,
        read=2,
        status=0,
        other=0,
        backoff_factor=0.1,
        allowed_methods=frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"}),
        raise_on_status=False,
    )
    s = requests.Session()
    adapter = HTTPAdapter(max_retries=retry)
    s.mount("http://", adapter)
    s.mount("https://", adapter)
    return s


_NETWORKS_TAKEN = [0]
_NETWORK_CLAIMS: dict[str, int] = {}  # network -> its flocked file, for each this process handed out


def _claim_network(net: str) -> bool:
    """Claim ``net`` for this process across every test run on the machine (another checkout's
    suite, a real-plane run beside this one): an flock on a file named for it, held until this
    process ends, however it ends. Two runs' workers of the same number share a range of
    networks, and a hub makes its bridge only seconds after the choice: without the claim both
    took the same /24 and one hub's servers could not reach it through the wall."""
    import fcntl

    if net in _NETWORK_CLAIMS:  # this process's already: reused once no interface has it
        return True
    folder = Path(tempfile.gettempdir()) / "gpuhub-test-networks"
    folder.mkdir(mode=0o755, exist_ok=True)
    fd = os.open(folder / (net.replace("/", "_") + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    _NETWORK_CLAIMS[net] = fd
    return True


def user_network() -> str:
    """A /24 for one test hub's users behind the wall (local/user_network.py): this xdist
    worker's share of 10.217.0.0/16 (32 networks each; not the product's default 10.213.0.0/16,
    which a hub the machine runs may use), one not on any interface now (a hub still
    running, another run's leftover) and not claimed by another test process now."""
    import ipaddress

    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) % 8 if worker.startswith("gw") and worker[2:].isdigit() else 0
    try:
        shown = json.loads(subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True).stdout or "[]")
        used = [
            ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False)
            for link in shown
            for a in link.get("addr_info", [])
        ]
    except (OSError, ValueError, KeyError):
        used = []
    for _ in range(32):
        k = _NETWORKS_TAKEN[0] % 32
        _NETWORKS_TAKEN[0] += 1
        net = ipaddress.ip_network(f"10.217.{index * 32 + k}.0/24")
        if not any(net.overlaps(u) for u in used) and _claim_network(str(net)):
            return str(net)
    raise RuntimeError("no free /24 in this worker's share of 10.217.0.0/16 for a test hub's users")


# The single-user server a test hub starts, as light as the test allows (issue 45): the real
# ``jupyterhub-singleuser`` (jupyter-server with the hub's extension, gpuhub_notebook's
# endpoints, terminals, kernels) without JupyterLab, whose extensions (jupyterlab, jupyter_lsp,
# notebook_shim) are ~40% of a server's start (0.57 against 0.34 CPU-s measured alone) and serve
# nothing a test without a browser in Lab reads. Tests that look at Lab (a browser on /lab, the
# lab extension) ask for ``lab=True``; the product's own servers are unchanged.
WITHOUT_LAB = ("jupyterlab", "jupyter_lsp", "notebook_shim")


def server_args_config(lab: bool) -> str:
    if lab:
        return ""
    off = [f"--ServerApp.jpserver_extensions={name}=False" for name in WITHOUT_LAB]
    return f"c.Spawner.args = (list(c.Spawner.args) if 'args' in c.Spawner else []) + {off!r}\n"


def slow_spawn_config(seconds: float | None) -> str:
    """JupyterHub holds a spawn's POST up to ``slow_spawn_timeout`` (10 s) before it answers 202;
    a spawn that queues is held all of it, doing nothing. A module that queues spawns and does
    not test that wait sets it shorter: a queued POST still answers 202, and a refusal (the
    policy's, decided at the spawn's start, in milliseconds) still its error. Not where a test
    expects an error that comes later in a start (an account that cannot be made, a queue
    timeout shorter than 10 s: test_isolation, test_restart_and_timeout)."""
    if seconds is None:
        return ""
    return (
        "c.JupyterHub.tornado_settings = dict(c.JupyterHub.tornado_settings if 'tornado_settings' in c.JupyterHub else {}, "
        f"slow_spawn_timeout={seconds!r})\n"
    )


class Hub:
    def __init__(
        self,
        workdir: Path,
        policy_text: str,
        extra_config: str = "",
        mlflow: bool = False,
        env: dict | None = None,
        lab: bool = False,
        slow_spawn_timeout: float | None = None,
    ):
        self.lab = lab  # full JupyterLab in every server (browser tests that look at Lab)
        self.mlflow = mlflow  # the MLflow service costs ~450 MiB and ~10 s of CPU per hub
        self.extra_env = dict(env or {})
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.data = self.workdir / "data"
        self.policy = self.workdir / "policy.yaml"
        self.policy.write_text(policy_text)
        self.run_id = uuid.uuid4().hex
        self.port = free_port()
        self.hub_port = free_port()
        self.proxy_port = free_port()
        self.mlflow_port = free_port()
        self.user_network = user_network()
        # The hub's public origin. User servers live on <user>.localhost (their own origins,
        # JupyterHub.subdomain_host); tests/conftest.py resolves *.localhost to loopback as
        # browsers do.
        self.url = f"http://localhost:{self.port}"
        self.config = self.workdir / "jupyterhub_config.py"
        servers = reserve(300)  # room for a benchmark storm of 200 servers at once
        self.config.write_text(
            f"exec(open({str(CONFIG)!r}).read())\n"
            "c.Spawner.environment = dict(c.Spawner.environment if 'environment' in c.Spawner else {}, "
            f"GPUHUB_TEST_RUN={self.run_id!r})\n"
            "c.JupyterHub.log_level = 'DEBUG'\n"
            "c.Spawner.debug = False\n"
            "c.Spawner.default_url = '/tree'\n"
            + server_args_config(lab)
            + slow_spawn_config(slow_spawn_timeout)
            # Servers listen on ports of this worker's block (support/ports.py), not where every
            # client connection on the machine takes its local port (a start lost its port so).
            + (f"c.IsolatedProcessSpawner.server_ports = '{servers.start}-{servers.stop - 1}'\n" if servers else "")
            + extra_config
        )
        self.proc: subprocess.Popen | None = None
        self.log = self.workdir / "hub.log"
        self.started_in: float | None = None

    @property
    def env(self) -> dict:
        return dict(
            os.environ,
            GPUHUB_DATA_DIR=str(self.data),
            GPUHUB_POLICY=str(self.policy),
            GPUHUB_PORT=str(self.port),
            GPUHUB_HUB_PORT=str(self.hub_port),
            GPUHUB_PROXY_API_PORT=str(self.proxy_port),
            GPUHUB_DEMO_PASSWORD=PASSWORD,
            GPUHUB_MLFLOW="1" if self.mlflow else "0",
            GPUHUB_MLFLOW_PORT=str(self.mlflow_port),
            # As root every server runs as its own Unix account; these are this hub's alone.
            GPUHUB_ACCOUNT_PREFIX=f"t{self.run_id[:6]}-",
            # ... and so is the network of its users' addresses behind the wall (as root).
            GPUHUB_USER_NETWORK=self.user_network,
            **self.extra_env,
        )

    def start(self, timeout: float = 120) -> "Hub":
        # 120 s: on 2 cores at load 10-16 (two workers beside other work) a hub took over 60 s
        # to answer, half of it importing (jsonschema's rfc3987_syntax builds its Lark parsers
        # at import: ~3 s of CPU in every hub and single-user server).
        t0 = time.perf_counter()
        logf = open(self.log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterhub", "-f", str(self.config)],
            cwd=self.workdir,
            env=self.env,
            stdout=logf,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                tail = self.tail()
                self._stop_after_failed_start()  # its proxy and servers, if it got that far
                raise RuntimeError(f"hub exited with {self.proc.returncode}:\n{tail}")
            try:
                if requests.get(self.url + "/hub/api/", timeout=2).status_code == 200:
                    self.started_in = time.perf_counter() - t0
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.2)
        tail = self.tail()
        # A fixture whose start fails never reaches its teardown: stop this hub, its proxy,
        # its services and servers here, or they run on after the test run.
        self._stop_after_failed_start()
        raise TimeoutError(f"hub did not answer in {timeout}s:\n{tail}")

    def _stop_after_failed_start(self) -> None:
        """Stop what a failed start left; the start's own error is what the caller must see (a
        hub refused for another hub's account prefix: removing that prefix's isolation is
        refused too, and that refusal must not replace the hub's)."""
        try:
            self.stop()
        except Exception as e:  # noqa: BLE001
            print(f"[hub] cleanup after a failed start: {e}", file=sys.stderr)

    def users_reach_hub_at(self) -> str:
        """Where users' servers reach the hub's side (its API, its services): the wall's bridge
        address when the hub built one (as root), else 127.0.0.1. Read from the hub's own
        start-up line, so it is what this hub decided."""
        import re

        m = re.search(r"the hub answers them at (\S+)", self.log.read_text(errors="replace")) if self.log.exists() else None
        return m.group(1) if m else "127.0.0.1"

    def server_url(self, url: str) -> str:
        """An absolute URL for a server model's ``url`` (absolute with subdomains, else a path)."""
        return url if "://" in url else self.url + url

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, kill_servers: bool = True, timeout: float = 30) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if kill_servers:
            self.kill_servers()

    def kill_servers(self) -> None:
        pidfile = self.data / "proxy.pid"
        if pidfile.exists():
            try:
                os.kill(int(pidfile.read_text().strip()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
        for pid in processes_with_env(f"GPUHUB_TEST_RUN={self.run_id}"):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if os.geteuid() == 0:  # the Unix accounts and cgroups this hub's servers ran in
            from gpuhub_spawner.local.isolation import remove_isolation

            prefix = self.env["GPUHUB_ACCOUNT_PREFIX"]
            remove_isolation(prefix)
            remove_private_tmps(prefix)

    def login(self, name: str, password: str = PASSWORD) -> "UserClient":
        return UserClient(self, name, password)

    def stop_servers(self, *names: str) -> None:
        """These users have no server, whatever the tests before left (each test runs in any order)."""
        for name in names:
            u = self.login(name)
            if u.server() is not None:
                u.stop()
                u.wait_gone()


@contextmanager
def running_hub(workdir: Path, policy_text: str, start_timeout: float = 120, **kwargs) -> Iterator[Hub]:
    """A started ``Hub`` (arguments as ``Hub``'s), stopped with its proxy, servers and accounts
    afterwards whatever happened: a module's hub fixture is ``with running_hub(...) as h: yield h``."""
    h = Hub(workdir, policy_text, **kwargs)
    try:
        h.start(start_timeout)
        yield h
    finally:
        h.stop()


class UserClient:
    def __init__(self, hub: Hub, name: str, password: str):
        self.hub = hub
        self.name = name
        self.session = browser_like_session()
        self.session.get(hub.url + "/hub/login")
        xsrf = self.session.cookies.get("_xsrf")
        r = self.session.post(
            hub.url + "/hub/login",
            data={"username": name, "password": password, "_xsrf": xsrf},
            allow_redirects=False,
        )
        if r.status_code != 302:
            raise PermissionError(f"login as {name} failed: {r.status_code}")
        xsrf = self.session.cookies.get("_xsrf", path="/hub/") or xsrf
        r = self.session.post(
            f"{hub.url}/hub/api/users/{name}/tokens",
            headers={"X-XSRFToken": xsrf},
            json={"note": "tests"},
        )
        r.raise_for_status()
        self.token = r.json()["token"]
        self.api = browser_like_session()
        self.api.headers["Authorization"] = f"token {self.token}"

    def url(self, path: str) -> str:
        return f"{self.hub.url}/hub/api{path}"

    def model(self) -> dict:
        r = self.api.get(self.url(f"/users/{self.name}"))
        r.raise_for_status()
        return r.json()

    def server(self, name: str = "") -> dict | None:
        return self.model()["servers"].get(name)

    def start(self, profile: str | None = None, server: str = "", **options) -> requests.Response:
        if profile is not None:
            options["profile"] = profile
        path = f"/users/{self.name}/servers/{server}" if server else f"/users/{self.name}/server"
        return self.api.post(self.url(path), json=options)

    def start_background(self, profile: str | None = None, server: str = "", **options):
        """Start without blocking: the hub holds the request up to its slow-spawn timeout."""
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(1)
        future = pool.submit(self.start, profile, server, **options)
        pool.shutdown(wait=False)
        return future

    def stop(self, server: str = "") -> requests.Response:
        path = f"/users/{self.name}/servers/{server}" if server else f"/users/{self.name}/server"
        return self.api.delete(self.url(path))

    def wait_ready(self, server: str = "", timeout: float = 90) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            s = self.server(server)
            if s and s.get("ready"):
                return s
            time.sleep(0.2)
        raise TimeoutError(
            f"{self.name}'s server {server!r} not ready after {timeout}s: {self.server(server)}\n{self.hub.tail()}"
        )

    def wait_gone(self, server: str = "", timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.server(server) is None:
                return
            time.sleep(0.2)
        raise TimeoutError(f"{self.name}'s server {server!r} still there: {self.server(server)}")

    def progress(self, server: str = "", until=lambda evt: True, timeout: float = 30) -> list[dict]:
        """Read the spawn progress event stream until ``until(event)`` holds.

        A caller that started the spawn in the background (``start_background``) can get here
        before the hub has taken the POST; the hub then answers 400 "not starting". That is a
        race of the test, not the product's answer, so it is retried within ``timeout``.
        """
        path = f"/users/{self.name}/servers/{server}/progress" if server else f"/users/{self.name}/server/progress"
        events = []
        deadline = time.time() + timeout
        while True:
            r = self.api.get(self.url(path), stream=True, timeout=timeout)
            if r.status_code == 400 and "not starting" in r.text and time.time() < deadline:
                r.close()
                time.sleep(0.2)
                continue
            break
        with r:
            r.raise_for_status()
            for line in r.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data:"):
                    continue
                evt = json.loads(line[5:])
                events.append(evt)
                if until(evt) or evt.get("ready") or evt.get("failed"):
                    break
        return events

    def server_env(self, server: str = "") -> dict[str, str]:
        """The real environment of this user's running server process."""
        s = self.server(server)
        assert s and s.get("ready"), s
        r = requests.get(
            self.hub.server_url(s["url"]) + "api/status",
            headers={"Authorization": f"token {self.token}"},
        )
        r.raise_for_status()
        found = []
        for pid in processes_with_env(f"GPUHUB_TEST_RUN={self.hub.run_id}"):
            env = _environ(pid)
            if env.get("JUPYTERHUB_USER") == self.name and env.get("JUPYTERHUB_SERVER_NAME", "") == server:
                found.append(env)
        # The server itself, not one of its kernels (which jupyter-server starts without the
        # server's JUPYTERHUB_SERVICE_URL) nor its launcher: the process that has the whole set.
        for env in found:
            if "JUPYTERHUB_SERVICE_URL" in env:
                return env
        if found:
            return found[0]
        raise LookupError(f"no process for {self.name}/{server}")


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.decode().split("=", 1) for item in raw.split(b"\0") if b"=" in item)
