"""The proxy outlives a restart of the hub (one machine).

JupyterHub starts the Node configurable-http-proxy itself, and at every start it kills
the proxy a previous hub left running (``ConfigurableHTTPProxy._check_previous_process``),
with a fresh random auth token. With ``cleanup_servers = False`` the users' servers survive
a restart, but their routes did not: for the seconds the hub needed to come back, every
open JupyterLab got "connection refused" or a 503 and told its user "Your server ... is not
running. Would you like to restart it?", and every waiting page's progress stream died.

``KeptProxy`` adopts the previous proxy instead, when it is provably the one this hub
would start:

* its pid is in this hub's pid file (in the hub's private data directory),
* ``/proc/<pid>/cmdline`` is exactly the command this hub would run now (executable,
  ports, error target, ``--default-target``, host routing; a changed configuration is
  never adopted),
* its API answers this hub's auth token, which is kept in a 0600 file in the data
  directory (created so from the first byte) and given to the proxy as
  ``CONFIGPROXY_AUTH_TOKEN``.

Its routes are kept; JupyterHub's route check (``check_routes``, right after start and
again when the servers are re-adopted) then adds, fixes or deletes what differs. Anything
else is JupyterHub's behaviour: a previous proxy that fails a check is stopped and a new
one started. One refinement: a process at the stale pid that is not this proxy command at
all (the pid was reused by something else) is left alone; JupyterHub would signal it.

An adopted proxy is not the hub's child, so there is no ``Popen`` to poll:
``check_running`` (every ``check_running_interval`` s) watches the pid and its start time
(so a reused pid is not taken for the proxy) and starts a new proxy, and restores its
routes, when it is gone.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
from pathlib import Path
from urllib.parse import unquote

from jupyterhub.objects import Server
from jupyterhub.proxy import ConfigurableHTTPProxy
from jupyterhub.utils import url_path_join
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.ioloop import PeriodicCallback
from traitlets import Any, Bool, Float, Unicode, default


def keep_secret_file(path: str | os.PathLike) -> str:
    """The token in ``path``; made (0600 from the first byte, O_EXCL) when missing or empty."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW)
        with os.fdopen(fd, "r+") as f:
            if os.fstat(f.fileno()).st_mode & 0o077:
                os.fchmod(f.fileno(), 0o600)
            token = f.read().strip()
            if token:
                return token
            token = secrets.token_hex(32)
            f.seek(0)
            f.truncate()
            f.write(token)
            return token
    token = secrets.token_hex(32)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


def proc_cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode(errors="surrogateescape") for a in raw.split(b"\0")[:-1]] if raw else None


def proc_start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), ``None`` if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def as_executed(cmd: list[str]) -> list[list[str]]:
    """What ``/proc/<pid>/cmdline`` shows for ``cmd``: itself, or through its ``#!`` interpreter.

    For ``#!/usr/bin/env node`` the kernel runs ``env node <script> args`` and env then
    ``node <script> args``; for ``#!/path/python`` it is ``/path/python <script> args``.
    """
    exe = cmd[0] if "/" in cmd[0] else (shutil.which(cmd[0]) or cmd[0])
    forms = [list(cmd), [exe, *cmd[1:]]]
    try:
        with open(exe, "rb") as f:
            first = f.readline(512)
    except OSError:
        return forms
    if first.startswith(b"#!"):
        interp, _, arg = first[2:].decode(errors="replace").strip().partition(" ")
        arg = arg.strip()
        if os.path.basename(interp) == "env" and arg and " " not in arg:
            forms.append([arg, exe, *cmd[1:]])
        else:
            forms.append([interp, *([arg] if arg else []), exe, *cmd[1:]])
    return forms


def _kept_proxy_hint(holders: dict[int, str]) -> str:
    """Where the port's holder is a proxy (gpuhub keeps its proxy running across hub restarts),
    say so: it is most likely the one an earlier hub of this machine kept, which a hub with that
    hub's data directory takes over instead of starting a second one."""
    proxies = [p for p, cmd in holders.items() if "configurable-http-proxy" in cmd or "gpuhub-proxy" in cmd]
    if not proxies:
        return ""
    return (
        f" It is a hub proxy (pid {', '.join(map(str, sorted(proxies)))}): most likely the one an earlier"
        " gpuhub kept running when it stopped. Start the hub with that hub's --data-dir (it takes the"
        " proxy over) or end the proxy."
    )


class PublicPortTaken(RuntimeError):
    """The proxy is not the process listening on the hub's public port."""


