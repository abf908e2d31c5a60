"""GPU health: what a signal means for admission, and each device's state (docs/gpu-health.md).

Pure: the one-machine monitor (``local/gpu_health.py``) reads NVML and feeds the
``HealthBook`` here; the device table asks it which devices may be handed out.

States: ``healthy``; ``suspect`` (still handed out, admins are warned: a row remap or page
retirement waits for a GPU reset, an XID the policy does not list); ``bad`` (out of
admission: a critical XID, a double-bit ECC error, a failed row remap, the GPU lost or the
driver asking for a reset). An admin may also *drain* a device: its holder keeps it until
it releases it, nobody gets it afterwards. What an event marks (an XID, a DBE event) stays
until an admin uncordons the device, as NVIDIA's device plugin keeps a device unhealthy
until it restarts; what a counter says is re-read every poll (a reset clears it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..policy.model import HealthRules

HEALTHY, SUSPECT, BAD = "healthy", "suspect", "bad"
RANK = {HEALTHY: 0, SUSPECT: 1, BAD: 2}

# What NVIDIA's XID catalogue calls the XIDs people meet most (docs.nvidia.com/deploy/xid-errors).
XID_WORDS = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup after earlier errors",
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    68: "video processor exception",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
}

# nvmlGpuRecoveryAction_t (NVML_GPU_RECOVERY_ACTION_*): what the driver says must happen.
RECOVERY_ACTIONS = {
    0: None,
    1: (BAD, "the driver asks for a GPU reset"),
    2: (BAD, "the driver asks for a node reboot"),
    3: (SUSPECT, "the driver asks to drain peer-to-peer traffic"),
    4: (BAD, "the driver asks to drain and reset the GPU"),
    5: (BAD, "the driver asks to recover the IMEX domain"),
    6: (BAD, "the driver asks for a bus reset"),
    7: (BAD, "the driver asks for a system reboot"),
}


def xid_text(xid: int) -> str:
    words = XID_WORDS.get(xid)
    return f"XID {xid}: {words}" if words else f"XID {xid}"


def classify_xid(rules: HealthRules, xid: int) -> str:
    """``healthy`` for the application's own errors, ``bad`` for critical ones, else ``suspect``."""
    if xid in rules.application_xids:
        return HEALTHY
    if rules.critical_xids is None or xid in rules.critical_xids:
        return BAD
    return SUSPECT


@dataclass
class Counters:
    """One poll of one GPU; None where NVML does not support (or could not read) the signal."""

    ecc_uncorrected: int | None = None  # volatile: since the driver loaded
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    retired_pages_pending: bool | None = None
    recovery_action: int | None = None
    lost: str | None = None  # "GPU is lost" / "GPU requires reset"


def classify_counters(c: Counters) -> list[tuple[str, str]]:
    """Every (state, reason) the counters call for; [] when they say nothing is wrong."""
    out = []
    if c.lost:
        out.append((BAD, f"NVML: {c.lost}"))
    if c.ecc_uncorrected:
        out.append((BAD, f"{c.ecc_uncorrected} uncorrectable ECC error(s) since the driver loaded"))
    if c.remap_failure:
        out.append((BAD, "a memory row remapping failed"))
    if c.remap_pending:
        out.append((SUSPECT, "a memory row remapping is pending (applied at the next GPU reset)"))
    if c.retired_pages_pending:
        out.append((SUSPECT, "a memory page retirement is pending (applied at the next GPU reset)"))
    action = RECOVERY_ACTIONS.get(c.recovery_action) if c.recovery_action is not None else None
    if c.recovery_action and action is None:
        action = (BAD, f"the driver asks for recovery action {c.recovery_action}")
    if action:
        out.append(action)
    return out


@dataclass
class Mark:
    state: str
    reason: str
    at: float
    xid: int | None = None


