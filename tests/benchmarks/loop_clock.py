"""How long each server start holds a hub's event loop: the time of its steps, not its waits.

Loaded into a hub under test by its configuration (``crowd.py storm`` does it)::

    import loop_clock; loop_clock.install("/tmp/starts.jsonl")

``Spawner.start()`` is a coroutine: the loop runs it in steps, from one ``await`` that
really waits (a thread's result, a pipe, a timer) to the next. Whatever a step does runs on
the loop and nobody else's request is served meanwhile; the waits cost the loop nothing.
This wraps ``start`` of the spawner classes named in ``TARGETS`` and adds up, per start,
the wall time of its steps (``loop_ms``: what the loop was held, including waits for the
interpreter lock and for a CPU on a loaded machine) and the main thread's CPU time in them
(``cpu_ms``: the work itself). Each finished start is one JSON line in the file.

Wrapping a class's own ``start`` only: ``IsolatedProcessSpawner.start`` (gpuhub's launch of
an isolated server, as root) and ``LocalProcessSpawner.start`` (the stock launch) are the
launches; ``QueuedGpuMixin.start`` is the whole of a gpuhub start (the queue's bookkeeping
and the launch), its record including the launch's.

Cost: two clock reads per step and one short append per start; nothing runs between starts.
"""

from __future__ import annotations

import functools
import importlib
import json
import time

TARGETS = (
    ("launch", "jupyterhub.spawner", "LocalProcessSpawner"),
    ("launch", "gpuhub_spawner.local.isolation", "IsolatedProcessSpawner"),
    ("start", "gpuhub_spawner.local.spawner", "QueuedGpuMixin"),
)


class Clocked:
    """Awaits ``coro`` step by step, adding up each step's wall and CPU time."""

    __slots__ = ("coro", "wall", "cpu", "steps", "longest")

    def __init__(self, coro):
        self.coro = coro
        self.wall = self.cpu = self.longest = 0.0
        self.steps = 0

    def _add(self, t0: float, c0: float) -> None:
        took = time.perf_counter() - t0
        self.wall += took
        self.cpu += time.thread_time() - c0
        self.steps += 1
        self.longest = max(self.longest, took)

    def __await__(self):
        value, exc = None, None
        while True:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                yielded = self.coro.throw(exc) if exc is not None else self.coro.send(value)
            except StopIteration as e:
                self._add(t0, c0)
                return e.value
            except BaseException:
                self._add(t0, c0)
                raise
            self._add(t0, c0)
            try:
                value, exc = (yield yielded), None
            except BaseException as e:  # a cancellation goes in where the coroutine waits
                value, exc = None, e


def _wrap(kind: str, cls, path: str):
    original = cls.__dict__["start"]

    @functools.wraps(original)
    async def start(self, *args, **kw):
        clock = Clocked(original(self, *args, **kw))
        outcome = "ok"
        try:
            return await clock
        except BaseException as e:
            outcome = type(e).__name__
            raise
        finally:
            row = {
                "kind": kind,
                "class": cls.__name__,
                "server": getattr(self, "_log_name", "?"),
                "loop_ms": round(clock.wall * 1000, 3),
                "cpu_ms": round(clock.cpu * 1000, 3),
                "steps": clock.steps,
                "longest_ms": round(clock.longest * 1000, 3),
                "outcome": outcome,
                "at": time.time(),
            }
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

    start.__loop_clock__ = True
    cls.start = start


def install(path: str) -> list[str]:
    """Wrap every ``TARGETS`` class that exists in this version; the names wrapped."""
    done = []
    for kind, module, name in TARGETS:
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        if "start" in cls.__dict__ and not getattr(cls.__dict__["start"], "__loop_clock__", False):
            _wrap(kind, cls, path)
            done.append(name)
    return done


def read(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
