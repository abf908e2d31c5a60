"""Ray clusters in the team's GPU queue: ``gpuhub ray up --gpus N`` (docs/ray.md).

What both backends share (layer 3, after ``jobs`` and ``usage``):

- ``RayRequest``: what a user asks for (user, team, profile, gpus, workers, name);
- ``choose``: the request checked against the policy's ``ray:`` section and the user's
  teams and profiles, refused with the reason (``ChoiceError``) before anything queues;
- ``RayClusterView``: what ``list`` and ``status`` answer (the API's JSON, the CLI's lines);
- ``RayClusterManager``: the interface each backend implements (``local.ray_manager`` on one
  machine, ``kube.ray_manager`` on Kubernetes), reached through the hub's application object
  (``hub.context.GpuHubApp.ray``); the composition root chooses it (``wiring.app``).

A cluster is sized by a profile: ``--gpus N`` picks the profile of the user's team with N
GPUs (``--profile`` names one), so its flavor, CPU, memory, priority and idle rules are
the profile's, and it counts against the team's quota and the user's GPU cap exactly like a
server or a job of that profile.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Iterable

from ..policy.access import ChoiceError, profiles_for, teams_for, no_team_message
from ..policy.model import Policy, Profile, Team

RAY_SCOPE = "custom:gpuhub:ray"
RAY_ALL_SCOPE = "custom:gpuhub:ray:all"
NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$")
# States a cluster goes through (both backends use these words).
QUEUED, STARTING, RUNNING = "queued", "starting", "running"
STOPPED, FAILED = "stopped", "failed"
FINAL = (STOPPED, FAILED)
# Why a cluster ended (``RayClusterView.reason``).
BY_USER, WITH_SERVER, IDLE, PREEMPTED = "stopped-by-user", "server-stopped", "idle", "preempted"


@dataclass(frozen=True)
class RayRequest:
    """What ``gpuhub ray up`` (or ``gpuhub_notebook.ray_cluster``) asks for."""

    user: str
    gpus: int | None = None  # None: the chosen profile's count
    workers: int = 0  # worker processes (one machine) or pods (Kubernetes) besides the head
    profile: str | None = None  # None: the team's profile with ``gpus`` GPUs
    team: str | None = None  # for members of several teams
    name: str | None = None  # None: the backend names it (ray-<hex>)


@dataclass(frozen=True)
class RayChoice:
    """A request the policy accepts: the team and the profile it runs under."""

    request: RayRequest
    team: Team
    profile: Profile

    @property
    def gpus(self) -> int:
        return self.profile.gpu.count if self.profile.gpu else 0


@dataclass
class RayClusterView:
    """One cluster as users and admins see it (the API's JSON; ``status`` is a plain sentence)."""

    id: str
    name: str
    user: str
    team: str
    profile: str
    gpus: int
    workers: int
    state: str  # QUEUED, STARTING, RUNNING, STOPPED, FAILED
    status: str  # "queued: position 1 of 2 in Vision Lab's queue; ..." (the state word first)
    devices: list[str] = field(default_factory=list)
    address: str = ""  # GCS address for ray.init (reachable from the user's server)
    # The dashboard, on the owner's origin: served by the owner's server (gpuhub_notebook's
    # ray_dashboard), so a path relative to their server's URL here; the hub API answers it
    # as the full URL (hub/ray_api.py). Empty where the backend serves none.
    dashboard: str = ""
    dashboard_port: int | None = None  # where the owner's server finds it (one machine: 127.0.0.1)
    created: float | None = None
    started: float | None = None
    finished: float | None = None
    reason: str = ""  # why it ended: BY_USER, WITH_SERVER, IDLE, PREEMPTED, or a failure
    warning: str = ""  # an idle warning in force (the culler's words)

    def to_dict(self) -> dict:
        return asdict(self)


def choose(policy: Policy, groups: Iterable[str], request: RayRequest) -> RayChoice:
    """Check ``request`` against ``policy.ray`` and the user's teams; raise ``ChoiceError``."""
    rules = policy.ray
    if not rules.enabled:
        raise ChoiceError(403, "Ray clusters are not enabled on this hub (the policy's ray.enabled is false).")
    if request.name is not None and not NAME.match(request.name):
        raise ChoiceError(
            400, f"{request.name!r} is not a cluster name: lowercase letters, digits and '-', at most 32 characters"
        )
    if not isinstance(request.workers, int) or request.workers < 0:
        raise ChoiceError(400, "--workers must be 0 or more")
    if request.workers > rules.max_workers:
        raise ChoiceError(
            403,
            f"A Ray cluster may have at most {rules.max_workers} workers on this hub "
            f"(the policy's ray.maxWorkers); you asked for {request.workers}.",
        )
    if request.gpus is not None and (not isinstance(request.gpus, int) or request.gpus < 0):
        raise ChoiceError(400, "--gpus must be 0 or more")
    teams = teams_for(policy, groups)
    if not teams:
        raise ChoiceError(403, no_team_message(policy))
    if request.team:
        teams = [t for t in teams if t.name == request.team]
        if not teams:
            raise ChoiceError(403, f"You are not a member of team {request.team!r}.")
    counted = lambda p: p.gpu.count if p.gpu else 0  # noqa: E731
    if request.profile:
        profile = policy.profile(request.profile)
        if profile is None:
            raise ChoiceError(400, f"There is no profile {request.profile!r}.")
        team = next((t for t in teams if profile.usable_by(t.name)), None)
        if team is None:
            raise ChoiceError(403, f"Profile {request.profile!r} is not available to your team(s).")
        if request.gpus is not None and request.gpus != counted(profile):
            raise ChoiceError(
                400,
                f"Profile {profile.slug!r} has {counted(profile)} GPU(s), not {request.gpus}; "
                "leave out --gpus or choose another profile.",
            )
        return RayChoice(request, team, profile)
    for team in teams:
        offered = profiles_for(policy, team)
        fitting = [p for p in offered if request.gpus is None or counted(p) == request.gpus]
        if fitting:
            return RayChoice(request, team, next((p for p in fitting if p.default), fitting[0]))
    counts = sorted({counted(p) for t in teams for p in profiles_for(policy, t)})
    raise ChoiceError(
        400,
        f"No profile of your team(s) has {request.gpus} GPU(s); "
        f"the counts you may ask for are {', '.join(map(str, counts)) or 'none'} "
        "(or name one with --profile).",
    )


class RayClusterManager(ABC):
    """One hub's Ray clusters. Each backend implements it; the hub API (``hub.ray_api``)
    and the CLI (``rayclusters.cli``) speak only to this."""

    @abstractmethod
    async def start(self, user, groups: list[str], request: RayRequest) -> RayClusterView:
        """Check (``choose``), queue and record; raise ``ChoiceError`` before anything queues.
        Returns at once (queued); the cluster starts when the queue admits it."""

    @abstractmethod
    def list(self, user_name: str | None = None) -> list[RayClusterView]:
        """The clusters of ``user_name`` (None: everyone's), newest first."""

    @abstractmethod
    def status(self, cluster: str, user_name: str | None = None) -> RayClusterView | None:
        """One cluster by id or by name (names are per user); None if there is none."""

    @abstractmethod
    async def stop(self, cluster: str, reason: str = BY_USER, user_name: str | None = None) -> RayClusterView | None:
        """Leave the queue or stop it; its GPUs are back in the queue when this returns."""
