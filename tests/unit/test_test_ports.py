"""The tests' own ports (tests/support/ports.py): each xdist worker draws from a block of its
own, below the kernel's ephemeral range, so no other worker's hub and no process binding port 0
(single-user servers, MLflow, Ray, Chromium) can take a port between its choice and its use."""

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
PROBE = (
    "import json, sys; sys.path.insert(0, sys.argv[1]); from support import ports; "
    "p = [ports.free_port() for _ in range(3)]; "
    "print(json.dumps([ports._BLOCK.start, ports._BLOCK.stop, p, ports._ephemeral_low()]))"
)


def _draw(worker: str, count: int):
    env = dict(os.environ, PYTEST_XDIST_WORKER=worker, PYTEST_XDIST_WORKER_COUNT=str(count))
    out = subprocess.run([sys.executable, "-c", PROBE, str(TESTS)], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_each_worker_draws_free_ports_from_its_own_block_below_the_ephemeral_range():
    blocks = []
    for i in range(4):
        start, stop, drawn, ephemeral = _draw(f"gw{i}", 4)
        assert stop - start >= 50, (start, stop)
        assert stop <= ephemeral, f"gw{i}'s block {start}-{stop} reaches the ephemeral range ({ephemeral})"
        assert all(start <= p < stop for p in drawn), (drawn, start, stop)
        assert len(set(drawn)) == 3, f"one process drew a port twice: {drawn}"
        blocks.append(range(start, stop))
    for a, b in zip(blocks, blocks[1:]):
        assert a.stop <= b.start, f"workers' blocks overlap: {a} {b}"


POD_PROBE = (
    "import json, sys, types; sys.path.insert(0, sys.argv[1]); from support import ports; "
    "before = ports.free_port(); config = ports.pod_port_hook(50); after = [ports.free_port() for _ in range(60)]; "
    "ns = {}; exec(config, ns); pods = []\n"
    "for _ in range(3):\n"
    "    sp = types.SimpleNamespace(port=0); ns['_own_port'](sp); pods.append(sp.port)\n"
    "print(json.dumps([pods, after, ports._BLOCK.start, ports._BLOCK.stop]))"
)


def test_a_hub_gives_the_doubles_pods_ports_no_test_process_hands_out():
    """The Kubernetes double's pods share this machine's network, one port each: the hub's
    ``pre_spawn_hook`` draws them from ports reserved in the worker's block, which the
    worker's own ``free_port`` then never hands out (in the ephemeral range a port the kernel
    picked could be taken before the pod listened)."""
    env = dict(os.environ, PYTEST_XDIST_WORKER="gw1", PYTEST_XDIST_WORKER_COUNT="4")
    out = subprocess.run(
        [sys.executable, "-c", POD_PROBE, str(TESTS)], env=env, capture_output=True, text=True, check=True
    ).stdout
    pods, after, start, stop = json.loads(out)
    assert len(set(pods)) == 3 and all(start <= p < stop for p in pods), (pods, start, stop)
    assert not set(pods) & set(after), f"a pod's port was handed out to the tests too: {set(pods) & set(after)}"
