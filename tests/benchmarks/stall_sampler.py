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

A look needs the GIL: C code that holds it (libyaml, pydantic-core) is seen at the Python
frame that called it, once it returns. Looks are as good as the 5 ms switch interval allows.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import traceback



def _is_idle(frame) -> bool:
    """Whether the main thread sits in the event loop's wait for events."""
    return frame is not None and frame.f_code.co_name in ("select", "poll") and "selectors" in frame.f_code.co_filename


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
        self.stalls: list[tuple[float, float]] = []  # (started at, seconds)
        self._run: list[tuple[str, ...]] = []
        self._run_start = 0.0

    def _look(self) -> None:
        frame = sys._current_frames().get(self.main)
        now = time.perf_counter()
        if frame is None or _is_idle(frame):
            if self._run and now - self._run_start >= self.threshold:
                self.stalls.append((time.time() - (now - self._run_start), now - self._run_start))
                self.stacks.update(self._run)
            self._run = []
            return
        if not self._run:
            self._run_start = now
        self._run.append(_key(frame))

    def write(self) -> None:
        lines = [f"stalls >= {self.threshold * 1000:.0f} ms: {len(self.stalls)}; longest "
                 + ", ".join(f"{s * 1000:.0f} ms at {time.strftime('%H:%M:%S', time.localtime(t))}"
                             for t, s in sorted(self.stalls, key=lambda x: -x[1])[:10])]
        total = sum(self.stacks.values()) or 1
        for stack, n in self.stacks.most_common(12):
            lines.append(f"\n{n} looks ({100 * n / total:.0f} % of the stalls' looks), innermost first:")
            lines.extend("  " + f for f in stack)
        with open(self.path, "w") as f:
            f.write("\n".join(lines) + "\n")

    def run(self) -> None:
        next_flush = time.monotonic() + self.flush_every
        while True:
            time.sleep(self.every)
            try:
                self._look()
                if time.monotonic() >= next_flush:
                    self.write()
                    next_flush = time.monotonic() + self.flush_every
            except Exception as e:  # a benchmark's instrument must not take the hub down
                print(f"stall_sampler: {e!r}", file=sys.stderr)


def install(path: str, **kw) -> Sampler:
    s = Sampler(path, **kw)
    threading.Thread(target=s.run, name="stall-sampler", daemon=True).start()
    return s
