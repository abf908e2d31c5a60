"""The live policy: re-read on change, never replaced by a broken edit.

Both backends read the policy through one ``PolicyStore``. A change to the file is
picked up on the next check (a cheap ``stat``, done before every spawn and every few
seconds by the hub); an invalid edit is logged with its located errors and reported
as ``stale`` while the last good policy keeps serving.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from traitlets import Float, Unicode
from traitlets.config import SingletonConfigurable

from pydantic import BaseModel, ValidationError

from .loader import PolicyError, PolicyIssue, load_policy_data, no_cyclic_gc
from .model import Policy


@dataclass
class PolicyStatus:
    path: str
    loaded_at: float | None = None
    loaded_mtime: float | None = None
    stale: bool = False
    errors: list[str] = field(default_factory=list)
    failed_at: float | None = None
    # A valid policy that cannot keep a promise where it runs (policy/checks.py): it serves.
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "path": self.path,
            "loaded_at": self.loaded_at,
            "stale": self.stale,
            "errors": self.errors,
            "failed_at": self.failed_at,
            "warnings": self.warnings,
        }


# What a load gives: the policy and the plain data it was validated from, or the error; seconds.
Outcome = tuple[Policy | None, Any, PolicyError | None, float]


def _timed_load(path: Path) -> Outcome:
    """Read and validate (in whichever thread); never raises a ``PolicyError``."""
    t0 = time.perf_counter()
    try:
        policy, data = load_policy_data(path)
        return policy, data, None, time.perf_counter() - t0
    except PolicyError as e:
        return None, None, e, time.perf_counter() - t0


# The child reads and validates the file (``loader.read_in_child``) and answers with a line
# for all but the policy's lists, then one JSON line per item of them (a team, a profile, ...):
# the hub decodes and builds them one at a time (``_build``).
_CHILD = """
import json, sys
from gpuhub_spawner.policy.loader import read_in_child
answer = json.loads(read_in_child(sys.argv[1]))
if not answer["ok"]:
    print(json.dumps(answer))
    sys.exit()
data = answer["data"]
print(json.dumps({"ok": True, "layout": [[k, len(v) if isinstance(v, list) else None] for k, v in data.items()],
                  "rest": {k: v for k, v in data.items() if not isinstance(v, list)}}))
for v in data.values():
    if isinstance(v, list):
        for item in v:
            print(json.dumps(item))
