"""The hub's record of cull warnings and snoozes, and where each decision is made.

The culler service (jupyterhub-idle-culler 2.0) gathers activity and asks the hub,
server by server, what to do. Deciding in the hub keeps one copy of the state that
users see on the home page, that JupyterLab shows, and that snoozes change — no race
between a snooze and a culler pass — and lets the hub read the GPUs it assigned.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

from traitlets.config import SingletonConfigurable

from ..policy import PolicyStore
from ..policy.model import IdleRules, Policy, Profile
from ..policy.quantities import format_duration
from .gpu import read_utilization
from .rules import CullState, Decision, Signals, decide, snooze

log = logging.getLogger("JupyterHub.gpuhub.culler")


@dataclass
class ServerRecord:
    started: str | None
    state: CullState = field(default_factory=CullState)
    gpu_last_busy: float | None = None


class CullBoard(SingletonConfigurable):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.records: dict[str, ServerRecord] = {}

    @property
    def policy(self) -> Policy:
        return PolicyStore.instance(config=self.config).policy

    def rules_for(self, profile: Profile | None) -> IdleRules:
        policy = self.policy
        return policy.idle_rules(profile) if profile else policy.defaults.idle

    def _record(self, key: str, started: str | None) -> ServerRecord:
        rec = self.records.get(key)
        if rec is None or rec.started != started:
            rec = self.records[key] = ServerRecord(started=started)
        return rec

    def decide(
        self,
        key: str,
        profile: Profile | None,
        *,
        started: str | None,
        inactive: float | None,
        kernels_idle: float | None,
        age: float | None,
        devices: list[str] | None,
        reported_gpus: list[dict] | None,
        now: float | None = None,
    ) -> Decision:
        now = time.time() if now is None else now
        rules = self.rules_for(profile)
        rec = self._record(key, started)
        has_gpus = bool(profile and profile.gpu_count)
        gpu_idle = None
        if has_gpus:
            util = read_utilization(devices) if devices else None
            if util is None and reported_gpus:
                # A MIG slice reports no utilisation (null): unknown, not idle.
                util = {str(g.get("id")): int(g["utilization"]) for g in reported_gpus if g.get("utilization") is not None}
            if util:
                threshold = rules.gpu_busy_threshold if rules.gpu_busy_threshold is not None else 5
                if rec.gpu_last_busy is None:
                    rec.gpu_last_busy = now - (age or 0)  # idle since start until seen busy
                if any(u >= threshold for u in util.values()):
                    rec.gpu_last_busy = now
                gpu_idle = now - rec.gpu_last_busy
        signals = Signals(inactive=inactive, kernels_idle=kernels_idle, gpu_idle=gpu_idle, age=age)
        decision = decide(now, rules, signals, rec.state, has_gpus)
        slug = profile.slug if profile else "?"
        fmt = lambda v: "n/a" if v is None else format_duration(v)  # noqa: E731
        idle_text = f"inactive {fmt(inactive)}, kernels idle {fmt(kernels_idle)}, GPUs idle {fmt(gpu_idle)}, age {fmt(age)}"
        if decision.action == "cull":
            log.warning("Culling %s (profile %s): %s; %s", key, slug, decision.reason, idle_text)
            self.records.pop(key, None)
        elif decision.action == "warn":
            log.info("Warning %s (profile %s): stops in %s: %s; %s", key, slug, fmt(decision.remaining), decision.reason, idle_text)
        return decision

    def snooze(self, key: str, profile: Profile | None, now: float | None = None) -> tuple[bool, str, float | None]:
        now = time.time() if now is None else now
        rec = self.records.get(key)
        rules = self.rules_for(profile)
        exhausted = rec is not None and rec.state.snoozes >= (rules.max_snoozes or 0)
        if rec is None or (rec.state.deadline is None and not exhausted):
            return False, "This server has no pending stop to snooze.", None
        ok, message = snooze(now, rules, rec.state)
        if ok:
            log.info("Snoozed %s: %s", key, message)
        return ok, message, rec.state.deadline

    def warnings_for(self, user: str, profiles: dict[str, Profile | None]) -> dict[str, dict]:
        """The user's warned servers (for the home page, JupyterLab and the API)."""
        out = {}
        for server, profile in profiles.items():
            rec = self.records.get(f"{user}/{server}")
            if rec is None or rec.state.deadline is None:
                continue
            rules = self.rules_for(profile)
            s = rec.state
            out[server] = {
                "deadline": s.deadline,
                "reason": s.reason,
                "warned_at": s.warned_at,
                "snoozes_left": 0 if s.hard else max(0, (rules.max_snoozes or 0) - s.snoozes),
                "snooze_seconds": rules.snooze or 0,
            }
        return out

    def forget(self, key: str) -> None:
        self.records.pop(key, None)

    def snapshot(self) -> dict:
        return {k: asdict(v) for k, v in self.records.items()}
