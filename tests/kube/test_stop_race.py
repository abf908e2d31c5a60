"""A stop wins over a start that Kueue admits in the same instant (issue 40's fresh-clone run).

Seen once on the real control plane: bob's stop gave the waiting lena the L4 while her DELETE
was under way, and her server came up and stayed, holding the GPU. The cause, in the hub:
JupyterHub stops a pending spawn by cancelling its spawn task, waiting a second, then stopping
the server, which it refuses ("pending spawn", 500) while the spawn still runs; Python 3.11's
``asyncio.wait_for`` returns ``start()``'s result when that cancellation arrives after
``start()`` finished but before the spawn task resumed, so the spawn went on to "ready"
(``KueueSpawner._stop_asked``).

Here the interleaving is made, not waited for: the hub of this module holds lena's finished
start (Kueue admitted her, the pod runs) and lets it go from inside the hub's own DELETE
handler, at its "Interrupting spawner" log line, the instant before it cancels the spawn task,
so the cancellation always arrives in that window. Both control planes, one test body
(``backends.py``): the double in every run, the real Kueue v0.19.2 with ``GPUHUB_CLUSTER=1``,
the hub under the install guide's service account there.
"""

from __future__ import annotations

import calendar
import time

import pytest

from backends import backend_fixture, vision_servers_on_l4
from support.hub import Hub, waiter

pytestmark = pytest.mark.integration

POLICY = vision_servers_on_l4(virtual=1, gpus=1)

HELD = "RACE: holding the finished start of"

# The test's hold, in the hub's configuration (the product code is the same on both planes):
# lena's start() runs as always; its result is kept from the hub until the hub's DELETE
# handler logs "Interrupting spawner lena" (JupyterHub's users.py, the line right before it
# cancels the spawn task), and handed over from that log call, synchronously. Her server's
# first answer to the hub (User._wait_up) then waits until that DELETE has been answered: a
# server on a cluster takes longer than the handler's one second to start (kwok reports the
# pod ready at once, as a pod without a probe is), which a local process need not.
HOLD_CONFIG = f"""
import asyncio as _asyncio, logging as _logging
from gpuhub_spawner.kube.spawner import KueueSpawner as _KueueSpawner
from jupyterhub.user import User as _User

_held = {{}}
_answered = {{}}


class _ReleaseAtInterrupt(_logging.Handler):
    def emit(self, record):
        words = record.getMessage().split()
        if words[:2] == ["Interrupting", "spawner"] and words[2].rstrip(",") in _held:
            out, result = _held.pop(words[2].rstrip(","))
            if not out.done():
                out.set_result(result)
        if words[1:3] == ["DELETE", "/hub/api/users/lena/server"]:  # the access log: answered
            _answered.setdefault("lena", _asyncio.get_running_loop().create_future())
            _answered["lena"].done() or _answered["lena"].set_result(words[0])


_release = _ReleaseAtInterrupt(_logging.INFO)
_start, _wait_up = _KueueSpawner.start, _User._wait_up


async def _held_wait_up(self, spawner):
    if self.name == "lena":
        await _answered.setdefault("lena", _asyncio.get_running_loop().create_future())
    return await _wait_up(self, spawner)


_User._wait_up = _held_wait_up


def _held_start(self):
    log = _logging.getLogger("JupyterHub")  # its handlers are set up after this file is read
    if _release not in log.handlers:
        log.addHandler(_release)
    started = _start(self)
    if self.user.name != "lena":
        return started
    out = _asyncio.get_running_loop().create_future()

    def finished(t):
        if t.cancelled():
            out.cancel()
        elif t.exception() is not None:
            out.set_exception(t.exception())
        else:
            _held[self._log_name] = (out, t.result())
            self.log.warning("{HELD} %s until its stop", self._log_name)

    started.add_done_callback(finished)
    out.add_done_callback(lambda o: o.cancelled() and started.cancel())
    return out


_KueueSpawner.start = _held_start
"""

