"""The wall around each user: every user's processes in a network namespace of their own.

Any program a user starts (a server, a kernel, a job, Ray's head, workers and agents, a
TensorBoard) opens ports, and on a shared machine every port on loopback or on the machine's
addresses answers every other user: Ray 2.52's dashboard agent on its default port 52365 has
no token check and runs a shell entrypoint as the cluster's owner for whoever asks. Checking
each engine's ports one by one cannot keep up; the kernel can. So each user (Unix account)
gets one network namespace, shared by all of that user's servers, jobs and Ray clusters:

- **Inside**, the user's own loopback and one interface ``eth0`` with the user's address
  (``10.213.0.0/16`` by default, ``user_network``); the user's processes reach each other on
  ``127.0.0.1`` (a server and its Ray cluster) and nothing of any other user's.
- **Between**, one Linux bridge per hub (``gh<hash>``) holding the hub's address (the
  network's first, ``10.213.0.1``) with every user's veth pair as an *isolated* port: the
  bridge forwards between an isolated port and the hub only, never between two users' ports
  (``ip link set ... type bridge_slave isolated on``; also ARP and broadcasts). IPv6 is off
  on both ends (no link-local path either).
- **Beyond**, the network outside the machine as before the wall: the bridge (only it)
  forwards, and an nftables table of the hub's (``inet gpuhub_<bridge>``) masquerades the
  users' addresses as the machine's and routes nothing *to* a user's address but the answers
  to that user's own connections: not from outside, not from another user through the hub's
  side, not from another hub's users. Without ``nft`` the wall stands and users reach only
  this machine (said at start).
- **The hub's side** reaches each user's address: the hub (its API listens on the bridge's
  address), the proxy (routes to ``<user address>:<port>``) and the hub's services (MLflow)
  answer the users there. What listens on the host's loopback is unreachable from inside;
  what listens on the host's wildcard address is reachable as before.

Abstract Unix sockets are per namespace too, so they are walled off the same way. Users
cannot leave their namespace or change its routes or neighbours: that needs
``CAP_NET_ADMIN``/``CAP_SYS_ADMIN``, and their processes run with ``no_new_privs`` as
unprivileged accounts. Each namespace is named after the account (``/run/netns/<account>``)
and outlives a hub restart (servers keep running in it); ``remove`` ends it (a leaver, the
tests' cleanup). Everything here runs as root (the hub) with iproute2's ``ip``.
"""

from __future__ import annotations

import ctypes
import hashlib
import ipaddress
import json
import logging
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("JupyterHub.gpuhub.network")

DEFAULT_NETWORK = "10.213.0.0/16"
NETNS_DIR = Path("/run/netns")
REGISTRY = Path("/run/gpuhub/net")  # one folder per bridge: <account> -> the user's address
WALL_FILE = ".wall"  # in each folder: its account prefix and network (to remove it by prefix)
CLONE_NEWNET = 0x40000000
IP = "/usr/sbin/ip" if os.path.exists("/usr/sbin/ip") else "ip"

_libc = ctypes.CDLL(None, use_errno=True)


class WallError(RuntimeError):
    """The wall could not be built (no iproute2, no bridge support, a clash of addresses)."""


