"""Local servers that cannot reach each other, the hub, or GPUs they were not given.

``IsolatedProcessSpawner`` is ``LocalProcessSpawner`` with gpuhub's isolation:

- an unprivileged Unix account per hub user (``unix_users``), private home (0700);
- the server's own cgroup with the profile's memory and CPU (``cgroups``);
- a private ``/dev`` holding only its GPUs, ``no_new_privs`` (``sandbox``);
- an environment built from scratch (JupyterHub's and gpuhub's variables only);
- identity by pid *and* start time, recorded in the hub's own state, for restarts;
- the secrets and team data the policy grants its team and profile (``secrets:``, ``data:``),
  read at each start (a rotated secret reaches the next start) and mounted by the sandbox in
  the server's own mount namespace only; each delivery is audited by name, never by value.

``isolation = "auto"`` isolates whenever the hub runs as root. Without root nothing of
this is possible: servers run as the hub's user (single-user mode) and the hub says
so loudly at start.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from subprocess import Popen
from typing import NoReturn

from jupyterhub.spawner import LocalProcessSpawner
from tornado import web
from traitlets import CaselessStrEnum, Float, TraitError, Unicode, default, validate

from ..policy.grants import Delivery, GrantUnavailable, local_delivery
from ..policy.model import DATA_DIR, JUPYTER_DIR, SECRETS_DIR, Policy
from ..usage import recorder as usage
from .cgroups import CgroupHost, ServerCgroup
from .listening import PORTS, PortTaken
from .listening import watcher as listen_watcher
from .unix_users import Account, AccountError, ensure_account, ensure_home, system_username

# Device-cgroup allow-list (v1): mknod is refused anyway (no CAP_MKNOD); these may be opened.
STANDARD_DEVICE_RULES = [
    "c 1:3 rwm",
    "c 1:5 rwm",
    "c 1:7 rwm",
    "c 1:8 rwm",
    "c 1:9 rwm",  # null zero full random urandom
    "c 5:0 rwm",
    "c 5:2 rwm",
    "c 136:* rwm",  # tty, ptmx, pts
]

_HOSTS: dict[tuple[str, str], CgroupHost] = {}


def cgroup_host(root: str, group: str) -> CgroupHost:
    key = (root, group)
    if key not in _HOSTS:
        _HOSTS[key] = CgroupHost.detect(root, group)
    return _HOSTS[key]


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot): with the pid, an identity."""
    try:
        raw = open(f"/proc/{pid}/stat", "rb").read()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()
    return int(fields[19])  # field 22 of stat(5); fields[0] is field 3


def process_uid(pid: int) -> int | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} bytes"


def isolation_available() -> bool:
    return os.geteuid() == 0 and sys.platform.startswith("linux")


def announce_isolation(c=None, stream=None) -> bool:
    """Say at start, loudly where it matters, whether servers will be isolated."""
    import logging

    log = logging.getLogger("JupyterHub.gpuhub.isolation")
    mode = "auto"
    if c is not None and "LocalGpuSpawner" in c and "isolation" in c.LocalGpuSpawner:
        mode = c.LocalGpuSpawner.isolation
    if mode != "off" and isolation_available():
        from .service import hold_prefix_at_hub_start

        hold_prefix_at_hub_start(c, stream)  # one hub per account prefix: a second one ends here
        host = CgroupHost.detect()
        msg = f"gpuhub: servers run isolated (own Unix account, private /dev with only their GPUs, {host.describe()})"
        print(msg, file=stream or sys.stderr, flush=True)
        log.info(msg)
        return True
    msg = (
        "\n" + "!" * 78 + "\n"
        "gpuhub: SINGLE-USER MODE - the hub is not running as root, so every server runs as\n"
        f"  the hub's own user ({os.environ.get('USER') or os.geteuid()}): users can read each other's files and the\n"
        "  hub's data, GPUs are only assigned by CUDA_VISIBLE_DEVICES (not enforced), CPU and\n"
        "  memory limits are not enforced, and every port a user's programs open (kernels,\n"
        "  Ray, TensorBoard) answers every other user. Fine for trying gpuhub alone; for a lab, run the hub\n"
        "  as root (see docs/install-one-machine.md).\n" + "!" * 78
    )
    print(msg, file=stream or sys.stderr, flush=True)
    log.warning(msg)
    return False


# Packages a server imports from outside the environment when installed in development mode
# (``pip install -e``): their source folders must be visible in the sandbox too.
SERVER_PACKAGES = ("gpuhub_notebook", "gpuhub_spawner")


def server_software_paths() -> list[str]:
    """What a sandboxed server must see read-only: the Pythons and any editable sources."""
    import importlib.util

    paths = [sys.base_prefix, sys.prefix]
    for name in SERVER_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = os.path.dirname(os.path.realpath(list(spec.submodule_search_locations)[0]))
        if not any(root == p or root.startswith(p.rstrip("/") + "/") for p in paths):
            paths.append(root)
    return paths


# The threads of isolated starts, apart from the loop's default executor, which the hub needs
# for other things while a crowd starts (tornado resolves every address it connects to there:
# the proxy's API, each server's URL). Account changes are one at a time on this machine
# (unix_users' lock), so they get one thread: a storm's account checks used to fill every
# worker of the default executor with threads waiting for that lock, and every launch's
# set-up, and every connection, queued behind them. Launches: as many as the broker lets
# launch at once (LocalBroker.launch_concurrency, 8), more wait here. Ends: a stopped server's
# cgroup emptied and removed (kill rounds 20 ms apart, up to 1 s while the last processes exit),
# which a culler pass stopping 50 servers did on the loop one after the other. Network: a new
# user's side of the wall (two runs of `ip`), users in parallel (user_network.Wall.ensure_user).
_POOLS: dict = {}
POOL_SIZES = {"accounts": 1, "launches": 8, "ends": 4, "network": 8}


def _end_group(cg: ServerCgroup) -> None:
    """Kill what is left in a stopped server's cgroup and remove it (in ``_pool("ends")``),
    and its user's group when it was the user's last."""
    cg.kill_all()
    cg.remove()
    cg.remove_user_group_if_empty()


def _pool(name: str):
    if name not in _POOLS:
        from concurrent.futures import ThreadPoolExecutor

        _POOLS[name] = ThreadPoolExecutor(max_workers=POOL_SIZES[name], thread_name_prefix=f"gpuhub-{name}")
    return _POOLS[name]