WAIT = 120


until = waiter(WAIT, interval=0.1)


backend = backend_fixture(POLICY)


@pytest.fixture(scope="module")
def hub(backend, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"stop-race-{backend.name}")
    h = Hub(
        work,
        POLICY,
        extra_config=backend.hub_config(HOLD_CONFIG),
        env={"KUBECONFIG": str(backend.kubeconfig)},
        slow_spawn_timeout=1,  # the queued POSTs answer 202 at once; nothing here tests that wait
    )
    try:
        h.start()
        yield h
    finally:
        h.stop()


def owned_by(backend, pod_name: str) -> list[dict]:
    return [w for w in backend.workloads() if w["metadata"]["ownerReferences"][0]["name"] == pod_name]


def creation_second(obj: dict) -> int:
    return calendar.timegm(time.strptime(obj["metadata"]["creationTimestamp"], "%Y-%m-%dT%H:%M:%SZ"))


def test_a_stop_in_the_instant_kueue_admits_the_server_wins(backend, hub):
    t0 = time.time()
    timeline: list[tuple[float, str]] = []

    def mark(what: str) -> None:
        timeline.append((time.time() - t0, what))

    alice, lena, dave = (hub.login(u) for u in ("alice", "lena", "dave"))
    assert alice.start("l4-1").status_code in (201, 202)
    alice.wait_ready(timeout=WAIT)
    lena.start_background("l4-1")
    lena_wl = until(lambda: next(iter(owned_by(backend, "jupyter-lena")), None), what="lena's Workload", hub=hub)
    # Kueue orders same-second Workloads by UID (N11): dave asks once lena's second is over.
    until(lambda: time.time() >= creation_second(lena_wl) + 1, what="the second after lena's Workload")
    dave.start_background("l4-1")
    until(lambda: owned_by(backend, "jupyter-dave"), what="dave's Workload", hub=hub)
    assert backend.pods("lena")[0]["spec"].get("schedulingGates"), "lena waits in the queue"

    # alice's stop frees the L4: Kueue admits lena, her pod runs, her start finishes and is held.
    assert alice.stop().status_code in (202, 204)
    mark("alice stopped: the L4 is free")
    until(lambda: HELD in hub.log.read_text(errors="replace"), what="lena admitted and her start finished", hub=hub)
    [pod] = backend.pods("lena")
    assert not pod["spec"].get("schedulingGates")
    mark(f"lena admitted by Kueue, her pod {pod['status'].get('phase')}, her start finished (held)")

    # Her stop arrives in that instant (the hold ends inside the DELETE handler).
    r = lena.stop()
    mark(f"lena's DELETE answered {r.status_code}")
    assert r.status_code in (202, 204), f"the stop was refused: {r.status_code} {r.text}\n{hub.tail(60)}"
    lena.wait_gone(timeout=WAIT)  # the hub shows it stopped
    mark("the hub shows lena's server stopped")
    until(lambda: not backend.pods("lena"), what="lena's pod gone", hub=hub)
    mark("lena's pod gone")
    until(lambda: not owned_by(backend, "jupyter-lena"), what="lena's Workload gone", hub=hub)
    mark("lena's Workload gone")
    assert "was asked to stop while its start finished; stopping it" in hub.log.read_text(errors="replace")

    # The GPU goes to the next in line, and lena's server does not come back.
    dave.wait_ready(timeout=WAIT)
    mark("dave ready on the freed L4")
    assert lena.server() is None and not backend.pods("lena")
    backend.healthy()
    for user in (alice, dave):
        user.stop()
    for user in (alice, dave):
        user.wait_gone()
    until(lambda: backend.pods() == [], what="no pods left", hub=hub)
    print(f"\n[timeline, {backend.name}]")
    for t, what in timeline:
        print(f"  {t:7.2f}s  {what}")