class KeptProxy(ConfigurableHTTPProxy):
    """JupyterHub's ``ConfigurableHTTPProxy`` that keeps a running proxy across hub restarts."""

    keep_running_proxy = Bool(
        True,
        config=True,
        help="Adopt a still-running proxy this hub started before (see the module's docstring) "
        "instead of killing it; False is JupyterHub's behaviour.",
    )
    auth_token_file = Unicode(
        "",
        config=True,
        help="Where the proxy's auth token is kept (0600), so a restarted hub can still talk "
        "to the proxy it adopts. Empty: a new token every start (JupyterHub's default); "
        "CONFIGPROXY_AUTH_TOKEN, when set, wins.",
    )
    public_listen_timeout = Float(
        5,
        config=True,
        help="Seconds the proxy has, once its API answers, to be seen listening on the public "
        "address before the hub refuses to run; a port another process holds is refused "
        "as soon as the listen watcher is sure (half a second).",
    )
    listening = Any(
        None,
        config=True,
        help="""The machine's socket table and listen watcher (``local/listening.py``: ``watcher()``,
        ``listening_sockets()``, ``PortTaken``), handed in by ``wiring.configure_local``, so this
        proxy checks who holds its public port without importing a backend. None: not checked.""",
    )
    adopted_pid = Any(None, help="pid of the proxy adopted at start (no Popen for it)")
    _adopted_start_time = Any(None)

    @default("auth_token")
    def _kept_auth_token(self):
        if os.environ.get("CONFIGPROXY_AUTH_TOKEN") or not (self.should_start and self.auth_token_file):
            return super()._auth_token_default()
        return keep_secret_file(self.auth_token_file)

    # -- the command --------------------------------------------------------------------------
    def proxy_cmd(self) -> list[str]:
        """The command ``ConfigurableHTTPProxy.start`` runs (JupyterHub 5/6), rebuilt to compare.

        ``start`` checks after each launch that it equals what was really run, and warns when a
        JupyterHub upgrade changed it (then a restart would not adopt the proxy).
        """
        proxy_server = Server.from_url(self.public_url)
        if proxy_server._unix_socket:
            server_args = ["--socket", unquote(proxy_server.connect_addr)]
        else:
            server_args = ["--ip", proxy_server.ip, "--port", str(proxy_server.port)]
        api_server = Server.from_url(self.api_url)
        if api_server._unix_socket:
            api_args = ["--api-socket", unquote(api_server.connect_addr)]
        else:
            api_args = ["--api-ip", api_server.ip, "--api-port", str(api_server.port)]
        cmd = list(self.command) + [
            *server_args,
            *api_args,
            "--error-target",
            url_path_join(self.hub.url, "error"),
            "--log-level",
            self.log_level,
        ]
        if self.app.subdomain_host:
            cmd.append("--host-routing")
        if self.ssl_key:
            cmd.extend(["--ssl-key", self.ssl_key])
        if self.ssl_cert:
            cmd.extend(["--ssl-cert", self.ssl_cert])
        if self.app.internal_ssl:
            cmd.extend(self._get_ssl_options())
        return cmd

    def _is_our_command(self, pid: int, exact: bool) -> bool:
        """Whether ``pid`` runs the proxy command this hub would run (``exact``) or just its executable."""
        cmdline = proc_cmdline(pid)
        if not cmdline:
            return False
        if exact:
            return any(cmdline == form for form in as_executed(self.proxy_cmd()))
        exe = self.command[0] if self.command else ""
        exe = exe if "/" in exe else (shutil.which(exe) or exe)
        return bool(exe) and exe in cmdline[:3]

    def _read_pid_file(self) -> int | None:
        try:
            return int(Path(self.pid_file).read_text().strip())
        except (OSError, ValueError):
            return None

    async def _answers_our_token(self) -> bool:
        if not self.api_url.startswith(("http://", "https://")):
            return False  # a unix socket needs JupyterHub's own client; not adopted
        req = HTTPRequest(
            url_path_join(self.api_url, "api/routes"),
            headers={"Authorization": f"token {self.auth_token}"},
            connect_timeout=3,
            request_timeout=5,
        )
        try:
            resp = await AsyncHTTPClient().fetch(req, raise_error=False)
        except Exception as e:  # refused, reset, TLS
            self.log.warning("Previous proxy's API did not answer: %s", e)
            return False
        return resp.code == 200

    async def _adopt_previous(self) -> bool:
        if not (self.keep_running_proxy and self.pid_file and os.path.exists(self.pid_file)):  # noqa: ASYNC240 (one stat at start)
            return False
        pid = self._read_pid_file()
        if pid is None or proc_start_time(pid) is None:
            return False
        if not self._is_our_command(pid, exact=True):
            self.log.warning(
                "Proxy pid file %s: pid %s is not the proxy this hub would run %s (cmdline %s); not keeping it",
                self.pid_file,
                pid,
                self.proxy_cmd(),
                proc_cmdline(pid),
            )
            return False
        start_time = proc_start_time(pid)
        if not await self._answers_our_token():
            self.log.warning("Proxy pid=%s does not accept this hub's auth token; not keeping it", pid)
            return False
        try:
            await self._confirm_public_listener(pid)
        except PublicPortTaken as e:
            self.log.warning("Previous proxy pid=%s is not listening on the public port; not keeping it: %s", pid, e)
            return False
        self.proxy_process = None
        self.adopted_pid, self._adopted_start_time = pid, start_time
        self.log.info("Keeping the running proxy pid=%s (started by a previous hub) and its routes", pid)
        return True

    def _check_previous_process(self):
        """JupyterHub's, except that a pid now used by something other than the proxy is not signalled."""
        pid = self._read_pid_file() if self.pid_file and os.path.exists(self.pid_file) else None
        if pid is not None and proc_start_time(pid) is not None and not self._is_our_command(pid, exact=False):
            self.log.warning(
                "Proxy pid file %s names pid %s, which is not a proxy (%s); leaving it alone",
                self.pid_file,
                pid,
                proc_cmdline(pid),
            )
            self._remove_process_files()
            return
        return super()._check_previous_process()

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self):
        if await self._adopt_previous():
            pc = PeriodicCallback(self.check_running, 1e3 * self.check_running_interval)
            self._check_running_callback = pc
            pc.start()
            return
        self.adopted_pid = self._adopted_start_time = None
        await super().start()  # stops a previous proxy that is not kept, starts ours
        ran = list(self.proxy_process.args)
        if ran != self.proxy_cmd():
            self.log.warning(
                "gpuhub: KeptProxy.proxy_cmd() %s differs from the command JupyterHub ran %s; "
                "a restart of the hub will not keep this proxy",
                self.proxy_cmd(),
                ran,
            )
        try:
            await self._confirm_public_listener(self.proxy_process.pid)
        except PublicPortTaken:
            self.stop()
            raise

    async def _confirm_public_listener(self, pid: int) -> None:
        """Raise ``PublicPortTaken`` unless the proxy process itself listens on the public port.

        configurable-http-proxy logs a failed ``listen`` (EADDRINUSE) as an uncaught exception
        and runs on with only its API, and JupyterHub then reports "running at" an address
        where whatever bound the port first answers the users: their logins, their servers'
        traffic. Any local account can bind an unprivileged port before the hub starts, so
        this is checked, from the kernel's socket table, not assumed.
        """
        server = Server.from_url(self.public_url)
        if server._unix_socket or self.listening is None:
            return  # a socket file: the proxy creates it; nobody else answers at that path
        port = int(server.port)
        try:  # the listen watcher servers' start-ups use: the proxy's own socket, or PortTaken
            seen = await self.listening.watcher().wait(port, pid, self.public_listen_timeout)
        except self.listening.PortTaken:
            seen = "taken"
        if seen == "listening":
            return
        holders = self.listening.listening_sockets().get(port, {})
        owners = sorted(set(holders.values()))
        who = self.listening.socket_holders(set(holders)) if holders else {}
        why = "it exited" if seen == "exited" else f"not within {self.public_listen_timeout:g} s"
        raise PublicPortTaken(
            f"gpuhub cannot start: the hub's public address {self.public_url} (port {port}) is not "
            f"served by its proxy: "
            + (
                f"another process (uid {', '.join(map(str, owners))}"
                + "".join(f"; pid {p}: {cmd}" for p, cmd in sorted(who.items()))
                + f") already listens on port {port}, and users would reach it instead of the hub."
                if owners
                else f"the proxy (pid {pid}) did not listen on port {port} ({why}; see its error above)."
            )
            + _kept_proxy_hint(who)
            + " Stop that process or give the hub another port (`gpuhub run --port N`, which"
            " ./run-hub.sh passes on; GPUHUB_PORT; or JupyterHub.bind_url)."
        )

    def _running(self) -> bool:
        if self.proxy_process is not None:
            return self.proxy_process.poll() is None
        return self.adopted_pid is not None and proc_start_time(self.adopted_pid) == self._adopted_start_time

    async def check_running(self):
        """Restart the proxy (ours or adopted) when it is gone, then restore its routes."""
        if self._running():
            return
        if self.proxy_process is not None:
            self.log.error("Proxy stopped with exit code %r", self.proxy_process.poll())
        else:
            self.log.error("Kept proxy pid=%s is gone", self.adopted_pid)
        if self._check_running_callback is not None:
            self._check_running_callback.stop()  # start() makes a new one
        self._remove_process_files()
        await self.start()
        await self.restore_routes()

    def stop(self):
        if self.proxy_process is not None:
            return super().stop()
        self.log.info("Cleaning up kept proxy[%s]...", self.adopted_pid)
        if self._check_running_callback is not None:
            self._check_running_callback.stop()
        if self._running():
            try:
                os.kill(self.adopted_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        self._remove_process_files()
