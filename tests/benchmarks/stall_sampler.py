"""Where a hub's event loop stalls: a sampling profiler of its main thread's busy runs.

Loaded into a hub under test by its configuration (``reload_stall.py --stacks FILE``)::

    import stall_sampler; stall_sampler.install("/tmp/stalls.txt")

A daemon thread looks at the main thread (where JupyterHub runs its asyncio loop) every
``every`` seconds. The loop is idle while the main thread waits in the selector (``select``,
``poll``, ``epoll``); any other stack is work on the loop. Consecutive busy looks form a run;
a run longer than ``threshold`` is a stall a request would feel, and each of its looks is
counted against the stack it saw. Every ``flush`` seconds the file is rewritten with the
stalls seen so far and the stacks that took most of their time (innermost frames first,
gpuhub's and JupyterHub's frames marked), so a benchmark reads it after the hub stopped
however the hub ended.

Two stalls a look at the main thread cannot see are recorded apart:

- *the interpreter lock held by another thread* (C code in a worker: pydantic-core's
  validation, libyaml, ``json.loads``): the main thread then still shows the selector (it
  waits for the lock to return from it), and the sampler itself cannot run either. A look
  that comes ``threshold`` later than asked is such a stall; the stacks of the other busy
  threads at that moment (the C call's Python caller, just returned) are counted for it.
- *the cyclic garbage collector* (``gc.callbacks``): each collection of ``threshold / 5`` or
  more, with its generation, the objects it freed and the thread it ran in.

A look needs the GIL: C code that holds it (libyaml, pydantic-core) is seen at the Python
frame that called it, once it returns. Looks are as good as the 5 ms switch interval allows.

For diagnosis only, not for the figures: the sampler costs the hub CPU, and once (Python 3.11,
at load 6) the hub under it died silently right after the sampler read a frame of another
thread that was being freed (``'dict' object has no attribute 'f_lineno'``).
"""

from __future__ import annotations

import collections
import gc
import linecache
import sys
import threading
import time
import traceback

_IDLE_NAMES = {
    "select",
    "poll",
    "wait",
    "_wait_for_tstate_lock",
    "sleep",
    "get",
    "_worker",
    "accept",
    "readinto",
    "recv",
    "recv_into",
    "read",
    "_run_safe_shutdown_loop",
    "_do_waitpid",
}


def _is_idle(frame) -> bool:
    """Whether the main thread sits in the event loop's wait for events."""
    return frame is not None and frame.f_code.co_name in ("select", "poll") and "selectors" in frame.f_code.co_filename


def _waits(frame) -> bool:
    """Whether a worker thread is waiting (for work, a lock, I/O), not running: in a function
    that waits, or on a line that calls one (C code has no frame of its own)."""
    if frame is None or frame.f_code.co_name in _IDLE_NAMES:
        return True
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    return any(call in line for call in (".get(", "sleep(", ".wait(", ".acquire(", ".recv(", ".select("))


def _key(frame, depth: int = 14) -> tuple[str, ...]:
    out = []
    for fs in reversed(traceback.extract_stack(frame, limit=None)[-depth:]):
        mark = "*" if ("gpuhub_spawner" in fs.filename or "/jupyterhub/" in fs.filename) else " "
        out.append(f"{mark} {fs.filename.rsplit('site-packages/', 1)[-1]}:{fs.lineno} {fs.name}")
    return tuple(out)


