"""Work a hub config schedules for after the hub has started.

``JupyterHub.start`` completes once running servers are re-registered and configured
roles are in the database; re-queueing journaled requests, following the policy's roles
and mirroring Kueue all need that. Config files run before it, so they schedule here.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

_tasks: set = set()  # the event loop keeps only weak references to tasks


async def started_hub():
    """The running JupyterHub once its start has completed; None outside a hub or if it failed to start."""
    from jupyterhub.app import JupyterHub

    if not JupyterHub.initialized():
        return None
    app = JupyterHub.instance()
    start = getattr(app, "_start_future", None)  # set before the config file is read
    if start is None:
        return None
    try:
        await start
    except Exception:  # noqa: BLE001 - the hub did not start; it says why
        return None
    return app


def when_started(work: Callable[[Any], object]) -> None:
    """Run ``work(app)`` once the hub has started (nothing when the config is read outside a running hub);
    ``app``: the JupyterHub application. What it returns is awaited if it is a coroutine, else ignored."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return  # config read outside a running hub (tools, tests of the config)

    async def run() -> None:
        app = await started_hub()
        if app is not None:
            result = work(app)
            if asyncio.iscoroutine(result):
                await result

    task = loop.create_task(run())
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