def _run(args: list[str], stdin: str | None = None, check: bool = True) -> str:
    try:
        out = subprocess.run(
            args,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=30,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
        )
    except FileNotFoundError:
        raise WallError(f"{args[0]} not found: install iproute2 (the wall needs `ip`)") from None
    if out.returncode != 0 and check:
        raise WallError(f"`{' '.join(args)}` failed: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout


def _sysctl(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def network_from_env() -> str:
    return os.environ.get("GPUHUB_USER_NETWORK", "") or DEFAULT_NETWORK


@dataclass(frozen=True)
class UserNet:
    """One user's side of the wall."""

    netns: str  # its name under /run/netns (the account's name)
    address: str  # where the hub's side reaches the user's processes
    gateway: str  # the hub's address, as the user's processes reach it
    resolv_conf: str | None = None  # a resolver file for the user's sandbox (resolver_for_users)

    @property
    def path(self) -> str:
        return str(NETNS_DIR / self.netns)


class Wall:
    """The bridge of one hub (one account prefix) and its users' namespaces."""

    _instances: dict[tuple[str, str], "Wall"] = {}

    def __init__(self, network: str, prefix: str):
        try:
            self.network = ipaddress.ip_network(network)
        except ValueError as e:
            raise WallError(f"user_network {network!r} is not a network (CIDR): {e}") from None
        if self.network.version != 4 or self.network.prefixlen > 29:
            raise WallError(f"user_network {network!r} must be an IPv4 network of at least 8 addresses (/29 or larger)")
        self.prefix = prefix
        digest = hashlib.sha256(f"{prefix}|{self.network}".encode()).hexdigest()
        self.bridge = "gh" + digest[:10]  # interface names: 15 characters at most
        self.gateway = str(self.network.network_address + 1)
        self.registry = REGISTRY / self.bridge
        self._lock = threading.Lock()  # the registry (addresses), the bridge
        self._user_locks: dict[str, threading.Lock] = {}  # one user's set-up at a time
        self._ready: dict[str, UserNet] = {}
        self._bridge_up = False
        self.outside: str | None = "not set up yet"  # why users cannot reach beyond the machine; None: they can

    @classmethod
    def of(cls, network: str, prefix: str) -> "Wall":
        key = (network, prefix)
        if key not in cls._instances:
            cls._instances[key] = cls(network, prefix)
        return cls._instances[key]

    # -- the hub's side ---------------------------------------------------------------------
    def ensure_bridge(self) -> None:
        """The bridge with the hub's address, forwarding and IPv6 off (idempotent)."""
        if self._bridge_up and Path(f"/sys/class/net/{self.bridge}").exists():
            return
        with self._lock:
            self._clash_check()
            if not Path(f"/sys/class/net/{self.bridge}").exists():
                _run([IP, "link", "add", self.bridge, "type", "bridge"])
            v6 = f"/proc/sys/net/ipv6/conf/{self.bridge}/disable_ipv6"
            if os.path.exists(v6):
                _sysctl(v6, "1")
            _sysctl(f"/proc/sys/net/ipv4/conf/{self.bridge}/forwarding", "0")  # until the rules below hold
            _run(
                [IP, "-batch", "-"],
                stdin=(f"addr replace {self.gateway}/{self.network.prefixlen} dev {self.bridge}\nlink set {self.bridge} up\n"),
            )
            # recorded before forwarding is turned on: another hub's last wall going away
            # meanwhile then sees this one and leaves forwarding on
            self.registry.mkdir(parents=True, exist_ok=True, mode=0o700)
            (self.registry / WALL_FILE).write_text(json.dumps({"prefix": self.prefix, "network": str(self.network)}))
            self.outside = self._let_users_out()
            self._bridge_up = True

    @property
    def table(self) -> str:
        return f"gpuhub_{self.bridge}"

    def _table_holds(self) -> bool:
        out = subprocess.run(
            ["nft", "list", "table", "inet", self.table], capture_output=True, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
        )
        return out.returncode == 0

    def _let_users_out(self) -> str | None:
        """Users reach the network beyond this machine (package indexes, datasets, DNS) as
        before the wall: the bridge forwards, nftables masquerades their addresses as the
        machine's, and routes nothing *to* a user's address (from outside, from another user
        through the hub's side, from another hub's users) but the answers to their own
        connections. None when that holds; else why not (the wall still stands; users then
        reach only this machine)."""
        if shutil.which("nft", path="/usr/sbin:/usr/bin:/sbin:/bin") is None:
            return "no `nft` (install nftables)"
        rules = (
            f"table inet {self.table}\n"
            f"delete table inet {self.table}\n"
            f"table inet {self.table} {{\n"
            "  chain forward {\n"
            "    type filter hook forward priority filter; policy accept;\n"
            f'    oifname "{self.bridge}" ct state established,related accept\n'
            f'    oifname "{self.bridge}" drop\n'
            f'    iifname "{self.bridge}" oifname "gh*" drop\n'
            "  }\n"
            "  chain postrouting {\n"
            "    type nat hook postrouting priority srcnat; policy accept;\n"
            # Not on loopback: the hub's side answers on the bridge's address, so the proxy's
            # and the hub's own connections to it (this machine to itself, out through `lo`)
            # start from a user-network address too. Masqueraded as 127.0.0.1, each of them
            # depended on this table: when an admin's firewall reload flushed it, the kernel
            # stopped translating them and the hub reset the proxy's kept-alive connection
            # (a 503 for the next person through the proxy).
            f'    ip saddr {self.network} oifname != {{ "{self.bridge}", "lo" }} masquerade\n'
            "  }\n"
            "  chain input {\n"
            "    type filter hook input priority filter; policy accept;\n"
            # the hub's side (its API, MLflow) answers this machine and this hub's users only:
            # Linux answers for a local address on any interface (the LAN, another hub's users)
            f'    ip daddr {self.gateway} iifname != {{ "lo", "{self.bridge}" }} drop\n'
            "  }\n"
            "}\n"
        )
        try:
            _run(["nft", "-f", "-"], stdin=rules)
            _machine_forwards()
        except WallError as e:
            return str(e)
        _sysctl(f"/proc/sys/net/ipv4/conf/{self.bridge}/forwarding", "1")
        return None

    def _clash_check(self) -> None:
        """Refuse a network that an interface other than this bridge already uses."""
        try:
            addrs = json.loads(_run([IP, "-j", "-4", "addr", "show"]) or "[]")
        except json.JSONDecodeError:
            return
        for link in addrs:
            if link.get("ifname") == self.bridge:
                continue
            for a in link.get("addr_info", []):
                try:
                    theirs = ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False)
                except (KeyError, ValueError):
                    continue
                if theirs.overlaps(self.network):
                    raise WallError(
                        f"user_network {self.network} overlaps {theirs} on interface {link.get('ifname')}: "
                        "choose another network for the users (LocalGpuSpawner.user_network or $GPUHUB_USER_NETWORK)"
                    )

    # -- a user's side ----------------------------------------------------------------------
    def _veth(self, account: str) -> str:
        return "gv" + hashlib.sha256(f"{self.prefix}|{account}".encode()).hexdigest()[:11]

    def _address_for(self, account: str) -> str:
        """The user's address: kept in the registry, else the lowest free one."""
        rec = self.registry / account
        try:
            return rec.read_text().strip()
        except FileNotFoundError:
            pass
        used = set()
        for f in self.registry.iterdir():
            try:
                used.add(f.read_text().strip())
            except OSError:
                continue
        for host in self.network.hosts():
            a = str(host)
            if a != self.gateway and a not in used:
                tmp = rec.with_name(f".{account}.new")
                tmp.write_text(a)
                tmp.rename(rec)
                return a
        raise WallError(f"user_network {self.network} has no address left for {account}: choose a larger network")

    def ensure_user(self, account: str) -> UserNet:
        """``account``'s namespace, interface, address and route (idempotent; in a thread).

        Two runs of ``ip`` for a new user (the hub's side, then the namespace's), none for one
        whose namespace is up. Users are set up in parallel (only the choice of an address and
        one user's own set-up are serialised): in a 200-user storm on 2 cores each run of a
        program waited ~1 s for a CPU, and seven of them per user, one user after the other,
        made the last server ready after 266 s instead of 28 s (tests/benchmarks/crowd.py)."""
        known = self._ready.get(account)
        veth = self._veth(account)
        if known is not None and Path(known.path).exists() and Path(f"/sys/class/net/{veth}").exists():
            return known
        self.ensure_bridge()
        with self._lock:
            address = self._address_for(account)
            mine = self._user_locks.setdefault(account, threading.Lock())
            if self.outside is None and not self._table_holds():
                # someone flushed the ruleset (Debian's nftables.conf starts with `flush ruleset`):
                # with forwarding on, the wall would stand at layer 2 only. Put it back.
                log.warning("the nftables table %s of the wall was gone; putting it back", self.table)
                self.outside = self._let_users_out()
                if self.outside is not None:
                    _sysctl(f"/proc/sys/net/ipv4/conf/{self.bridge}/forwarding", "0")
        with mine:
            ns = account
            path = NETNS_DIR / ns
            if not Path(f"/sys/class/net/{veth}").exists():
                host = []
                if not path.exists():
                    host.append(f"netns add {ns}")
                else:  # a namespace whose pair is gone (removed by hand): its end may linger inside
                    _run([IP, "-force", "-n", ns, "-batch", "-"], stdin="link del eth0\n", check=False)
                host += [
                    f"link add {veth} type veth peer name eth0 netns {ns}",
                    f"link set {veth} addrgenmode none",
                    f"link set {veth} master {self.bridge}",
                    f"link set dev {veth} type bridge_slave isolated on",  # no path to another user's port
                    f"link set {veth} up",
                ]
                try:
                    _run([IP, "-batch", "-"], stdin="\n".join(host) + "\n")
                    _run(
                        [IP, "-n", ns, "-batch", "-"],
                        stdin=(
                            "link set eth0 addrgenmode none\n"
                            f"addr replace {address}/{self.network.prefixlen} dev eth0\n"
                            "link set lo up\n"
                            "link set eth0 up\n"
                            f"route replace default via {self.gateway} dev eth0\n"
                        ),
                    )
                except WallError:  # half made (not isolated, no address): never left to look ready
                    _run([IP, "link", "del", veth], check=False)
                    raise
            elif not path.exists():
                raise WallError(f"{veth} exists but the namespace {path} does not: remove {veth} (ip link del {veth})")
            net = UserNet(ns, address, self.gateway, resolver_for_users())
            self._ready[account] = net
            return net

    def remove(self, account: str) -> None:
        """End ``account``'s namespace and its pair (processes still in it lose their network)."""
        with self._lock, self._user_locks.setdefault(account, threading.Lock()):
            self._ready.pop(account, None)
            veth = self._veth(account)
            if Path(f"/sys/class/net/{veth}").exists():
                _run([IP, "link", "del", veth])
            if (NETNS_DIR / account).exists():
                _run([IP, "netns", "del", account])
            try:
                (self.registry / account).unlink()
            except FileNotFoundError:
                pass

    def accounts(self) -> list[str]:
        """The accounts that have a namespace of this wall."""
        try:
            return sorted(f.name for f in self.registry.iterdir() if not f.name.startswith("."))
        except FileNotFoundError:
            return []

    def remove_all(self) -> None:
        """Every user's namespace and the bridge (uninstall, the tests' cleanup)."""
        for account in self.accounts():
            self.remove(account)
        with self._lock:
            if Path(f"/sys/class/net/{self.bridge}").exists():
                _run([IP, "link", "del", self.bridge])
            if shutil.which("nft", path="/usr/sbin:/usr/bin:/sbin:/bin"):
                _run(["nft", "delete", "table", "inet", self.table], check=False)
            try:
                (self.registry / WALL_FILE).unlink(missing_ok=True)
                self.registry.rmdir()
            except OSError:
                pass
            self._bridge_up = False
            _machine_forwarding_back()


FORWARDING_MARK = REGISTRY / ".forwarding-turned-on"  # gpuhub turned the machine's forwarding on
FORWARDING_TABLE = "gpuhub_forwarding"


def _machine_forwards() -> None:
    """IPv4 forwarding on, which the answers to users' outbound connections need (Linux decides
    by the interface a packet comes in on: the machine's uplink). Where it was off, gpuhub
    turns it on with a table of its own that forwards nothing but to and from its bridges, so
    the machine does not become a router for anyone else; the last wall removed turns it off
    again. Where it was on already (Docker, a router), it is left as it was."""
    fwd = Path("/proc/sys/net/ipv4/ip_forward")
    if fwd.read_text().strip() == "1" and not FORWARDING_MARK.exists():
        return
    _run(
        ["nft", "-f", "-"],
        stdin=(
            f"table inet {FORWARDING_TABLE}\n"
            f"delete table inet {FORWARDING_TABLE}\n"
            f"table inet {FORWARDING_TABLE} {{\n"
            "  chain forward {\n"
            "    type filter hook forward priority filter; policy accept;\n"
            '    iifname != "gh*" oifname != "gh*" drop\n'
            "  }\n"
            "}\n"
        ),
    )
    FORWARDING_MARK.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    FORWARDING_MARK.touch()
    if fwd.read_text().strip() != "1":
        _sysctl(str(fwd), "1")


def _machine_forwarding_back() -> None:
    """The last wall is gone: forwarding as it was before gpuhub turned it on."""
    if not FORWARDING_MARK.exists():
        return
    try:
        if any((d / WALL_FILE).is_file() for d in REGISTRY.iterdir()):
            return  # another hub's wall still needs it
    except FileNotFoundError:
        pass
    _sysctl("/proc/sys/net/ipv4/ip_forward", "0")
    _run(["nft", "delete", "table", "inet", FORWARDING_TABLE], check=False)
    FORWARDING_MARK.unlink(missing_ok=True)


def remove_walls(prefix: str) -> list[str]:
    """Remove every wall (bridge, users' namespaces) made for account ``prefix``; their bridges."""
    removed: list[str] = []
    try:
        folders = [d for d in REGISTRY.iterdir() if (d / WALL_FILE).is_file()]
    except FileNotFoundError:
        return removed
    for d in folders:
        try:
            info = json.loads((d / WALL_FILE).read_text())
        except (OSError, ValueError):
            continue
        if info.get("prefix") != prefix:
            continue
        wall = Wall.of(info["network"], prefix)
        wall.remove_all()
        Wall._instances.pop((info["network"], prefix), None)
        removed.append(wall.bridge)
    return removed


def available() -> str | None:
    """Why the wall cannot be built here, or None when it can (root, iproute2, /run)."""
    if os.geteuid() != 0:
        return "the hub is not root"
    if (
        not (os.path.isabs(IP) and os.access(IP, os.X_OK))
        and subprocess.run(["sh", "-c", f"command -v {IP}"], capture_output=True).returncode != 0
    ):
        return f"no `{IP}` (install iproute2)"
    return None


def resolver_for_users(resolv_conf: str = "/etc/resolv.conf", upstream: str = "/run/systemd/resolve/resolv.conf") -> str | None:
    """The resolver file users behind the wall should see, where the machine's own is of no
    use to them: a loopback resolver (systemd-resolved's 127.0.0.53) is the machine's, not
    theirs. Then systemd-resolved's list of the real upstream servers, bound over
    ``/etc/resolv.conf`` in their sandbox. None: the machine's own file works as it is."""

    def servers(path):
        try:
            return [ln.split()[1] for ln in open(path) if ln.strip().startswith("nameserver") and len(ln.split()) > 1]
        except OSError:
            return []

    def loopback(a):
        try:
            return ipaddress.ip_address(a.split("%")[0]).is_loopback
        except ValueError:
            return False

    mine = servers(resolv_conf)
    if not mine or not all(loopback(a) for a in mine):
        return None
    theirs = servers(upstream)
    return upstream if theirs and not all(loopback(a) for a in theirs) else None


# -- looking inside a user's namespace (the hub's listen watcher) -----------------------------
def socket_in(netns_path: str, family: int, kind: int, proto: int = 0):
    """A socket created inside the namespace at ``netns_path`` (this thread switches in and
    back around the one call; sockets keep the namespace they were made in)."""
    import socket

    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    target = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns {netns_path}: {os.strerror(err)}")
        try:
            return socket.socket(family, kind, proto)
        finally:
            if _libc.setns(own, CLONE_NEWNET) != 0:  # never leave the hub's thread elsewhere
                log.critical("cannot return to the hub's network namespace: %s", os.strerror(ctypes.get_errno()))
                os.abort()  # pragma: no cover - the kernel refused to put us back: nothing sane remains
    finally:
        os.close(own)
        os.close(target)


# -- the hub's configuration (wiring.config.configure_local) ----------------------------------
def _setting(c, name: str, default: str) -> str:
    for section in ("LocalGpuSpawner", "IsolatedProcessSpawner"):
        if section in c and name in c[section]:
            return str(c[section][name])
    return default


def configure_wall(c, isolated: bool, stream=None) -> str | None:
    """Build the hub's side of the wall at start, when servers run isolated: the bridge and
    its address, which the hub's API and services then listen on. Returns that address, or
    None when there is no wall (said loudly; ``network_wall = "on"`` refuses to start).

    What it decides is written back to the spawners' configuration (``network_wall`` "on"
    or "off", ``user_network``), so the hub and every server and job launcher agree."""
    import sys

    mode = _setting(c, "network_wall", "auto").lower()
    network = _setting(c, "user_network", "") or network_from_env()
    prefix = _setting(c, "account_prefix", "") or os.environ.get("GPUHUB_ACCOUNT_PREFIX", "gpuhub-")
    out = stream or sys.stderr
    if mode == "off" or not isolated:
        why = "network_wall is off" if mode == "off" else "servers are not isolated"
        if mode == "on":
            raise SystemExit(f"gpuhub: network_wall = 'on' but {why}")
        for section in ("LocalGpuSpawner", "IsolatedProcessSpawner"):
            c[section].network_wall = "off"
        if isolated:
            msg = (
                "gpuhub: NO WALL between users' network ports (network_wall = 'off'): every port a user's "
                "programs open (kernels, Ray, TensorBoard) answers every other user"
            )
            print(msg, file=out, flush=True)
            log.warning(msg)
        return None
    problem = available()
    wall = None
    if problem is None:
        try:
            wall = Wall.of(network, prefix)
            wall.ensure_bridge()
        except WallError as e:
            problem = str(e)
    if problem is not None:
        if mode == "on":
            raise SystemExit(f"gpuhub: network_wall = 'on' but the wall cannot be built: {problem}")
        for section in ("LocalGpuSpawner", "IsolatedProcessSpawner"):
            c[section].network_wall = "off"
        msg = (
            "\n" + "!" * 78 + f"\ngpuhub: NO WALL between users' network ports ({problem}): every port a user's\n"
            "  programs open (kernels, Ray, TensorBoard) answers every other user on this machine.\n" + "!" * 78
        )
        print(msg, file=out, flush=True)
        log.warning(msg)
        return None
    assert wall is not None  # built, as there was no problem
    for section in ("LocalGpuSpawner", "IsolatedProcessSpawner"):
        c[section].network_wall = "on"
        c[section].user_network = str(wall.network)
    msg = (
        f"gpuhub: a wall around each user: every user's servers, jobs and Ray clusters in a network "
        f"namespace of their own, on bridge {wall.bridge} ({wall.network}); the hub answers them at {wall.gateway}"
    )
    print(msg, file=out, flush=True)
    log.info(msg)
    if wall.outside is not None:
        msg = (
            f"gpuhub: users' servers and jobs reach only this machine, not the network beyond it "
            f"({wall.outside}): no package index, no dataset download, no DNS server elsewhere"
        )
        print(msg, file=out, flush=True)
        log.warning(msg)
    return wall.gateway
