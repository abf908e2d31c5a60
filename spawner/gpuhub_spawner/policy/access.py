"""Who may use what: identity-provider groups -> teams -> profiles.

Pure functions, shared by both spawners. Every start re-runs ``resolve_choice`` on the
submitted ``user_options``, so a forged form post or REST call naming another team's
profile, or options no profile offers, is refused with a reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from .model import Policy, Profile, Team
from .quantities import format_memory

ALLOWED_OPTIONS = {"profile", "team"}


class ChoiceError(Exception):
    """A refused choice; ``status`` is the HTTP status the hub should answer with."""

    def __init__(self, status: int, message: str):
        self.status = status
        self.message = message
        super().__init__(message)


@dataclass(frozen=True)
class Choice:
    team: Team
    profile: Profile
    priority_class: str | None
    priority: int

    @property
    def gpu_count(self) -> int:
        return self.profile.gpu_count

    @property
    def flavor(self) -> str | None:
        gpu = self.profile.gpu
        return gpu.flavor if gpu is not None and gpu.count else None  # as gpu_count: no GPU, or none of them


def teams_for(policy: Policy, groups: Iterable[str]) -> list[Team]:
    groups = set(groups)
    return [t for t in policy.teams if groups.intersection(t.groups)]


def profiles_for(policy: Policy, team: Team) -> list[Profile]:
    return [p for p in policy.profiles if p.usable_by(team.name)]


def profile_resources(policy: Policy, profile: Profile) -> str:
    """What a profile gives, in the spawn page's words ("1 CPU, 1 GiB memory, 1× Tesla GPU"):
    the spawn form and every other picker of profiles (JupyterLab's "Run as job") say the same."""
    gpu = profile.gpu
    if gpu is not None and gpu.count:  # profile.gpu_count
        words = f"{gpu.count}\u00d7 {policy.flavor(gpu.flavor).display_name or gpu.flavor} GPU"
    else:
        words = "no GPU"
    cpu = (profile.cpu or policy.defaults.cpu) / 1000
    return f"{cpu:g} CPU, {format_memory(profile.memory or policy.defaults.memory)} memory, {words}"


def profile_choices(policy: Policy, groups: Iterable[str]) -> list[dict]:
    """The profiles a member of ``groups`` may use, team by team, as the spawn page offers them.

    Plain data for an API (``GET /hub/api/gpuhub/profiles``): each team's name and label and its
    profiles' slug, name, description, resources and whether it is the one preselected. Only the
    caller's own teams: what another team may use is not theirs to read. Choosing is re-checked
    where it counts (``resolve_choice`` at every start and submission), so this list is a menu,
    never an authority.
    """
    out = []
    for team in teams_for(policy, groups):
        offered = profiles_for(policy, team)
        preselected = next((p for p in offered if p.default), offered[0] if offered else None)
        out.append(
            {
                "name": team.name,
                "displayName": team.label,
                "profiles": [
                    {
                        "slug": p.slug,
                        "displayName": p.display_name,
                        "description": p.description,
                        "resources": profile_resources(policy, p),
                        "gpus": p.gpu_count,
                        "default": p is preselected,
                    }
                    for p in offered
                ],
            }
        )
    return out


def no_team_message(policy: Policy) -> str:
    return (
        "You are not a member of any team on this hub, so there is no server profile you may use. "
        "Ask an administrator to add one of your identity-provider groups to a team in the policy."
    )


def resolve_choice(policy: Policy, groups: Iterable[str], user_options: Mapping | None) -> Choice:
    options = dict(user_options or {})
    unknown = sorted(set(options) - ALLOWED_OPTIONS)
    if unknown:
        raise ChoiceError(
            400,
            f"Unknown server option(s) {', '.join(map(repr, unknown))}: servers are chosen by "
            "'profile' (and 'team' for members of several teams); resources come from the profile.",
        )
    for key in ALLOWED_OPTIONS & set(options):
        if not isinstance(options[key], str):
            raise ChoiceError(400, f"Server option {key!r} must be a string")
    teams = teams_for(policy, groups)
    if not teams:
        raise ChoiceError(403, no_team_message(policy))
    slug = options.get("profile")
    team_name = options.get("team")
    if team_name:
        team = next((t for t in teams if t.name == team_name), None)
        if team is None:
            raise ChoiceError(403, f"You are not a member of team {team_name!r}.")
        candidates = [team]
    else:
        candidates = teams
    if slug:
        profile = policy.profile(slug)
        if profile is None:
            raise ChoiceError(400, f"There is no profile {slug!r}.")
        team = next((t for t in candidates if profile.usable_by(t.name)), None)
        if team is None:
            which = f"team {team_name!r}" if team_name else "your team(s)"
            raise ChoiceError(403, f"Profile {slug!r} is not available to {which}.")
    else:
        team = candidates[0]
        offered = profiles_for(policy, team)
        if not offered:
            raise ChoiceError(403, f"Team {team.name!r} has no profiles.")
        profile = next((p for p in offered if p.default), offered[0])
    pclass = policy.priority_for(team, profile)
    return Choice(team, profile, pclass, policy.priority_value(pclass))


def check_user_caps(choice: Choice, held: Iterable[Profile | None]) -> None:
    """Refuse a start that would take a user past the team's per-user caps.

    ``held`` are the profiles of the user's other servers that are running or waiting
    (``None`` for one whose profile is unknown: a server, with no GPUs we can count).
    Refusing (rather than queueing) is deliberate: waiting for your own server to stop
    would look like a stuck spawn.
    """
    held = list(held)
    caps = choice.team.per_user
    if caps.max_servers is not None and len(held) + 1 > caps.max_servers:
        raise ChoiceError(
            403,
            f"Team {choice.team.name!r} allows {caps.max_servers} server(s) per user and you already "
            f"have {len(held)}. Stop one before starting another.",
        )
    gpus = sum(p.gpu_count for p in held if p is not None)
    if caps.max_gpus is not None and choice.gpu_count and gpus + choice.gpu_count > caps.max_gpus:
        raise ChoiceError(
            403,
            f"Team {choice.team.name!r} allows {caps.max_gpus} GPU(s) per user; you hold {gpus} and "
            f"profile {choice.profile.slug!r} asks for {choice.gpu_count}.",
        )


def check_job_caps(choice: Choice, held: Iterable[Profile | None]) -> None:
    """``check_user_caps`` for a batch job or a Ray cluster: the team's per-user GPU cap, not
    its ``maxServers``.

    ``maxServers`` bounds how many notebook servers a user keeps open at once; a job or a Ray
    cluster is work queued *from* such a server (``gpuhub job submit``, ``gpuhub ray up`` in
    its terminal), so counting the open server against it would refuse every researcher who
    has a notebook open, and a team with ``maxServers: 1`` could never run one. What a job or
    cluster takes is GPUs, and those stay capped: ``held`` (the user's servers, jobs and
    clusters that run or wait) and this request together may not pass ``perUser.maxGPUs``.
    How many unfinished jobs a user may have is the job backend's own limit. Every backend's
    job and Ray manager calls this, so the rule is the same on one machine and on Kubernetes.
    """
    team = choice.team
    uncapped = team.model_copy(update={"per_user": team.per_user.model_copy(update={"max_servers": None})})
    check_user_caps(Choice(uncapped, choice.profile, choice.priority_class, choice.priority), held)


def active_profiles(policy: Policy, user) -> dict[str, Profile | None]:
    """The profile each of ``user``'s running or waiting servers was started with.

    Keyed by server name; ``None`` where the server named no profile (or one since
    removed from the policy). ``user`` is JupyterHub's user wrapper.
    """
    out: dict[str, Profile | None] = {}
    for name, spawner in getattr(user, "spawners", {}).items():
        if spawner.active:  # pending or ready
            slug = (spawner.user_options or {}).get("profile")
            out[name] = policy.profile(slug) if slug else None
    return out