@dataclass
class GpuHealth:
    """One device's health: sticky marks from events, the last poll's verdicts, a drain."""

    marks: list[Mark] = field(default_factory=list)
    polled: list[tuple[str, str]] = field(default_factory=list)
    polled_since: float | None = None
    drained: str | None = None  # who drained it
    drained_at: float | None = None
    state: str = HEALTHY
    reason: str = ""
    since: float | None = None  # when it entered ``state``
    xid: int | None = None

    @property
    def usable(self) -> bool:
        """Whether the device may be handed out to a new holder."""
        return self.state != BAD and not self.drained

    def _recompute(self, now: float) -> bool:
        found = [(m.state, m.reason, m.at, m.xid) for m in self.marks]
        found += [(s, r, self.polled_since or now, None) for s, r in self.polled]
        worst = max(found, key=lambda f: (RANK[f[0]], -f[2]), default=None)
        state, reason, at, xid = worst if worst else (HEALTHY, "", None, None)
        changed = state != self.state
        if changed:
            self.since = at if state != HEALTHY else now
        self.state, self.reason, self.xid = state, reason, xid
        return changed

    def summary(self) -> str:
        """Plain words: 'out of service since 10:42 (XID 79: GPU has fallen off the bus)'."""
        when = time.strftime("%H:%M", time.localtime(self.since)) if self.since is not None else ""
        if self.state == BAD:
            return f"out of service since {when} ({self.reason})"
        if self.drained:
            return f"drained by {self.drained} since {time.strftime('%H:%M', time.localtime(self.drained_at or 0))}"
        if self.state == SUSPECT:
            return f"suspect since {when} ({self.reason})"
        return "healthy"

    def as_dict(self) -> dict:
        return {
            "state": self.state,
            "reason": self.reason,
            "since": self.since,
            "xid": self.xid,
            "drained": self.drained,
            "drained_at": self.drained_at,
            "usable": self.usable,
            "summary": self.summary(),
        }


class HealthBook:
    """Every device's health; each change answers whether admission must look again."""

    def __init__(self):
        self.devices: dict[str, GpuHealth] = {}

    def of(self, device: str) -> GpuHealth:
        h = self.devices.get(device)
        return h if h is not None else GpuHealth()

    def usable(self, device: str) -> bool:
        h = self.devices.get(device)
        return h is None or h.usable

    def _entry(self, device: str) -> GpuHealth:
        return self.devices.setdefault(device, GpuHealth())

    def mark(self, device: str, state: str, reason: str, xid: int | None = None, now: float | None = None) -> bool:
        """An event (an XID, a DBE): kept until ``uncordon``. True when the state changed."""
        if state == HEALTHY:
            return False
        now = time.time() if now is None else now
        h = self._entry(device)
        h.marks.append(Mark(state, reason, now, xid))
        del h.marks[:-20]
        return h._recompute(now)

    def poll(self, device: str, verdicts: list[tuple[str, str]], now: float | None = None) -> bool:
        """The counters' verdicts of this poll (replacing the last poll's)."""
        now = time.time() if now is None else now
        h = self._entry(device)
        if sorted(verdicts) != sorted(h.polled):
            h.polled_since = now
        h.polled = list(verdicts)
        return h._recompute(now)

    def drain(self, device: str, by: str, now: float | None = None) -> bool:
        h = self._entry(device)
        if h.drained:
            return False
        h.drained, h.drained_at = by, time.time() if now is None else now
        return True

    def uncordon(self, device: str, now: float | None = None) -> bool:
        """Clear the drain and every event's mark; the next poll re-reads the counters."""
        h = self._entry(device)
        was = (h.state, h.drained)
        h.drained = h.drained_at = None
        h.marks.clear()
        h._recompute(time.time() if now is None else now)
        return (h.state, h.drained) != was

    # -- persistence (drains and marks survive a hub restart) ---------------------------------
    def to_json(self) -> dict:
        return {
            dev: {"marks": [m.__dict__ for m in h.marks], "drained": h.drained, "drained_at": h.drained_at}
            for dev, h in self.devices.items()
            if h.marks or h.drained
        }

    def load(self, data: dict, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for dev, d in (data or {}).items():
            h = self._entry(str(dev))
            h.marks = [
                Mark(m["state"], m["reason"], float(m["at"]), m.get("xid")) for m in d.get("marks", []) if m.get("state") in RANK
            ]
            h.drained, h.drained_at = d.get("drained"), d.get("drained_at")
            h._recompute(now)
