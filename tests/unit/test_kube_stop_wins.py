"""A stop of a starting Kubernetes server is never lost on its way through asyncio (issue 40's
race; the whole hub on both control planes: tests/kube/test_stop_race.py).

JupyterHub stops a pending spawn by cancelling its spawn task. These check the two places in
``KueueSpawner`` where that cancellation used to be lost, on the functions themselves."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from gpuhub_spawner.kube.spawner import KueueSpawner


def running_spawner() -> SimpleNamespace:
    """What ``_running_now`` reads: the watch shows the pod running, the hooks are done."""
    pod = {"metadata": {"uid": "u1"}, "status": {"phase": "Running"}}
    return SimpleNamespace(
        _current_pod=lambda: pod,
        _hooks_done=True,
        is_pod_running=lambda p: True,
        _get_pod_url=lambda p: "http://10.0.0.7:8888",
        pod_id=None,
    )


async def test_the_starts_own_cancellation_is_not_taken_for_the_launch_waits():
    """``_running_now`` cancels KubeSpawner's wait for the running pod and waits for it to end.
    A stop of the start arriving in that moment must end the start, not be swallowed as that
    wait's CancelledError (with Python 3.12's wait_for the spawn then went on to "ready")."""
    launch_wait = asyncio.ensure_future(asyncio.sleep(3600))
    start = asyncio.ensure_future(KueueSpawner._running_now(running_spawner(), launch_wait))
    await asyncio.sleep(0)  # the start has cancelled the launch wait and waits for it to end
    assert launch_wait.cancelling() and not launch_wait.done()
    start.cancel()  # the hub stops the server in that instant
    with pytest.raises(asyncio.CancelledError):
        await start
    assert start.cancelled()


async def test_without_a_stop_the_start_returns_the_running_pods_url():
    launch_wait = asyncio.ensure_future(asyncio.sleep(3600))
    spawner = running_spawner()
    assert await KueueSpawner._running_now(spawner, launch_wait) == "http://10.0.0.7:8888"
    assert spawner.pod_id == "u1" and launch_wait.cancelled()


async def test_a_cancel_request_on_the_spawn_task_is_the_stop_intent_even_when_swallowed():
    """asyncio may lose a cancellation (3.11's wait_for returns a result that was already
    there), but the request stays on the task: ``start_polling``, called in the spawn task right
    after ``start()`` returned, ends the spawn as cancelled."""
    seen = {}

    async def spawn_task():
        await asyncio.sleep(0)  # cancelled here, and the cancellation swallowed, as wait_for does
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass
        spawner = SimpleNamespace(_spawn_task=asyncio.current_task(), _log_name="lena", log=SimpleNamespace(warning=print))
        spawner._stop_asked = lambda: KueueSpawner._stop_asked(spawner)
        seen["asked"] = spawner._stop_asked()
        KueueSpawner.start_polling(spawner)  # type: ignore[arg-type]
        seen["went on"] = True

    task = asyncio.ensure_future(spawn_task())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == {"asked": True} and task.cancelled()


async def test_no_stop_intent_without_a_cancel_request_or_after_the_spawn_ended():
    async def quiet():
        await asyncio.sleep(0)

    task = asyncio.ensure_future(quiet())
    spawner = SimpleNamespace(_spawn_task=task)
    assert KueueSpawner._stop_asked(spawner) is False  # type: ignore[arg-type]
    await task
    assert KueueSpawner._stop_asked(spawner) is False  # type: ignore[arg-type]
    assert KueueSpawner._stop_asked(SimpleNamespace(_spawn_task=None)) is False  # type: ignore[arg-type]
