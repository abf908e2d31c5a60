"""Ports for the tests' own listeners, each xdist worker from a block of its own below the
kernel's ephemeral range.

A port found free by binding port 0 and closing the socket stays free only until someone else
binds it, and everything else on the machine that binds port 0 draws from that same range:
single-user servers (JupyterHub's ``random_port``), MLflow's workers, Ray, Chromium, another
worker's hubs. CI's run of stop 37 lost a module that way: a hub's public port was taken in
that gap, the proxy could not listen there, and the test's login reached whatever held the port
(404). Below the range (``net.ipv4.ip_local_port_range``, 32768-60999 by default) nothing draws
a port by chance, so a port from this worker's own block stays free until the test's process
binds it. Each block starts at a random offset (two test runs on one machine rarely meet) and
every port is checked by binding it before it is handed out.
"""

from __future__ import annotations

import os
import random
import socket

from gpuhub_spawner.local.listening import port_is_free

LOWEST = 20000  # below: Ray's worker ports (10002-19999) and the well-known services
HIGHEST = 32000  # above: tests/cluster/up.sh's control plane (from 32300), then the ephemeral range


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _block() -> range:
    """This process's block: its xdist worker's share of LOWEST..ephemeral range (all of it
    outside xdist); empty where the ephemeral range starts too low to leave one."""
    high = min(_ephemeral_low(), HIGHEST)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw3"
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    size = (high - LOWEST) // max(count, 1)
    if size < 50 or index >= count:
        return range(0)
    start = LOWEST + index * size
    return range(start, start + size)


_BLOCK = _block()
_next = random.randrange(len(_BLOCK)) if _BLOCK else 0


def free_port() -> int:
    """A TCP port nothing listens on, from this worker's block (the kernel's choice where the
    machine leaves no room below its ephemeral range)."""
    global _next
    for _ in range(len(_BLOCK)):
        port = _BLOCK[_next % len(_BLOCK)]
        _next += 1
        if port_is_free(port):
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reserve(count: int) -> range:
    """``count`` consecutive ports of this worker's block that ``free_port`` will not hand out
    again (until it has gone round the whole block), for a process of the test's that draws
    ports of its own, such as a hub giving each pod of the Kubernetes double a port. Empty
    where the block is too small to spare them."""
    global _next
    if len(_BLOCK) < 4 * count:
        return range(0)
    i = _next % len(_BLOCK)
    if i + count > len(_BLOCK):
        i = 0
    _next = i + count
    return _BLOCK[i : i + count]


def pod_port_hook(count: int = 200) -> str:
    """Hub config defining ``_own_port``, a ``pre_spawn_hook`` that gives each server (a pod of
    the Kubernetes double, whose pods share this machine's network) a port of its own from
    ports reserved here, bind-checked, rather than one the kernel picked for a socket it then
    closed (the ephemeral range, where anything binding port 0 may take it before the pod
    listens)."""
    ports = reserve(count)
    return f"""
import socket as _socket


def _own_port(spawner, _ports=range({ports.start}, {ports.stop}), _drawn=[0]):
    from gpuhub_spawner.local.listening import port_is_free

    for _ in range(len(_ports)):
        port = _ports[_drawn[0] % len(_ports)]
        _drawn[0] += 1
        if port_is_free(port):
            spawner.port = port
            return
    with _socket.socket() as s:  # no reserved port free: the kernel's choice
        s.bind(("127.0.0.1", 0))
        spawner.port = s.getsockname()[1]
"""
