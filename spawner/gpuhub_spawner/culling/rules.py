"""Decide, for one server at one moment, whether to keep, warn about, or stop it.

Signals, all in seconds (``None`` = unknown or not applicable):

- ``inactive``: since the hub last saw activity (browser, kernels, terminals);
- ``kernels_idle``: since the last kernel or terminal activity, ``0`` if one is busy;
- ``gpu_idle``: since the server's own GPUs were last above the busy threshold,
  ``0`` if they are busy now, ``None`` for a server without GPUs;
- ``age``: since the server started.

A server whose GPUs are busy is never stopped for idleness, whatever the browser and
kernels do (a training loop started from a terminal, browser closed). A GPU server whose
GPUs and kernels are idle is stopped after ``gpuIdleTimeout`` even if a browser tab
keeps the hub's activity fresh. ``maxAge`` always applies. Every stop is preceded by a
warning at least ``warning`` seconds ahead; a snooze moves the deadline by ``snooze``,
at most ``maxSnoozes`` times.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..policy.model import IdleRules
from ..policy.quantities import format_duration


@dataclass
class Signals:
    inactive: float | None
    kernels_idle: float | None
    gpu_idle: float | None
    age: float | None


@dataclass
class CullState:
    """What the culler remembers about one server between passes."""

    warned_at: float | None = None
    deadline: float | None = None
    reason: str | None = None
    snoozes: int = 0
    snoozed_until: float | None = None
    hard: bool = False  # the maximum age: no snooze moves it


@dataclass
class Decision:
    action: str  # "keep" | "warn" | "cull"
    reason: str = ""
    deadline: float | None = None  # when it will be stopped (warn)
    remaining: float | None = None
    details: dict = field(default_factory=dict)


def _due(rules: IdleRules, s: Signals, has_gpus: bool) -> tuple[float, str] | None:
    """Seconds until a rule fires (may be negative) and why; None if no rule applies."""
    candidates: list[tuple[float, str]] = []
    gpu_busy = has_gpus and s.gpu_idle is not None and s.gpu_idle <= 0
    if rules.max_age and s.age is not None:
        candidates.append((rules.max_age - s.age, f"reached the maximum age of {format_duration(rules.max_age)}"))
    if not gpu_busy:
        if rules.timeout and s.inactive is not None:
            # A detached training run leaves the hub's activity stale: for a GPU server
            # the clock starts at the later of the last activity and the last busy GPU.
            idle = min(s.inactive, s.gpu_idle) if has_gpus and s.gpu_idle is not None else s.inactive
            candidates.append((rules.timeout - idle, f"no activity for {format_duration(rules.timeout)}"))
        if has_gpus and rules.gpu_idle_timeout and s.gpu_idle is not None:
            # GPUs idle and kernels idle: a browser tab left open does not keep GPUs.
            kernels = s.kernels_idle if s.kernels_idle is not None else s.inactive
            if kernels is not None:
                idle = min(s.gpu_idle, kernels)
                candidates.append(
                    (
                        rules.gpu_idle_timeout - idle,
                        f"its GPUs and kernels were idle for {format_duration(rules.gpu_idle_timeout)}",
                    )
                )
    if not candidates:
        return None
    return min(candidates, key=lambda c: c[0])


def decide(now: float, rules: IdleRules, signals: Signals, state: CullState, has_gpus: bool) -> Decision:
    """Update ``state`` and return what to do now."""
    due = _due(rules, signals, has_gpus)
    warning = rules.warning or 0.0
    details = {"inactive": signals.inactive, "kernels_idle": signals.kernels_idle, "gpu_idle": signals.gpu_idle, "age": signals.age}
    if due is None:
        _clear(state)
        return Decision("keep", details=details)
    remaining, reason = due
    if state.snoozed_until is not None and state.snoozed_until > now and "maximum age" not in reason:
        remaining = max(remaining, state.snoozed_until - now)
    if remaining > warning:
        _clear(state)  # activity resumed (or snoozed far enough): no warning stands
        return Decision("keep", reason=reason, remaining=remaining, details=details)
    if state.deadline is None:
        # First warning: never stop sooner than `warning` after telling the user.
        state.warned_at = now
        state.deadline = now + max(remaining, warning)
        state.reason = reason
        state.hard = "maximum age" in reason
    elif state.snoozed_until is not None and state.snoozed_until > state.deadline:
        state.deadline = state.snoozed_until
    if now >= state.deadline:
        return Decision("cull", reason=state.reason or reason, deadline=state.deadline, remaining=0.0, details=details)
    state.reason = reason
    return Decision("warn", reason=reason, deadline=state.deadline, remaining=state.deadline - now, details=details)


def snooze(now: float, rules: IdleRules, state: CullState) -> tuple[bool, str]:
    """Postpone the stop by ``rules.snooze``; refused past ``maxSnoozes``."""
    allowed = rules.max_snoozes or 0
    if state.hard:
        return False, "This server reached its maximum age; a snooze cannot keep it."
    if state.snoozes >= allowed:
        return False, f"No snoozes left ({allowed} allowed)."
    length = rules.snooze or 0.0
    base = max(now, state.deadline or now)
    state.snoozes += 1
    state.snoozed_until = base + length
    state.deadline = state.snoozed_until
    return True, (
        f"Postponed by {format_duration(length)} (snooze {state.snoozes} of {allowed}); "
        f"the server stays until at least {format_duration(state.snoozed_until - now)} from now unless it becomes active."
    )


def _clear(state: CullState) -> None:
    state.hard = False
    state.warned_at = None
    state.deadline = None
    state.reason = None
