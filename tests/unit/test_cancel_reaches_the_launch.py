"""A user who leaves while their server is being launched stops the launch, whatever step it
is at (local/sandbox.py, local/listening.py, local/spawner.py).

Python 3.11's ``asyncio.wait_for`` runs what it waits for as a task of its own and, when a
cancel finds that task already done, returns its result instead of raising: the cancel is
lost. In a storm (2026-12-02, test_crowd) users who left the queue just as they were admitted
got a 500 "pending spawn" from JupyterHub's DELETE, and their servers started anyway: the
cancel came while the launcher's spec was being written, the write finished in the same
turn of the loop, and the start went on to wait for the server to listen. Each test here
cancels at the moment the awaited step completes; each fails with wait_for.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from gpuhub_spawner.local.listening import ListenWatcher
from gpuhub_spawner.local.sandbox import hand_over


class Launcher:
    pid = 0

    def kill(self):
        raise AssertionError("not killed: it read its spec")


def test_a_cancel_that_comes_as_the_spec_is_written_is_not_lost():
    async def main():
        r, w = os.pipe()
        try:

            async def launch():
                await hand_over(Launcher(), w, b"{}" * 100)  # done at once: the pipe has room
                await asyncio.sleep(3600)  # then the start waits for its server to listen

            start = asyncio.ensure_future(launch())
            await asyncio.sleep(0)  # the start writes its spec ...
            start.cancel()  # ... and the user leaves in that same turn of the loop
            await asyncio.wait({start}, timeout=2)
            assert start.cancelled(), "the start went on after the user left"
            assert os.read(r, 1000) == b"{}" * 100  # the spec was written, the pipe closed
        finally:
            os.close(r)

    asyncio.run(main())


def test_a_cancel_that_comes_as_the_server_listens_is_not_lost():
    async def main():
        watcher = ListenWatcher(tick=3600)  # one look at the kernel (port 1: nobody), then the test says
        start = asyncio.ensure_future(watcher.wait(port=1, pid=os.getpid(), timeout=60))
        await asyncio.sleep(0)
        (waiter,) = watcher.waiters
        waiter.future.set_result("listening")  # the server listens ...
        start.cancel()  # ... as the user leaves
        with pytest.raises(asyncio.CancelledError):
            await start
        assert watcher.waiters == []
        watcher._task.cancel()

    asyncio.run(main())


def test_a_launch_that_outlives_its_time_still_times_out():
    async def main():
        r, w = os.pipe()
        os.set_blocking(w, False)
        while True:  # fill the pipe: the launcher never reads
            try:
                os.write(w, b"x" * 65536)
            except BlockingIOError:
                break

        class Stuck(Launcher):
            killed = False

            def kill(self):
                self.killed = True

        proc = Stuck()
        try:
            with pytest.raises(RuntimeError, match="did not read its spec in 0 s"):
                await hand_over(proc, w, b"spec", timeout=0.2)
            assert proc.killed
        finally:
            os.close(r)

    asyncio.run(main())
