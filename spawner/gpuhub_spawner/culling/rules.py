"""Decide, for one server at one moment, whether to keep, warn about, or stop it.

Every input is a point in time the hub itself recorded (epoch seconds), never a claim
the user's server makes about itself:

- ``started``: when the hub started the server;
- ``last_activity``: the hub's last recorded activity (the proxy's per-route timestamps
  and the server's own activity reports). A server can only make itself look *busier*
  with these, so they may keep a server but never decide a GPU cull;
- ``gpu_last_busy``: the last trusted GPU reading (NVML in the hub, DCGM on Kubernetes)
  at or above the busy threshold; ``None`` when never seen busy or when no trusted reading
  exists — unknown is idle, never busy.

The three rules, each measured from the start of the idle period it is about:

``timeout``      no activity (and, for a GPU server, no busy GPU) for this long.
``gpuIdleTimeout`` GPU servers: no busy GPU reading for this long, whatever the browser
                 or the server's kernels report.
``maxAge``       this old, busy or not; no snooze moves it.

No trusted reading at all (a MIG slice of a GPU without GPM, such as an A100's: NVML measures
no utilisation of it, while a Hopper slice is read through GPM, culling/gpu.py; a virtual GPU)
follows the policy's ``idle.gpuUnread``: ``idle`` (default) counts the GPU idle, so
``gpuIdleTimeout`` applies; ``activity`` judges the server by the activity rules only, as a
server without GPUs. The warning says which.

A rule that fires opens a warning; the server is stopped ``warning`` later unless the
idle period ends first. What ends it: activity for ``timeout`` (the user came back:
the warning is simply withdrawn), a busy GPU for both GPU rules. For a ``gpuIdleTimeout``
warning, a person seen after the warning (``CullState.person_seen``: the hub's time of a
report from the user's open JupyterLab that someone clicked, typed or scrolled on it; not
traffic, which an open, untouched tab makes every few seconds) counts as one snooze at the
deadline while snoozes remain, so a returning user is not stopped without a fresh warning;
after the last snooze the GPU is released, as announced. The report is the user's word, but
it can do no more than their own Snooze button. The longest an idle GPU can be held is
therefore ``gpuIdleTimeout + warning + maxSnoozes x snooze``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..policy.model import IdleRules
from ..policy.quantities import format_duration

TIMEOUT, GPU_IDLE, MAX_AGE = "idle", "gpu-idle", "max-age"


@dataclass
class Signals:
    started: float
    last_activity: float | None = None
    gpu_last_busy: float | None = None
    has_gpus: bool = False
    # No trusted GPU reading this pass: the policy's gpuUnread ("idle" | "activity"); None: read.
    gpu_unread: str | None = None

    @property
    def judged_by_gpu(self) -> bool:
        """Whether the GPU rules apply (not for an unread GPU under gpuUnread: activity)."""
        return self.has_gpus and self.gpu_unread != "activity"


UNREAD_IDLE = (
    "it reports no GPU utilisation (a MIG slice of a GPU without GPM, such as an A100, or a virtual GPU), "
    "which the policy counts as idle (gpuUnread: idle)"
)
UNREAD_ACTIVITY = (
    "it reports no GPU utilisation (a MIG slice of a GPU without GPM, such as an A100, or a virtual "
    "GPU), so the policy judges it by activity only (gpuUnread: activity)"
)


@dataclass
class CullState:
    """What the hub remembers about one server's pending stop (persisted)."""

    warned_at: float | None = None
    deadline: float | None = None
    reason: str | None = None
    rule: str | None = None  # TIMEOUT | GPU_IDLE | MAX_AGE
    idle_since: float | None = None  # start of the idle period the warning is about
    snoozes: int = 0
    hard: bool = False  # the maximum age: no snooze moves it
    returned: int = 0  # snoozes used up by the user coming back
    # When the hub last heard that a person used the server's open JupyterLab (hub clock);
    # after ``warned_at`` it spends a snooze at a GPU-idle deadline (``decide``).
    person_seen: float | None = None


@dataclass
class Decision:
    action: str  # "keep" | "warn" | "cull"
    reason: str = ""
    rule: str | None = None
    deadline: float | None = None  # when it will be stopped (warn)
    remaining: float | None = None
    idle_since: float | None = None