@dataclass
class _Launched:
    """What the launch thread made: the launcher (its spec not yet handed over) and the cgroup's counters."""

    proc: Popen
    wfd: int
    payload: bytes
    start_time: int | None
    found: dict[str, tuple[int, int]]
    oom_base: int
    pids_base: int
    oom_fd: int | None
    user_pids_base: int = 0


class IsolatedProcessSpawner(LocalProcessSpawner):
    """A local process spawner whose servers run isolated (see the module docstring)."""

    isolation = CaselessStrEnum(
        ["auto", "on", "off"],
        "auto",
        help="""Run each server as its own Unix account, in its own cgroup, with a private /dev.

        auto: whenever the hub runs as root (the production and CI case); on: refuse to
        start servers without it; off: single-user mode (every server runs as the hub's user).""",
    ).tag(config=True)

    account_prefix = Unicode(
        help="""Prefix of the Unix account made for each hub user (e.g. gpuhub-alice).

        Default: $GPUHUB_ACCOUNT_PREFIX, else "gpuhub-".""",
    ).tag(config=True)

    @default("account_prefix")
    def _default_prefix(self):
        return os.environ.get("GPUHUB_ACCOUNT_PREFIX", "gpuhub-")

    home_dir_template = Unicode(
        "/home/{account}",
        help="""Where each user's home lives on the host; {account} and {username} are filled in.

        {username} is the hub name where it is a safe file name, else the account name.""",
    ).tag(config=True)

    device_dir = Unicode(
        "/dev",
        help="""Where the GPU device nodes are found. Tests point this at a tree of stand-in
        nodes (major 195); it is hidden from the servers like /dev itself.""",
    ).tag(config=True)

    tmp_dir_template = Unicode(
        "/tmp/gpuhub/{account}",
        help="""The host directory each account sees as /tmp and /var/tmp (private per user;
        its parent is made 0700). Empty: share the host's /tmp.""",
    ).tag(config=True)

    cgroup_root = Unicode("/sys/fs/cgroup", help="The cgroup filesystem.").tag(config=True)
    cgroup_group = Unicode("gpuhub", help="The group under which each server's cgroup is made.").tag(config=True)
    servers_cpu_weight = Float(
        1.0,
        help="""The CPU weight of all servers and jobs together (the ``cgroup_group``) against
        what runs beside them, the hub among it, relative to the kernel's default (1.0: v1
        cpu.shares 1024, v2 cpu.weight 100). Only decides who runs first while the CPUs are
        contended. The default weighs them as one ordinary process: lower, they yield to
        everything else, background work at nice 19 included (at 0.125, eight such processes
        on 2 cores made a spawn 6.8x slower, 17 s instead of 2.5 s; at 1.0 1.4x). Lower it only
        on a hub machine that runs nothing but the hub and its servers: at 0.125 a storm of
        start-ups on 2 cores waits for the hub's event loop instead of the loop waiting for them
        (the loop waited 5.4 s instead of 9.4 s of a 200-user storm). Each server's own limit
        is its profile's ``cpu``.""",
    ).tag(config=True)

    server_ports = Unicode(
        "",
        help="""The ports servers listen on, as ``FIRST-LAST`` (for example ``20000-29999``).
        Empty (the default): a port the kernel picks, as JupyterHub does. The kernel picks from
        its ephemeral range (``net.ipv4.ip_local_port_range``), where every outgoing connection
        on the machine also takes its local port; on a busy machine one can take a server's
        port in the seconds before the server listens, and that start then fails ("another
        process took its network port"). A range below the ephemeral one, used by nothing else,
        leaves only this hub's own servers there, and the hub never hands one port to two.""",
    ).tag(config=True)

    network_wall = CaselessStrEnum(
        ["auto", "on", "off"],
        "auto",
        help="""Put each user's servers, jobs and Ray clusters in a network namespace of the user's
        own (local/user_network.py): no port any of them opens is reachable from another user's
        processes; only the hub's side (the hub, its proxy, its services) reaches them.

        auto: whenever servers run isolated and the machine can (root, iproute2, bridges);
        on: refuse to start servers without it; off: every user's ports answer every other
        user, as any program's on a shared machine. The hub's configuration
        (``gpuhub_spawner.wiring``) sets this to what it could build at start.""",
    ).tag(config=True)

    user_network = Unicode(
        help="""The IPv4 network of the users' addresses behind the wall (CIDR). The hub takes
        its first address (the bridge's: servers reach the hub's API and services there), each
        user the next free one. It must not overlap a network the machine uses. Default:
        $GPUHUB_USER_NETWORK, else 10.213.0.0/16.""",
    ).tag(config=True)

    @default("user_network")
    def _default_user_network(self):
        from .user_network import network_from_env

        return network_from_env()

    @validate("server_ports")
    def _valid_server_ports(self, proposal):
        text = proposal["value"].strip()
        if text and _port_span(text) is None:
            raise TraitError(f"server_ports must be FIRST-LAST with 1024 <= FIRST <= LAST <= 65535, not {text!r}")
        return text

    @validate("servers_cpu_weight")
    def _valid_weight(self, proposal):
        w = proposal["value"]
        if not 0.002 <= w <= 100:
            raise TraitError(f"servers_cpu_weight must be between 0.002 and 100 (1.0 is the kernel's default), not {w}")
        return w

    stop_reason: str | None = None
    _delivery: Delivery | None = None  # what this start was granted (policy secrets/data)
    _grants_tmp: str | None = None  # single-user mode: the directory holding them
    _net = None  # user_network.UserNet: the user's side of the wall, while walled
    _account: Account | None = None
    _cgroup: ServerCgroup | None = None
    _start_time: int | None = None
    _oom_fd: int | None = None
    _oom_base: int = 0  # OOM kills the group had before this server (a reused group)
    _pids_base: int = 0  # refused forks the group had counted before this server
    _user_pids_base: int = 0  # ... and its user group (every server and job of the user)
    _pids_note: str | None = None  # "reached its limit of N processes", once seen

    # -- who and where ---------------------------------------------------------------------
    @property
    def isolated(self) -> bool:
        if self.isolation == "off":
            return False
        if self.isolation == "on" and not isolation_available():
            raise RuntimeError("isolation = 'on' but the hub is not running as root on Linux")
        return isolation_available()

    @property
    def walled(self) -> bool:
        """Do this spawner's processes run behind the wall (a network namespace per user)?"""
        return self.network_wall != "off" and self.isolated

    @property
    def wall(self):
        from .user_network import Wall

        return Wall.of(self.user_network, self.account_prefix)

    @property
    def account_name(self) -> str:
        return system_username(self.user.name, self.account_prefix)

    @property
    def home_dir(self) -> str:
        name = self.user.name
        safe = name if re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]*", name) else self.account_name
        return self.home_dir_template.format(account=self.account_name, username=safe)

    @property
    def visible_home(self) -> str:
        """The home as the server sees it: its real path unless that is unreachable (isolated)."""
        return f"/home/{self.account_name}" if self.isolated else self.home_dir

    @property
    def cgroup_host(self) -> CgroupHost:
        return cgroup_host(self.cgroup_root, self.cgroup_group)

    def _user_group(self) -> str:
        """The cgroup holding every server, job and Ray cluster of this user (their process budget)."""
        return f"{self.account_name}.user"  # leaves are "<account>" or "<account>.<name>.<hash>"

    def _server_cgroup(self) -> ServerCgroup:
        return self.cgroup_host.server(self._cgroup_leaf(), user=self._user_group())

    def server_cgroups(self) -> list[ServerCgroup]:
        """This server's (or job's) cgroup, and where a gpuhub before per-user groups put it."""
        return [self._server_cgroup(), self.cgroup_host.server(self._cgroup_leaf())]

    def _cgroup_leaf(self) -> str:
        leaf = self.account_name
        if self.name:
            safe = re.sub(r"[^A-Za-z0-9-]+", "-", self.name)[:20]
            leaf += f".{safe}.{hashlib.sha256(self.name.encode()).hexdigest()[:6]}"
        return leaf

    # -- what the server gets: hooks for the GPU layer ---------------------------------------
    def device_nodes(self) -> list[str]:
        """Names (relative to ``device_dir``) of the GPU nodes this server may open."""
        return []

    def device_rules(self, nodes: dict[str, tuple[int, int]]) -> list[str]:
        return STANDARD_DEVICE_RULES + [f"c {ma}:{mi} rwm" for ma, mi in nodes.values()]

    def resource_limits(self) -> tuple[int | None, int | None]:
        """(cpu millis, memory bytes) to enforce; Spawner.cpu_limit/mem_limit by default."""
        cpu = int(self.cpu_limit * 1000) if self.cpu_limit else None
        return cpu, (int(self.mem_limit) if self.mem_limit else None)

    def user_process_limit(self) -> int | None:
        """Tasks all of this user's servers, jobs and Ray clusters may hold together (their
        user group's ``pids.max``): the policy's ``defaults.maxProcessesPerUser``."""
        from ..policy.model import DEFAULT_MAX_PROCESSES_PER_USER
        from ..policy.store import PolicyStore

        if not PolicyStore.initialized():
            return DEFAULT_MAX_PROCESSES_PER_USER
        return PolicyStore.instance().current.defaults.max_processes_per_user

    def process_limit(self) -> int | None:
        """Tasks (processes and threads) the cgroup may hold, its ``pids.max``: the policy's
        ``maxProcesses`` of this server's profile, else ``defaults.maxProcesses``.

        The profile is the server's resolved choice; for a job (no choice), the profile
        the job manager names in ``GPUHUB_PROFILE``. Without a policy store (a spawner
        used on its own), the policy's built-in default."""
        from ..policy.model import DEFAULT_MAX_PROCESSES
        from ..policy.store import PolicyStore

        if not PolicyStore.initialized():
            return DEFAULT_MAX_PROCESSES
        policy = PolicyStore.instance().current
        choice = getattr(self, "choice", None)
        if choice is not None:
            profile = choice.profile  # as cpu and memory: the profile this server was admitted with
        else:
            profile = policy.profile((getattr(self, "job_env", None) or {}).get("GPUHUB_PROFILE", ""))
        return policy.process_limit(profile)

    # -- granted secrets and team data (policy ``secrets:``, ``data:``) -------------------------
    def granted_scope(self) -> tuple[Policy, str, str] | None:
        """(policy, team, profile) whose grants this start receives; None: nothing granted.
        The server's spawner answers from its resolved choice, a job's launcher from its record."""
        return None

    @property
    def grant_key(self) -> str:
        """How the audit trail names what received the grants (a server's key, ``job:<id>``)."""
        return f"{self.user.name}/{self.name}"

    async def _resolve_grants(self, loop, env: dict) -> None:
        """Read what is granted (off the loop: the admin's files), put its environment in ``env``.

        A grant that cannot be delivered stops the start: the user is told which grant (by
        name), the admin's log says where in the policy and why (never a value)."""
        self._delivery = None
        scope = self.granted_scope()
        if scope is None or not (scope[0].secrets or scope[0].data):
            return
        try:
            delivery = await loop.run_in_executor(_pool("launches"), local_delivery, *scope)
        except GrantUnavailable as e:
            self.log.error("Cannot start %s: a granted secret or dataset: %s", self._log_name, e)
            msg = (
                "Your server cannot start: a secret or dataset its profile is granted is not available "
                "on this machine. An administrator can find why in the hub's log."
            )
            raise web.HTTPError(500, msg, reason=msg) from None
        if not delivery:
            return
        env.update(delivery.env)
        if delivery.files:
            env["GPUHUB_SECRETS_DIR"] = SECRETS_DIR
        if delivery.data:
            env["GPUHUB_DATA_DIR"] = DATA_DIR
        if delivery.kernels:  # team environments: their kernelspecs, first on Jupyter's data path
            env["JUPYTER_PATH"] = os.pathsep.join(p for p in (JUPYTER_DIR, env.get("JUPYTER_PATH")) if p)
        self._delivery = delivery

    def _grants_single_user(self, env: dict) -> None:
        """Single-user mode (no root, no sandbox): the same layout in a 0700 directory of the
        hub's user, removed at stop. No isolation: every server runs as the hub's user."""
        import tempfile

        d = self._delivery
        if d is None or not (d.files or d.data):
            return
        top = self._grants_tmp = tempfile.mkdtemp(prefix="gpuhub-grants-")
        if d.files:
            os.mkdir(os.path.join(top, "secrets"), 0o700)
            for name, value in d.files.items():
                fd = os.open(os.path.join(top, "secrets", name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
                with os.fdopen(fd, "w") as f:
                    f.write(value)
            env["GPUHUB_SECRETS_DIR"] = os.path.join(top, "secrets")
        if d.data:
            os.mkdir(os.path.join(top, "data"), 0o700)
            for entry in d.data:
                os.symlink(entry["source"], os.path.join(top, "data", entry["name"]))
            env["GPUHUB_DATA_DIR"] = os.path.join(top, "data")
        if d.kernels:
            from .sandbox import kernel_spec

            kernels = os.path.join(top, "jupyter", "kernels")
            os.makedirs(kernels, 0o700)
            for name, display in d.kernels.items():
                os.mkdir(os.path.join(kernels, name), 0o700)
                python = os.path.join(top, "data", name, "bin", "python")
                with open(os.path.join(kernels, name, "kernel.json"), "x") as f:
                    f.write(kernel_spec(python, display, name))
            rest = [p for p in env.get("JUPYTER_PATH", "").split(os.pathsep) if p and p != JUPYTER_DIR]
            env["JUPYTER_PATH"] = os.pathsep.join([os.path.join(top, "jupyter"), *rest])

    def _audit_grants(self) -> None:
        d = self._delivery
        if d is None:
            return
        user = self.user.name
        if d.secret_names:
            # names and how they went, never a value (the audit also drops fields named like secrets)
            usage.audit("secrets_delivered", key=self.grant_key, user=user, names=d.secret_names, delivered_as=d.delivered_as)
            self.log.info("%s received granted secrets %s", self._log_name, ", ".join(d.secret_names))
        if d.data:
            mounts = {e["name"]: "read-only" if e["read_only"] else "read-write" for e in d.data}
            usage.audit("data_mounted", key=self.grant_key, user=user, datasets=mounts)
        self._delivery = None  # the values live on in the server's namespace only, not in the hub

    def _remove_grants_tmp(self) -> None:
        if self._grants_tmp:
            import shutil

            shutil.rmtree(self._grants_tmp, ignore_errors=True)
            self._grants_tmp = None

    # -- environment: nothing of the hub's but what is meant ---------------------------------
    def user_env(self, env):
        env["HOME"] = self.visible_home
        # The server's own environment first on PATH, as in an activated venv or an image:
        # a notebook terminal finds its `python`, `pip` and `gpuhub` (gpuhub job submit).
        bindir = os.path.join(sys.prefix, "bin")
        path = env.get("PATH") or os.defpath
        if bindir not in path.split(os.pathsep):
            env["PATH"] = bindir + os.pathsep + path
        if self.isolated:
            env["USER"] = env["LOGNAME"] = self.account_name
            env["SHELL"] = "/bin/bash"
        return env

    def make_preexec_fn(self, name):
        home = self.home_dir

        def preexec():  # single-user mode only: the sandbox does this when isolated
            os.chdir(home)

        return preexec

    # -- start ---------------------------------------------------------------------------------
    async def start(self):
        if self.port == 0:
            # Not random_port() alone: a port it gives stays free until the server binds it,
            # seconds later, and could be given to a server starting meanwhile (local/listening.py).
            self.port = self._booked_port = PORTS.take(self._port_owner, _port_span(self.server_ports))
        try:
            return await self._start()
        except BaseException:
            if not self.pid:  # nothing holds it; a process that started keeps it until stop()
                self._give_back_port()
            raise

    @property
    def _port_owner(self) -> str:
        return f"{self._log_name} ({id(self):x})"

    def _give_back_port(self) -> None:
        """The server this spawner started is gone (or never started): its booked port is free."""
        port = getattr(self, "_booked_port", None)
        if port:
            PORTS.give_back(port, self._port_owner)
            self._booked_port = None
            if self.port == port:
                self.port = 0  # the next start books a port of its own

    async def _start(self):
        loop = asyncio.get_running_loop()
        cpu, memory = self.resource_limits()
        if cpu:
            self.cpu_limit = cpu / 1000
        if memory:
            self.mem_limit = memory
        self.stop_reason = None
        isolated = self.isolated
        if isolated:
            try:
                self._account = await loop.run_in_executor(_pool("accounts"), ensure_account, self.user.name, self.account_prefix)
                await loop.run_in_executor(_pool("launches"), ensure_home, self.home_dir, self._account)
            except AccountError as e:
                self.log.error("Cannot start %s: %s", self._log_name, e)
                msg = (
                    "Your server cannot start: this machine has no usable Unix account for you. "
                    "An administrator can find why in the hub's log."
                )
                raise web.HTTPError(500, msg, reason=msg) from None
        else:
            os.makedirs(self.home_dir, mode=0o700, exist_ok=True)
        self._net = None
        if isolated and self.walled:
            from .user_network import WallError

            try:
                self._net = await loop.run_in_executor(_pool("network"), self.wall.ensure_user, self._account.name)
            except WallError as e:
                self.log.error("Cannot start %s: the wall around its user: %s", self._log_name, e)
                msg = (
                    "Your server cannot start: this machine could not set up its private network. "
                    "An administrator can find why in the hub's log."
                )
                raise web.HTTPError(500, msg, reason=msg) from None
            self.ip = self._net.address  # the server listens on its user's address, inside the wall
        env = self.get_env()
        await self._resolve_grants(loop, env)
        if not isolated:
            self._grants_single_user(env)
        cmd = [*self.cmd, *self.get_args()]
        popen = dict(start_new_session=True, env=env)
        if not isolated:
            popen["preexec_fn"] = self.make_preexec_fn(self.user.name)
        popen.update({k: v for k, v in self.popen_kwargs.items() if k != "env"})
        if isolated:
            await self._launch_isolated(loop, cmd, env, popen, cpu, memory)
        else:
            self.log.info("Spawning %s as the hub's own user (single-user mode, no isolation)", self._log_name)
            try:
                self.proc = Popen(cmd, **popen)  # noqa: ASYNC220 (as LocalProcessSpawner: fork+exec, no wait)
            except BaseException:
                self._remove_grants_tmp()
                raise
            self.pid = self.proc.pid
            self._start_time = process_start_time(self.pid)
        self._audit_grants()
        if self.serves_http:
            await self._wait_listening()
        return (self.ip or "127.0.0.1", self.port)

    async def _launch_isolated(self, loop, cmd: list[str], env: dict, popen: dict, cpu: int | None, memory: int | None) -> None:
        """Set up the server's sandbox and start its launcher, in a thread, not on the event loop.

        On the loop (reading the hub's state, microseconds): the spawner's hooks (its GPU
        nodes, its process limit) and the account prefix's lock (this process's, taken at
        hub start). In one thread (``_pool("launches")``), all that waits on the kernel: the GPU
        nodes' numbers, leftovers in the cgroup, the cgroup's directories and limits (v1:
        four hierarchies), its OOM eventfd, the private /tmp, the exposed software's paths,
        and the launcher's fork and exec. In a 100-user storm with a GPU each, a launch held
        the loop 13.5 ms (median) with these on it, 3.2 ms now (issue 29; the stock spawner's
        launch, a fork of the hub, 54 ms).

        The spawner's state (process, pid, start time, cgroup, counters, OOM watch) is set
        back on the loop once the launcher exists, before anything is handed to it. A start
        cancelled meanwhile (a stop while it starts, a launch timeout, the hub shutting
        down) leaves nothing running: when the thread is done, its launcher, which never
        got its spec, is killed and reaped (it never ran anything of the user's); a failure
        in the thread before the launcher exists removes the cgroup it made, still empty.
        """
        from .sandbox import hand_over

        nodes = self.device_nodes()
        cg = self._server_cgroup()
        self._pids_note = None
        pids = user_pids = None
        if cg.enforced:
            self._hold_prefix()  # no server starts while another hub holds this prefix
            pids, user_pids = self.process_limit(), self.user_process_limit()
        abandoned = threading.Event()
        fut = loop.run_in_executor(
            _pool("launches"), self._prepare_and_launch, cmd, env, popen, nodes, cg, cpu, memory, (pids, user_pids), abandoned
        )
        try:
            launched = await asyncio.shield(fut)
        except asyncio.CancelledError:
            abandoned.set()  # a thread not yet done ends its launcher itself; one done, the callback does
            fut.add_done_callback(self._abandon_launch)
            raise
        self._cgroup = cg
        self._oom_base, self._pids_base = launched.oom_base, launched.pids_base
        self._user_pids_base = launched.user_pids_base
        self.proc = launched.proc
        self.pid = launched.proc.pid
        self._start_time = launched.start_time
        assert self._account is not None  # _start made it before an isolated launch
        self.log.info(
            "Spawning %s as %s (%s; GPU nodes: %s)",
            self._log_name,
            self._account.name,
            self.cgroup_host.describe(),
            ", ".join(sorted(launched.found)) or "none",
        )
        try:
            # Root's launcher got a fixed environment only; the user's (env) goes on its pipe
            # and is applied by its final execve, after the switch to the account.
            await hand_over(launched.proc, launched.wfd, launched.payload)
        except BaseException:
            if launched.oom_fd is not None:
                os.close(launched.oom_fd)
            raise
        self._watch_oom(launched.oom_fd)

    def _prepare_and_launch(
        self, cmd, env, popen, nodes, cg: ServerCgroup, cpu, memory, pids, abandoned: threading.Event
    ) -> "_Launched | None":
        """The blocking part of an isolated start (an executor thread; see ``_launch_isolated``).

        Reads the spawner's settings only; sets nothing of its state. Hooks called here
        (``device_rules``) must be pure. None: the start was cancelled meanwhile and the
        launcher already ended here."""
        from .sandbox import host_nodes, start_launcher

        assert self._account is not None  # _start made it before an isolated launch
        found = host_nodes(self.device_dir, nodes)
        pids, user_pids = pids
        oom_base = pids_base = user_pids_base = 0
        oom_fd = None
        made = False
        try:
            if cg.enforced:
                self._weigh_servers(cg.host)
                self._clear_leftovers(cg)  # only what is provably this hub's is killed
                made = True
                cg.create(memory=memory, cpu_millis=cpu, device_rules=self.device_rules(found), pids=pids, user_pids=user_pids)
                oom_base, pids_base = cg.oom_kills(), cg.pids_max_events()
                user_pids_base = cg.user_pids_max_events()
                oom_fd = cg.oom_eventfd()  # before the launcher: nothing of the server can come first
            spec = {
                "uid": self._account.uid,
                "gid": self._account.gid,
                "home": self.home_dir,
                "visible_home": self.visible_home,
                "dev_dir": self.device_dir,
                "gpu_nodes": nodes,
                "cgroup_procs": cg.procs_files(),
                "expose": server_software_paths(),
                "tmp": self._private_tmp(),
                "netns": self._net.path if self._net is not None else None,
                "resolv_conf": self._net.resolv_conf if self._net is not None else None,
                # granted secrets' values and team data: on the pipe, mounted in its namespace
                "grants": self._delivery.sandbox_spec() if self._delivery is not None else None,
            }
            # cmd stays the user's command: start_launcher puts the sandbox launcher before it,
            # and spec + env go on a pipe (never argv, never the root launcher's environment).
            proc, wfd, payload = start_launcher(cmd, spec, env, popen)
            if cg.enforced:
                self._join_early(proc.pid, cg)
        except BaseException:
            if oom_fd is not None:
                os.close(oom_fd)
            if made:
                cg.remove()  # nothing joined it: the launcher never started or never had its spec
            raise
        launched = _Launched(proc, wfd, payload, process_start_time(proc.pid), found, oom_base, pids_base, oom_fd, user_pids_base)
        if abandoned.is_set():
            self._end_unstarted(launched)
            launched.proc.wait()
            return None
        return launched

    def _weigh_servers(self, host: CgroupHost) -> None:
        """The servers' group CPU weight and the machine-wide process cap, at every launch (an
        operator's edit of the file, or a group made again, is set back). A refusal is logged
        and the launch goes on: the weight is a priority; the cap backs per-user limits."""
        try:
            host.weigh_servers(self.servers_cpu_weight)
        except OSError as e:
            self.log.warning("Cannot set the CPU weight of the servers' cgroup %s: %s", host.group, e)
        try:
            host.cap_processes()
        except OSError as e:
            self.log.warning("Cannot cap the processes of the servers' cgroup %s: %s", host.group, e)

    def _join_early(self, pid: int, cg: ServerCgroup) -> None:
        """Put the launcher in the server's cgroup now, not once its Python has started.

        ``enter()`` joins it too, but only once it has its spec: after the interpreter's
        start-up and imports (about 40 ms of CPU, as root), which ran in the hub's own cgroup
        at the hub's weight and outside the server's limits. Now they are the server's, as
        everything the launcher then runs is. (In a 200-user storm this was a suspect for the
        hub's slower answers; measured, it is a small part: the event loop waited 8.5 s for
        a CPU instead of 10.8 s, its p50 the same; docs/benchmarks.md.) Only an advance: a
        write refused here (the launcher gone already) is left to ``enter()``, which refuses
        to go on outside the cgroup, and to the caller's exit handling.
        """
        for procs in cg.procs_files():
            try:
                with open(procs, "w") as f:
                    f.write(str(pid))
            except OSError:
                return

    def _abandon_launch(self, fut) -> None:
        """A start was cancelled while its thread ran: end what the thread started (on the loop, once done)."""
        if fut.cancelled() or fut.exception() is not None or fut.result() is None:
            return  # nothing started, or the thread ended it (an exception is the cancelled start's)
        launched = fut.result()
        self._end_unstarted(launched)
        asyncio.get_running_loop().run_in_executor(_pool("launches"), launched.proc.wait)  # reaped

    def _end_unstarted(self, launched: "_Launched") -> None:
        """End a launcher that never had its spec: it may be in the cgroup but has run nothing of the user's."""
        os.close(launched.wfd)  # it reads an empty spec and would exit anyway, entering nothing
        if launched.oom_fd is not None:
            os.close(launched.oom_fd)
        try:
            launched.proc.kill()
        except OSError:
            pass
        self.log.warning(
            "Start of %s was interrupted while its sandbox was set up; its launcher (pid %s) was ended before it ran anything",
            self._log_name,
            launched.proc.pid,
        )

    serves_http = True  # a server is ready when it listens; a batch job (JobProcess) is running once started

    async def _wait_listening(self) -> None:
        """Return as soon as the server's own process listens on its port (``listening``):
        JupyterHub's first check of the URL then answers at once instead of after its
        back-off. A server that exits or takes longer than ``http_timeout`` falls back to
        JupyterHub's own polling and timeouts; a port held by another process is refused."""
        t0 = time.monotonic()
        try:
            uid = self._account.uid if self.isolated and self._account is not None else None
            net = getattr(self, "_net", None)
            outcome = await listen_watcher().wait(
                self.port, self.pid, self.http_timeout, uid=uid, netns=net.path if net is not None else None
            )
        except PortTaken as e:
            self.log.error("%s: %s; not routing to it", self._log_name, e)
            await self.stop(now=True)
            msg = (
                "Your server could not start: another process took its network port. Start it again; "
                "an administrator can see why in the hub's log."
            )
            raise web.HTTPError(500, msg, reason=msg) from None
        self.log.info("%s: %s %.2fs after its process started", self._log_name, outcome, time.monotonic() - t0)

    def _private_tmp(self) -> str | None:
        """The host directory this account sees as /tmp: root's, 1777 like /tmp itself.

        Its parent is root's and 0700, so only this account (through its sandbox) and root
        reach it. Root-owned, the account cannot rename or replace what root made in it
        (sticky bit); the sandbox still never follows a link in it (``open_dir_nofollow``).
        Everything here goes by file descriptor, never by a path that could change.
        """
        if not self.tmp_dir_template:
            return None
        import stat as _stat

        path = self.tmp_dir_template.format(account=self.account_name)
        parent, name = os.path.split(path)
        os.makedirs(parent, mode=0o700, exist_ok=True)
        # /tmp is everyone's: a directory someone else made (or a link) there is refused.
        nofollow_dir = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            pfd = os.open(parent, nofollow_dir)
        except NotADirectoryError:
            raise RuntimeError(f"{parent} is not a directory owned by root; refusing to use it for private /tmp") from None
        try:
            st = os.fstat(pfd)
            if not _stat.S_ISDIR(st.st_mode) or st.st_uid != 0:
                raise RuntimeError(f"{parent} is not a directory owned by root; refusing to use it for private /tmp")
            os.fchmod(pfd, 0o700)
            try:
                os.mkdir(name, 0o700, dir_fd=pfd)
            except FileExistsError:
                pass
            try:
                fd = os.open(name, nofollow_dir, dir_fd=pfd)
            except NotADirectoryError:
                raise RuntimeError(f"{path} is not a directory") from None
        finally:
            os.close(pfd)
        try:
            os.fchown(fd, 0, 0)  # an older gpuhub made it the account's: root's now, as /tmp is
            os.fchmod(fd, 0o1777)
        finally:
            os.close(fd)
        return path

    # -- leftovers: killed only when provably this hub's ------------------------------------------
    def _refuse_start(self, log_msg: str, *args) -> NoReturn:
        self.log.error(log_msg, *args)
        msg = (
            "Your server cannot start: this machine has processes in its place that this hub "
            "did not start. An administrator can find why in the hub's log."
        )
        raise web.HTTPError(500, msg, reason=msg)

    def _hold_prefix(self) -> None:
        """This hub's lock on its account prefix (taken at hub start; here if it was not)."""
        from .service import PrefixHeld, hold_account_prefix

        try:
            hold_account_prefix(self.account_prefix)
        except PrefixHeld as e:
            self._refuse_start("Cannot start %s: %s", self._log_name, e)
        except OSError as e:
            self._refuse_start("Cannot start %s: cannot lock the account prefix %r: %s", self._log_name, self.account_prefix, e)

    def _clear_leftovers(self, cg: ServerCgroup) -> None:
        """Processes left in this server's cgroup (by a hub that died, or a crash) are killed
        only when provably this hub's: it holds the account prefix's lock (no other live hub
        names cgroups so) and every one of them runs as this server's account. Otherwise
        none is killed and the start is refused, saying why in the hub's log."""
        from .service import held_prefix

        stale = cg.pids() if any(p.exists() for p in cg.paths.values()) else []
        if not stale:
            return
        if held_prefix(self.account_prefix) is None:
            self._refuse_start(
                "cgroup of %s holds processes %s and this hub does not hold the account prefix %r; killing none of them",
                self._log_name,
                stale,
                self.account_prefix,
            )
        assert self._account is not None  # _start made it before an isolated launch (the only caller's way here)
        uid = self._account.uid
        foreign = {pid: u for pid in stale if (u := process_uid(pid)) is not None and u != uid}
        if foreign:
            self._refuse_start(
                "cgroup of %s holds processes that do not run as %s (uid %s): %s; killing none of them. "
                "Find out what they are before removing them (%s)",
                self._log_name,
                self._account.name,
                uid,
                ", ".join(f"pid {p} uid {u}" for p, u in sorted(foreign.items())),
                ", ".join(cg.procs_files()),
            )
        self.log.warning(
            "cgroup of %s had leftover processes %s of %s (this account prefix's earlier hub); killing them",
            self._log_name,
            stale,
            self._account.name,
        )
        cg.kill_all()

    # -- processes: a server at its limit is refused more, and told so --------------------------
    def _check_process_limit(self, cg: ServerCgroup) -> bool:
        """Has the server reached its process limit (``pids.events`` max)? Logged once, and
        kept as a note that becomes the stop reason when the server stops."""
        user_hits = cg.user_pids_max_events() - self._user_pids_base
        hits = max(cg.pids_max_events() - self._pids_base, user_hits)
        if hits <= 0:
            return False
        if self._pids_note is None:
            when = time.strftime("%H:%M UTC", time.gmtime())
            # Whose limit refused it: the user group's where it counted the refusal (v2), or
            # where this group never reached its own limit (v1 counts every refusal here).
            peak, own = cg.pids_peak(), cg.pids_limit()
            by_user = user_hits > 0 or (cg.user_pids_limit() is not None and peak is not None and own is not None and peak < own)
            if by_user:
                limit = cg.user_pids_limit() or self.user_process_limit()
                self._pids_note = (
                    f"Your servers, jobs and Ray clusters together reached your limit of {limit} processes at "
                    f"{when} (threads count too), so the system refused to start more: programs may have failed "
                    "to start processes or threads. Stop some of them, or ask an administrator about the limit."
                )
            else:
                limit = cg.pids_limit() or self.process_limit()
                self._pids_note = (
                    f"Your server reached its limit of {limit} processes at {when} (threads count too), so the "
                    "system refused to start more: programs in it may have failed to start processes or threads. "
                    "Stop what keeps starting them, or choose a profile with a higher limit."
                )
            job = getattr(self, "job_id", None)  # a batch job's launcher (local/job_launcher.py)
            what = f"Job {job} of {self.user.name}" if job else f"Server {self._log_name}"
            whose = (
                f", with {self.user.name}'s other servers, jobs and Ray clusters, reached the user's limit"
                if by_user
                else " reached its limit"
            )
            self.log.warning(
                "%s%s of %s processes (pids.max; threads count too): %d new processes or threads refused so far",
                what,
                whose,
                limit,
                hits,
            )
        return True

    @property
    def process_limit_note(self) -> str | None:
        """Set once this server or job reached its process limit (for a job's own message)."""
        return self._pids_note

    def _note_stop_reason(self) -> None:
        if self._pids_note and not self.stop_reason:
            self.stop_reason = self._pids_note

    # -- memory: a server over its limit is stopped as a whole, and says why --------------------
    def _watch_oom(self, fd: int | None = None) -> None:
        """Watch the cgroup's OOM eventfd (v1) on the loop: ``fd`` if the launch made it, else made here."""
        cg = self._cgroup
        if cg is None or self._oom_fd is not None:
            if fd is not None:
                os.close(fd)
            return
        if fd is None:
            fd = cg.oom_eventfd()
        self.log.debug(
            "OOM watch for %s: eventfd %s (spawner %x, cgroup %s)", self._log_name, fd, id(self), cg.paths.get("memory")
        )
        if fd is None:
            return  # v2: memory.oom.group kills the whole group; the exit is noticed by pid
        self._oom_fd = fd

        def fired():
            try:
                os.read(fd, 8)
            except BlockingIOError:
                return
            self.log.debug("OOM event for %s (eventfd %s, %s kills)", self._log_name, fd, cg.oom_kills())
            try:
                self._check_oom(cg)
            except Exception:
                self.log.exception("Handling the memory limit of %s failed", self._log_name)

        try:
            asyncio.get_running_loop().add_reader(fd, fired)
        except RuntimeError:
            os.close(fd)
            self._oom_fd = None

    def _check_oom(self, cg: ServerCgroup) -> bool:
        """If the kernel killed anything of this server for memory: stop all of it, say why."""
        if cg.oom_kills() <= self._oom_base:
            return False
        first = not self.stop_reason
        self._record_oom(cg)
        if first:
            self.log.warning("%s went over its memory limit; stopping the whole server", self._log_name)
        cg.kill_all()
        return True

    def _unwatch_oom(self) -> None:
        if self._oom_fd is not None:
            self.log.debug("OOM unwatch for %s: eventfd %s (spawner %x)", self._log_name, self._oom_fd, id(self))
            try:
                asyncio.get_running_loop().remove_reader(self._oom_fd)
            except RuntimeError:
                pass
            os.close(self._oom_fd)
            self._oom_fd = None

    def _record_oom(self, cg: ServerCgroup) -> None:
        if self.stop_reason:
            return
        limit = cg.memory_limit() or self.mem_limit
        when = time.strftime("%H:%M UTC", time.gmtime())
        self.stop_reason = (
            f"Your server was stopped at {when} because it used more than its memory limit of "
            f"{_human_bytes(int(limit)) if limit else 'its profile'}. What it held in memory was lost; "
            "the files in your home are kept. Start it again, or choose a profile with more memory."
        )
        self.log.warning("%s: %s", self._log_name, self.stop_reason)

    def main_process_ended(self) -> bool:
        """Has the server's main process really ended? (waitpid for our child; after a hub
        restart, the pid gone, taken by another process, or a zombie.)"""
        if self.proc is not None:
            return self.proc.poll() is not None  # waitpid: the kernel's word (and reaps it)
        pid = self.pid
        if not pid:
            return True
        started = process_start_time(pid)
        if started is None or (self._start_time is not None and started != self._start_time):
            return True
        try:
            stat = open(f"/proc/{pid}/stat", "rb").read()
        except OSError:
            return True
        return stat[stat.rindex(b")") + 2 :].split()[0] in (b"Z", b"X")  # exited, not yet reaped

    def on_process_exit(self, sweep: bool = True) -> bool:
        """The server's main process exited: say why (memory, processes), sweep up the group
        (``sweep=False``: the caller sweeps it, off the loop, before anything is released).

        Acts only when the process has really ended: a watcher's wake-up is not proof, and a
        live server's cgroup is never killed here. False (nothing done) while it runs."""
        if not self.main_process_ended():
            self.log.warning("%s: exit watcher woke but pid %s is still running; leaving it alone", self._log_name, self.pid)
            return False
        cg = self._cgroup
        self._unwatch_oom()
        if cg is None:
            return True
        if cg.oom_kills() > self._oom_base:
            self._record_oom(cg)
        self._check_process_limit(cg)
        if sweep:
            _end_group(cg)  # nothing the user started may outlive the server (or keep a GPU open)
        return True

    async def end_after_exit(self) -> bool:
        """``on_process_exit`` for a process that exited on its own (the exit watcher, a job's
        end), with the group's sweep beside the loop: up to a second of kill rounds and
        retries per server, which an OOM storm or a crashing image would otherwise spend on
        the loop one server after the other. False (nothing done) while it runs."""
        cg = self._cgroup
        if not self.on_process_exit(sweep=False):
            return False
        if cg is not None:
            self._cgroup = None  # before the await: a poll or stop meanwhile does not sweep it again
            await asyncio.get_running_loop().run_in_executor(_pool("ends"), _end_group, cg)
        return True

    async def poll(self):
        status = await super().poll()
        if status is not None and self._cgroup is not None:
            if not await self.end_after_exit():
                self._cgroup = None  # found stopped: the poll lets go of the group all the same
        elif status is None and self._cgroup is not None:
            self._watch_oom()  # adopted after a restart: watch again
            if self._check_oom(self._cgroup):  # and a missed notification is caught here
                status = await super().poll()
            else:
                self._check_process_limit(self._cgroup)  # logged once; said when it stops
        if status is not None:
            self._note_stop_reason()
        return status

    async def stop(self, now=False):
        cg = self._cgroup
        try:
            await super().stop(now=now)
        finally:
            try:
                if cg is not None:
                    self._unwatch_oom()
                    self._check_process_limit(cg)
                    self._cgroup = None
                    await asyncio.get_running_loop().run_in_executor(_pool("ends"), _end_group, cg)
            finally:  # the port only once the group's processes are gone (or the stop was cancelled)
                self._remove_grants_tmp()
                self._give_back_port()
                self._note_stop_reason()

    # -- restarts: the hub's own record, and the process's identity ----------------------------
    def get_state(self):
        state = super().get_state()
        if self.pid:
            state["gpuhub_process"] = {
                "start_time": self._start_time,
                "uid": self._account.uid if self._account else os.geteuid(),
                "cgroup": self._cgroup.to_state() if self._cgroup else {},
                "oom_base": self._oom_base,
                "pids_base": self._pids_base,
                "user_pids_base": self._user_pids_base,
            }
        if self.stop_reason:
            state["gpuhub_stop_reason"] = self.stop_reason
        return state

    def load_state(self, state):
        super().load_state(state)
        state = state or {}
        self.stop_reason = state.get("gpuhub_stop_reason") or self.stop_reason
        record = state.get("gpuhub_process")
        if not self.pid:
            return
        if record is None:
            self.log.warning("%s: pid %s has no recorded start time (older gpuhub); adopting it", self._log_name, self.pid)
            self._start_time = process_start_time(self.pid)
            return
        now = process_start_time(self.pid)
        uid = process_uid(self.pid)
        if now != record.get("start_time") or uid != record.get("uid"):
            self.log.error(
                "%s: pid %s is not the server the hub started (start time %s, uid %s; recorded %s, %s); "
                "treating the server as gone",
                self._log_name,
                self.pid,
                now,
                uid,
                record.get("start_time"),
                record.get("uid"),
            )
            self.pid = 0
            return
        self._start_time = now
        if record.get("cgroup"):
            self._cgroup = ServerCgroup.from_state(self.cgroup_host, record["cgroup"])
            self._oom_base = int(record.get("oom_base", 0))
            self._pids_base = int(record.get("pids_base", 0))
            self._user_pids_base = int(record.get("user_pids_base", 0))
        if self.isolated:
            try:
                from .unix_users import lookup

                entry = lookup(self.account_name)
                if entry is not None:
                    self._account = Account(entry.pw_name, entry.pw_uid, entry.pw_gid, self.user.name)
            except Exception:  # pragma: no cover - informational only
                pass

    def clear_state(self):
        super().clear_state()
        self._start_time = None


def _port_span(text: str) -> range | None:
    """``"FIRST-LAST"`` as a range of ports; None for an empty or malformed text."""
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", text or "")
    if not m:
        return None
    first, last = int(m.group(1)), int(m.group(2))
    return range(first, last + 1) if 1024 <= first <= last <= 65535 else None


def remove_isolation(prefix: str, cgroup_root: str = "/sys/fs/cgroup", group: str = "gpuhub") -> list[str]:
    """Kill what runs in, and remove, the cgroups and accounts made with ``prefix`` (tests, uninstall)."""
    from .service import describe_holder, prefix_holder
    from .unix_users import remove_accounts

    holder = prefix_holder(prefix)
    if holder is not None:  # never a live hub's servers: stop that hub first
        raise RuntimeError(f"the account prefix {prefix!r} is held by a running hub ({describe_holder(holder)})")
    host = CgroupHost.detect(cgroup_root, group)
    bases = [host.root / group] if host.version == 2 else [m / group for m in host.v1_mounts.values()]
    leaves = sorted({d.name for b in bases if b.is_dir() for d in b.iterdir() if d.is_dir() and d.name.startswith(prefix)})
    for leaf in leaves:  # a user's group holds the user's servers' and jobs' groups: those first
        inner = sorted({d.name for b in bases if (b / leaf).is_dir() for d in (b / leaf).iterdir() if d.is_dir()})
        for name in inner:
            cg = host.server(name, user=leaf)
            cg.kill_all()
            cg.remove()
        cg = host.server(leaf)
        cg.kill_all()
        cg.remove()
    from .service import forget_prefix
    from .user_network import remove_walls

    remove_walls(prefix)  # the users' network namespaces and the hub's bridge
    forget_prefix(prefix)  # its lock file, unless a live hub still holds it
    return remove_accounts(prefix)