"""


def _item_models() -> dict[str, type[BaseModel]]:
    """The policy's list fields whose items are models (teams, profiles, flavors, ...), by the
    key the file uses (camelCase) and by field name."""
    out: dict[str, type[BaseModel]] = {}
    for name, info in Policy.model_fields.items():
        args = typing.get_args(info.annotation)
        if typing.get_origin(info.annotation) is list and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            out[name] = out[info.alias or name] = args[0]
    return out


def _build(out: bytes) -> tuple[Policy | None, Any, bool]:
    """The policy from the child's lines, built a team, a profile, ... at a time.

    Runs in a thread of the hub for 0.3-0.7 s of CPU (500 teams). ``json.loads`` of the whole
    answer would hold the interpreter lock for its whole length, and pydantic-core lets go
    of it only inside the Python validators it calls; and while a thread computes, the loop
    waits up to the 5 ms switch interval each time it wants the lock back. So each item is
    decoded and validated on its own, the lock offered to the loop after each
    (``time.sleep(0)``), and the ``Policy`` is then made from the ready items (pydantic takes
    model instances as they are; the policy's own cross-checks run as before). Same policy,
    same data. Returns (policy, data, ok); not ok: the child's answer is not a policy
    (``data`` is then the decoded answer, or None when unreadable)."""
    lines = out.split(b"\n")
    try:
        head = json.loads(lines[0])
    except ValueError:
        return None, None, False
    if not head.get("ok"):
        return None, head, False
    models = _item_models()
    data: dict[str, Any] = {}
    built: dict[str, Any] = {}
    i = 1
    for key, n in head["layout"]:
        if n is None:
            data[key] = built[key] = head["rest"][key]
            continue
        items = data[key] = [json.loads(line) for line in lines[i : i + n]]  # one short C call each
        i += n
        model = models.get(key)
        if model is None:
            built[key] = items
            continue
        built[key] = []
        for item in items:
            built[key].append(model.model_validate(item))
            time.sleep(0)  # hand the lock to the loop now if it waits, not after the 5 ms switch interval
    return Policy.model_validate(built), data, True


async def _load_beside_the_loop(path: Path) -> Outcome:
    """Parse in a child process (libyaml would hold the GIL), build the objects in a thread."""
    t0 = time.perf_counter()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _CHILD, str(path), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await proc.communicate()
    except OSError:  # no child process possible (limits): read it here rather than not at all
        return _timed_load(path)

    def build() -> tuple[Policy | None, Any, PolicyError | None]:
        try:
            # No cyclic collection of the hub's heap while ~170,000 objects are built (it would
            # hold the GIL, i.e. the loop, for as long as it scans).
            _collect_before_build()
            with no_cyclic_gc():
                policy, data, ok = _build(out)
                if ok:
                    _out_of_the_collectors_sight()
        except ValidationError:  # the child accepted it: cannot happen unless the file is exotic
            return _timed_load(path)[:3]
        if ok:
            return policy, data, None
        if data is None:
            why = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
            return None, None, PolicyError(str(path), [PolicyIssue("", None, None, f"could not read the policy: {why[0]}")])
        return None, None, PolicyError(data["filename"], [PolicyIssue(**i) for i in data["issues"]])

    policy, data, error = await asyncio.get_running_loop().run_in_executor(None, build)
    return policy, data, error, time.perf_counter() - t0


def _out_of_the_collectors_sight() -> None:
    """Move every object alive now, the new policy's ~170,000 included, out of the cyclic
    collector's generations (``gc.freeze``), as ``policy.bounded.freeze_heap`` does with the
    hub's start-up heap, so that they are not scanned again.

    Otherwise the young passes scan them again and again, promote them within seconds, and
    their number brings the next full pass near; that pass scans the hub's whole unfrozen
    heap holding the GIL, i.e. the loop: 0.3-2 s, as ``reload_stall.py --stacks`` found.
    Frozen objects are still freed when their last reference goes (the policy this one
    replaces). The cost, as for the start-up heap: a cycle alive now that dies later is never
    collected, with what it holds. Garbage cycles that are already dead are collected first
    (``_collect_before_build``), or a dead cycle holding the old policy would keep it for ever.
    (``gc.unfreeze()`` after the freeze would keep nothing frozen, but it also hands the
    start-up heap back to every full pass: 0.8-1.1 s each, issue 19.)"""
    gc.freeze()


def _collect_before_build() -> None:
    """A full pass over what is not frozen, before the new policy's objects exist: cheap (what
    the hub allocated since the last freeze) and it frees dead cycles that may hold the policy
    in force, so that the freeze after the build does not keep them."""
    gc.collect()


def _signature(path: Path) -> tuple[float, int, int] | None:
    # mtime alone misses two writes within one tick; ConfigMap updates swap a symlink,
    # so stat() follows it and the inode changes.
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime, st.st_size, st.st_ino)


class PolicyStore(SingletonConfigurable):
    policy_file = Unicode(
        os.environ.get("GPUHUB_POLICY", "profiles.yaml"),
        help="Path of the policy YAML (teams, flavors, quotas, profiles, idle rules).",
    ).tag(config=True)

    check_interval = Float(2.0, help="Seconds between background checks of the policy file for changes.").tag(config=True)

    inline_reload_budget = Float(
        0.02,
        help="""Reload in the event loop only if the last load took at most this long (s);
        larger policies are re-read in a thread so the hub never stalls on a reload.""",
    ).tag(config=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.log = logging.getLogger("JupyterHub.gpuhub.policy")
        self._policy: Policy | None = None
        self._data: Any = None
        self._signature = None
        self.status = PolicyStatus(path=self.policy_file)
        self._listeners: list[Callable[[Policy], None]] = []
        self._checks: list[Callable[[Policy], list[str]]] = []
        self._reloading: asyncio.Future | None = None
        self._load_seconds = 0.0
        self.refresh()
        if self._policy is None:
            # Without one good policy the hub cannot decide anything safely: refuse to start.
            raise RuntimeError("gpuhub cannot start: no valid policy\n" + "\n".join(self.status.errors))

    @property
    def policy(self) -> Policy:
        self.refresh()
        assert self._policy is not None
        return self._policy

    @property
    def current(self) -> Policy:
        """The policy in force, without checking the file (safe inside callbacks)."""
        assert self._policy is not None
        return self._policy

    @property
    def data(self) -> Any:
        """The plain data (dicts, lists, scalars) the policy in force was validated from, as
        read from the file; shared, never to be changed (the audit diffs it, off the loop)."""
        return self._data

    def on_change(self, callback: Callable[[Policy], None]) -> None:
        """Call ``callback(policy)`` after every successful reload (queue re-evaluation).

        Listeners run on the hub's event loop, one after the other: each must only do
        bookkeeping there (swap a reference, compare a few hundred names, schedule work)
        and hand anything that grows with the policy's size to a thread
        (``tests/benchmarks/reload_stall.py`` measures the loop's longest stall).
        """
        self._listeners.append(callback)

    def add_check(self, check: Callable[[Policy], list[str]]) -> None:
        """Warnings about the policy in force from what only the backend knows (the machine's
        GPUs, the hub's activity interval): run now and after every successful load, logged
        and shown to admins on the status page. A check must be cheap (it runs on the loop)."""
        self._checks.append(check)
        if self._policy is not None:
            self._run_checks(self._policy)

    def _run_checks(self, policy: Policy) -> None:
        warnings: list[str] = []
        for check in self._checks:
            try:
                warnings += check(policy)
            except Exception:  # a check must not block a reload
                self.log.exception("policy check failed")
        if policy is not self._policy:  # a newer policy came meanwhile: its own checks say
            return
        if warnings and warnings != self.status.warnings:
            self.log.warning("Policy %s is live, but:\n  %s", self.status.path, "\n  ".join(warnings))
        self.status.warnings = warnings

    def refresh(self) -> bool:
        """Reload if the file changed; return True when a new policy took effect.

        Inside the hub's event loop a policy that took longer than ``inline_reload_budget``
        to load last time is re-read beside the loop (parsed in a child process, its
        objects built in a thread) and swapped in atomically on the loop when it is ready:
        a 2,000-profile file takes ~0.3 s of CPU, and the loop must not stall. Small files
        keep the simple, immediate reload.
        """
        path = Path(self.policy_file)
        sig = _signature(path)
        if sig == self._signature and self._policy is not None:
            return False
        if self._reloading is not None:
            return False  # the thread already reads it; it re-checks the file when done
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None and self._policy is not None and self._load_seconds > self.inline_reload_budget:
            self._signature = sig
            future = asyncio.ensure_future(_load_beside_the_loop(path))
            self._reloading = future

            def done(f: asyncio.Future) -> None:
                self._reloading = None
                self._apply(path, sig, f.result())
                self.refresh()  # changed again meanwhile?

            future.add_done_callback(done)
            return False
        self._signature = sig
        return self._apply(path, sig, _timed_load(path))

    async def fresh(self) -> Policy:
        """The policy, after any change to the file has taken effect (for spawns)."""
        self.refresh()
        while self._reloading is not None:
            await asyncio.shield(self._reloading)
            await asyncio.sleep(0)  # let its done-callback swap the policy in
        return self.current

    def _apply(self, path: Path, sig, outcome: Outcome) -> bool:
        policy, data, error, seconds = outcome
        self._load_seconds = seconds
        try:
            if error is not None:
                raise error
        except PolicyError as e:
            self.status.stale = self._policy is not None
            self.status.errors = [i.format(e.filename) for i in e.issues]
            self.status.failed_at = time.time()
            self.log.error(
                "Policy %s is invalid; %s:\n  %s",
                path,
                "keeping the last good policy" if self._policy else "no policy loaded",
                "\n  ".join(self.status.errors),
            )
            return False
        assert policy is not None, outcome  # an outcome without an error carries its policy (_timed_load, build)
        self._policy = policy
        self._data = data
        self.status = PolicyStatus(path=str(path), loaded_at=time.time(), loaded_mtime=sig[0] if sig else None)
        self.log.info("Loaded policy %s: %d teams, %d profiles", path, len(policy.teams), len(policy.profiles))
        try:  # pure functions of the policy and the machine: off the loop (0.1 s for 500 teams)
            asyncio.get_running_loop().run_in_executor(None, self._run_checks, policy)
        except RuntimeError:  # no loop (the CLI, tests): here
            self._run_checks(policy)
        slow = []
        for callback in self._listeners:
            t0 = time.perf_counter()
            try:
                callback(policy)
            except Exception:  # a listener must not block a reload
                self.log.exception("policy listener failed")
            slow.append((getattr(callback, "__qualname__", repr(callback)), time.perf_counter() - t0))
        total = sum(seconds for _, seconds in slow)
        if total > 0.05:  # they run on the hub's loop: every request waits meanwhile
            self.log.warning(
                "Policy listeners held the hub's loop %.0f ms: %s",
                total * 1000,
                ", ".join(f"{name} {seconds * 1000:.0f} ms" for name, seconds in slow if seconds > 0.005),
            )
        return True