def due_rules(rules: IdleRules, s: Signals) -> list[tuple[float, str, float, str]]:
    """``(due_at, rule, idle_since, reason)`` for every rule that applies, earliest first."""
    activity = max(s.started, s.last_activity or s.started)
    gpu_busy = max(s.started, s.gpu_last_busy or s.started)
    out = []
    gpus = s.judged_by_gpu
    unread = ""
    if s.has_gpus and s.gpu_unread:
        unread = f"; {UNREAD_ACTIVITY if s.gpu_unread == 'activity' else UNREAD_IDLE}"
    if rules.max_age:
        out.append(
            (s.started + rules.max_age, MAX_AGE, s.started, f"it reached the maximum age of {format_duration(rules.max_age)}")
        )
    if rules.timeout:
        since = max(activity, gpu_busy) if gpus else activity
        what = "no activity and no busy GPU" if gpus else "no activity"
        out.append((since + rules.timeout, TIMEOUT, since, f"{what} for {format_duration(rules.timeout)}{unread}"))
    if gpus and rules.gpu_idle_timeout:
        out.append(
            (
                gpu_busy + rules.gpu_idle_timeout,
                GPU_IDLE,
                gpu_busy,
                f"its GPUs were idle for {format_duration(rules.gpu_idle_timeout)}{unread}",
            )
        )
    return sorted(out)


def _idle_period_ended(state: CullState, s: Signals) -> bool:
    """Whether what the pending warning is about stopped being true."""
    if state.rule == MAX_AGE:
        return False
    gpu_busy = s.gpu_last_busy or 0.0
    if s.judged_by_gpu and gpu_busy > (state.idle_since or 0.0):
        return True  # the GPU was used: both GPU-server rules restart
    if state.rule == TIMEOUT:
        return (s.last_activity or 0.0) > (state.idle_since or 0.0)  # the user came back
    return False


def decide(now: float, rules: IdleRules, s: Signals, state: CullState) -> Decision:
    """Update ``state`` and return what to do now."""
    if state.deadline is not None and _idle_period_ended(state, s):
        clear(state)
    if state.deadline is None:
        due = [d for d in due_rules(rules, s) if d[0] <= now]
        if not due:
            return Decision("keep")
        _due_at, rule, since, reason = due[0]
        state.warned_at = now
        state.deadline = now + (rules.warning or 0.0)
        state.rule, state.idle_since, state.reason = rule, since, reason
        state.hard = rule == MAX_AGE
        state.snoozes = state.returned = 0
    if now >= state.deadline:
        # A person, not traffic: an open tab's own polling must not keep an idle GPU.
        came_back = (state.person_seen or 0.0) > (state.warned_at or 0.0)
        if state.rule == GPU_IDLE and came_back and state.snoozes < (rules.max_snoozes or 0) and rules.snooze:
            # The user came back after the warning but left the GPU idle: one snooze,
            # with a fresh warning, instead of stopping a server in front of them.
            state.snoozes += 1
            state.returned += 1
            state.warned_at = now
            state.deadline = now + rules.snooze
        else:
            return Decision("cull", state.reason or "", state.rule, state.deadline, 0.0, state.idle_since)
    return Decision("warn", state.reason or "", state.rule, state.deadline, state.deadline - now, state.idle_since)


def snooze(now: float, rules: IdleRules, state: CullState) -> tuple[bool, str]:
    """Postpone the pending stop by ``rules.snooze``; refused past ``maxSnoozes``."""
    allowed = rules.max_snoozes or 0
    if state.deadline is None:
        return False, "This server has no pending stop to snooze."
    if state.hard:
        return False, "This server reached its maximum age; a snooze cannot keep it."
    if state.snoozes >= allowed or not rules.snooze:
        return False, f"No snoozes left ({allowed} allowed)."
    state.snoozes += 1
    state.deadline = max(now, state.deadline) + rules.snooze
    return True, (
        f"Postponed by {format_duration(rules.snooze)} (snooze {state.snoozes} of {allowed}); "
        f"it will be stopped in {format_duration(state.deadline - now)} unless "
        + ("its GPUs are used." if state.rule == "gpu-idle" else "it is used.")
    )


def clear(state: CullState) -> None:
    state.warned_at = state.deadline = state.reason = state.rule = state.idle_since = None
    state.hard = False
    state.snoozes = state.returned = 0
    state.person_seen = None