class Sampler:
    def __init__(self, path: str, every: float = 0.005, threshold: float = 0.05, flush: float = 5.0):
        self.path, self.every, self.threshold, self.flush_every = path, every, threshold, flush
        self.main = threading.main_thread().ident
        self.stacks: collections.Counter = collections.Counter()
        self.stalls: list[tuple[float, float, str]] = []  # (started at, seconds, the frame most seen)
        self.starved: list[tuple[float, float, str]] = []  # a look came this late (the GIL was held): at, s, busy threads
        self.starved_stacks: collections.Counter = collections.Counter()
        self.collections: list[tuple[float, int, float, int, str]] = []  # (at, generation, s, collected, thread)
        self._gc_start: dict[int, float] = {}
        self.leak: tuple[int, int, int, str] | None = None
        self.frozen: list[tuple[float, int]] = []  # (at, gc.get_freeze_count()) when it changed
        self._run: list[tuple[str, ...]] = []
        self._run_start = 0.0
        self._last_look = time.perf_counter()
        # Every look, not only the stalls': the loop's share of busy looks, and per gpuhub or
        # JupyterHub function on the stack (inclusive), how many looks found the loop in it.
        self.looks = 0
        self.busy = 0
        self.inclusive: collections.Counter = collections.Counter()
        self._looks_since = time.perf_counter()

    def _gc(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        ident = threading.get_ident()
        if phase == "start":
            self._gc_start[ident] = now
            return
        t0 = self._gc_start.pop(ident, now)
        if now - t0 >= self.threshold / 5:
            self.collections.append(
                (
                    time.time() - (now - t0),
                    info.get("generation", -1),
                    now - t0,
                    info.get("collected", 0),
                    threading.current_thread().name,
                )
            )

    def _look(self) -> None:
        now = time.perf_counter()
        late = now - self._last_look - self.every
        self._last_look = now
        frames = sys._current_frames()
        if late >= self.threshold:
            me = threading.get_ident()
            names = {t.ident: t.name for t in threading.enumerate()}
            busy = []
            for ident, frame in frames.items():
                if ident in (me, self.main) or _waits(frame):
                    continue
                key = _key(frame)
                self.starved_stacks[(f"thread {names.get(ident, ident)}",) + key] += 1
                ours = next((f for f in key if f.startswith("*")), key[0] if key else "?")
                busy.append(f"{names.get(ident, ident)} in {ours[2:].rsplit('/', 1)[-1]}")
            self.starved.append((time.time() - late, late, "; ".join(busy) or "no other thread busy"))
        frame = frames.get(self.main)
        self.looks += 1
        if frame is not None and not _is_idle(frame):
            self.busy += 1
            self.inclusive.update(
                {f[2:].split(":", 1)[0] + ":" + f.rsplit(" ", 1)[-1] for f in _key(frame, depth=40) if f.startswith("*")}
            )
        if frame is None or _is_idle(frame):
            if self._run and now - self._run_start >= self.threshold:
                ours = collections.Counter(
                    next((f[2:] for f in k if f.startswith("*")), k[0][2:] if k else "?") for k in self._run
                )
                self.stalls.append(
                    (time.time() - (now - self._run_start), now - self._run_start, ours.most_common(1)[0][0].rsplit("/", 1)[-1])
                )
                self.stacks.update(self._run)
            self._run = []
            return
        if not self._run:
            self._run_start = now
        self._run.append(_key(frame))

    def write(self) -> None:
        def when(t):
            return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"

        lines = [
            f"stalls >= {self.threshold * 1000:.0f} ms of the main thread: {len(self.stalls)}; longest:"
            + "".join(
                f"\n  {s * 1000:.0f} ms at {when(t)} (mostly in {where})"
                for t, s, where in sorted(self.stalls, key=lambda x: -x[1])[:12]
            )
        ]
        lines.append(
            f"looks >= {self.threshold * 1000:.0f} ms late (the GIL held by some thread): {len(self.starved)}; "
            "longest:"
            + "".join(
                f"\n  {s * 1000:.0f} ms at {when(t)} (busy: {b})" for t, s, b in sorted(self.starved, key=lambda x: -x[1])[:10]
            )
        )
        lines.append(
            f"garbage collections >= {self.threshold * 200:.0f} ms: {len(self.collections)}; longest "
            + ", ".join(
                f"gen {g} {s * 1000:.0f} ms ({n} freed, {th}) at {when(t)}"
                for t, g, s, n, th in sorted(self.collections, key=lambda x: -x[2])[:10]
            )
        )
        frozen = gc.get_freeze_count()
        if not self.frozen or self.frozen[-1][1] != frozen:
            self.frozen.append((time.time(), frozen))
        lines.append(
            "objects out of the collector's sight (gc.freeze), as it changed: "
            + ", ".join(f"{n} at {when(t)}" for t, n in self.frozen[-12:])
        )
        if self.leak:
            lines.append(
                "at the end: {} objects frozen; a full collection freed {}, and {} more once they were "
                "unfrozen (cycles that died while frozen): {}".format(*self.leak)
            )
        span = time.perf_counter() - self._looks_since
        per_look = span / max(1, self.looks)
        lines.append(
            f"looks at the main thread: {self.looks} in {span:.1f} s ({per_look * 1000:.1f} ms apart); the loop "
            f"busy in {self.busy} ({100 * self.busy / max(1, self.looks):.0f} %, ~{self.busy * per_look:.1f} s); "
            "busy looks by gpuhub or JupyterHub function on the stack (inclusive), most first:"
            + "".join(f"\n  {n:6d} looks ~{n * per_look:6.2f} s  {f}" for f, n in self.inclusive.most_common(25))
        )
        total = sum(self.stacks.values()) or 1
        for stack, n in self.stacks.most_common(12):
            lines.append(f"\n{n} looks ({100 * n / total:.0f} % of the stalls' looks), innermost first:")
            lines.extend("  " + f for f in stack)
        for stack, n in self.starved_stacks.most_common(8):
            lines.append(f"\nbusy beside a late look ({n}x), {stack[0]}, innermost first:")
            lines.extend("  " + f for f in stack[1:])
        with open(self.path, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _markers(self) -> None:
        """``<path>.reset`` (the benchmark's start-up is over): forget what was seen so far.
        ``<path>.leak`` (before the hub stops): how many objects a full collection frees, and
        then how many more once the frozen objects (``gc.freeze``) are looked at again: cycles
        that died while frozen, which only ``gc.unfreeze`` would ever reclaim."""
        import os

        if os.path.exists(self.path + ".reset"):
            os.unlink(self.path + ".reset")
            self.stacks.clear(), self.stalls.clear(), self.starved.clear(), self.starved_stacks.clear()
            self.collections.clear()
            self._run = []
            self.looks = self.busy = 0
            self.inclusive.clear()
            self._looks_since = time.perf_counter()
        if os.path.exists(self.path + ".leak"):
            os.unlink(self.path + ".leak")
            frozen, freed = gc.get_freeze_count(), gc.collect()
            gc.unfreeze()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                more = gc.collect()
                kinds = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
            self.leak = (frozen, freed, more, ", ".join(f"{k} {n}" for k, n in kinds.most_common(15)))
            gc.freeze()

    def run(self) -> None:
        next_flush = time.monotonic() + self.flush_every
        self._last_look = time.perf_counter()
        while True:
            time.sleep(self.every)
            try:
                self._look()
                if time.monotonic() >= next_flush:
                    self._markers()
                    self.write()
                    next_flush = time.monotonic() + self.flush_every
            except Exception as e:  # a benchmark's instrument must not take the hub down
                print(f"stall_sampler: {e!r}", file=sys.stderr)


def install(path: str, **kw) -> Sampler:
    s = Sampler(path, **kw)
    gc.callbacks.append(s._gc)
    threading.Thread(target=s.run, name="stall-sampler", daemon=True).start()
    return s
