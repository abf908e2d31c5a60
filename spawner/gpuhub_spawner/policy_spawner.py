"""What both gpuhub spawners share: the profile form, the server-side re-check, env.

A mixin placed before the backend's spawner class (``LocalProcessSpawner`` or
``KubeSpawner``). It knows nothing about admission; backends call
``resolve_request()`` at the top of ``start()`` and refuse on error.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

from tornado import web

from .policy import PolicyStore
from .policy.access import (
    Choice,
    ChoiceError,
    active_profiles,
    check_user_caps,
    no_team_message,
    profile_resources,
    profiles_for,
    resolve_choice,
    teams_for,
)
from .policy.bounded import InputRefused, check_options, preview
from .policy.model import Policy, Profile
from .usage import recorder as usage

if TYPE_CHECKING:
    import logging

    from traitlets.config import Config


class PolicySpawnerMixin:
    """Profiles filtered by team, re-validated at start; identity env for the server."""

    choice: Choice | None = None

    if TYPE_CHECKING:
        # What the spawner class this mixin goes before provides (jupyterhub.spawner.Spawner).
        config: Config
        log: logging.Logger
        user: Any  # jupyterhub.user.User (untyped)
        name: str  # the server's name, "" for the default server
        user_options: dict[str, Any]
        db: Any  # the hub's SQLAlchemy session

    @property
    def policy_store(self) -> PolicyStore:
        return PolicyStore.instance(config=self.config)

    @property
    def policy(self) -> Policy:
        return self.policy_store.policy

    @property
    def user_groups(self) -> list[str]:
        return [g.name for g in getattr(self.user, "groups", [])]

    # -- the form ------------------------------------------------------------------------
    def profile_status_hook(self, team, profile: Profile) -> str:
        """Plain-text availability shown next to a profile (backends override)."""
        return ""

    def profile_unavailable_hook(self, team, profile: Profile) -> str:
        """Why this deployment can never serve ``profile`` for ``team`` ('' when it can): the form
        greys the profile out with these words instead of offering a start that is refused
        (backends override; a start is re-checked whatever the form showed)."""
        return ""

    async def get_options_form(self) -> str:
        return self.render_options_form()

    def render_options_form(self) -> str:
        policy = self.policy
        teams = teams_for(policy, self.user_groups)
        if not teams:
            if set(self.user_groups) & set(policy.roles.viewers):
                # A viewer starts nothing: what they came for is usage (and MLflow's runs).
                base = getattr(getattr(self, "hub", None), "base_url", "/hub/")
                return (
                    '<div class="alert alert-info" id="gpuhub-viewer">You are a <strong>viewer</strong> on this hub: '
                    "you see every team's GPU usage and counts (and, in MLflow, their runs), and you start no "
                    f'servers. <a class="btn btn-sm btn-primary" href="{html.escape(base)}gpuhub/usage">'
                    "Open the usage page</a></div>"
                )
            return f'<div class="alert alert-warning" id="gpuhub-no-team">{html.escape(no_team_message(policy))}</div>'
        parts = ['<div id="gpuhub-profiles">']
        if len(teams) > 1:
            opts = "".join(f'<option value="{html.escape(t.name)}">{html.escape(t.label)}</option>' for t in teams)
            parts.append(
                '<div class="mb-3"><label for="gpuhub-team" class="form-label">Team</label>'
                f'<select class="form-select" name="team" id="gpuhub-team">{opts}</select>'
                '<div class="form-text">Your servers count against the chosen team\'s quota.</div></div>'
            )
        for team in teams:
            hidden = "" if team is teams[0] else ' style="display:none"'
            parts.append(f'<fieldset class="gpuhub-team" data-team="{html.escape(team.name)}"{hidden}>')
            offered = profiles_for(policy, team)
            unavailable = {p.slug: self.profile_unavailable_hook(team, p) for p in offered}
            usable = [p for p in offered if not unavailable[p.slug]]
            preselected = next((p for p in usable if p.default), usable[0] if usable else None)
            for profile in offered:
                checked = " checked" if team is teams[0] and profile is preselected else ""
                why_not = unavailable[profile.slug]
                res = html.escape(profile_resources(policy, profile))
                status = "" if why_not else self.profile_status_hook(team, profile)
                pid = f"gpuhub-profile-{team.name}-{profile.slug}"
                parts.append(
                    f'<div class="form-check mb-2{" gpuhub-profile-unavailable text-muted" if why_not else ""}">'
                    f'<input class="form-check-input" type="radio" name="profile" id="{pid}" '
                    f'value="{html.escape(profile.slug)}" data-team="{html.escape(team.name)}"{checked}'
                    + (' disabled data-unavailable="1"' if why_not else "")
                    + ">"
                    f'<label class="form-check-label" for="{pid}"><strong>{html.escape(profile.display_name)}</strong> '
                    f'<small class="text-muted">({res})</small><br>{html.escape(profile.description)}'
                    + (f'<br><small class="gpuhub-availability">{html.escape(status)}</small>' if status else "")
                    + (
                        f'<br><small class="gpuhub-unavailable">Not offered here: {html.escape(why_not)}</small>'
                        if why_not
                        else ""
                    )
                    + "</label></div>"
                )
            parts.append("</fieldset>")
        parts.append("</div>")
        if len(teams) > 1:
            parts.append(
                "<script>(function(){var s=document.getElementById('gpuhub-team');"
                "function show(){var t=s.value;document.querySelectorAll('fieldset.gpuhub-team').forEach(function(f){"
                "var on=f.dataset.team===t;f.style.display=on?'':'none';f.querySelectorAll('input').forEach(function(i){i.disabled=!on||i.dataset.unavailable==='1';});"
                "if(on&&!f.querySelector('input:checked')){var i=f.querySelector('input:not([disabled])');if(i)i.checked=true;}});}"
                "s.addEventListener('change',show);show();})();</script>"
            )
        return "".join(parts)

    def options_from_form(self, formdata):
        options = {}
        for key in ("profile", "team"):
            values = formdata.get(key)
            if values:
                options[key] = values[0]
        try:
            check_options(options)  # small before anything keeps, logs or echoes them
        except InputRefused as e:
            raise web.HTTPError(e.status, e.message, reason="Bad server options") from None
        return options

    # -- the server-side re-check -------------------------------------------------------
    def held_profiles(self) -> list[Profile | None]:
        """Profiles of this user's other servers that are running or waiting.

        ``None`` for a server whose profile is unknown (removed from the policy): it still
        counts as a server against ``maxServers``. A pending server whose request is not
        resolved yet is left out: it is checked itself when it gets here, and resolution
        (below) happens without yielding, so concurrent starts are counted one by one.
        """
        resolved = {name for name, sp in getattr(self.user, "spawners", {}).items() if "profile" in (sp.user_options or {})}
        profiles = active_profiles(self.policy, self.user)
        return [p for name, p in profiles.items() if name != self.name and name in resolved]

    def resolve_request(self) -> Choice:
        """Validate ``user_options`` against the live policy; raise HTTP 4xx on refusal.

        The resolved choice (the default profile and team filled in) replaces
        ``user_options`` before anything else happens, in memory and in the hub's
        database, so caps, culling, status pages and metrics all read one record — a
        request that left ``profile`` out cannot slip past them.
        """
        try:
            try:
                # REST user_options come as any JSON object: bounded before they are read,
                # echoed in a message or kept in the audit trail.
                check_options(self.user_options)
            except InputRefused as e:
                raise ChoiceError(e.status, e.message) from None
            choice = resolve_choice(self.policy, self.user_groups, self.user_options)
            check_user_caps(choice, self.held_profiles())
        except ChoiceError as e:
            self.log.warning("Refusing %s's server: %s", self.user.name, e.message)
            usage.audit(
                "refused",
                key=f"{self.user.name}/{self.name}",
                user=self.user.name,
                requested=preview(self.user_options or {}),
                reason=e.message,
                status=e.status,
            )
            raise web.HTTPError(e.status, e.message, reason=e.message) from None
        self.record_choice(choice)
        return choice

    def record_choice(self, choice: Choice) -> None:
        self.choice = choice
        resolved = {"profile": choice.profile.slug, "team": choice.team.name}
        if self.user_options != resolved:
            self.user_options = resolved
            orm = getattr(self, "orm_spawner", None)
            if orm is not None:
                orm.user_options = resolved
                self.db.commit()

    def get_state(self):
        state = super().get_state()
        if self.choice is not None:
            state["gpuhub_choice"] = {"profile": self.choice.profile.slug, "team": self.choice.team.name}
        return state

    def choice_environment(self, choice: Choice) -> dict[str, str]:
        profile = choice.profile
        env = dict(profile.env)
        env.update(
            GPUHUB_USER=self.user.name,
            GPUHUB_TEAM=choice.team.name,
            GPUHUB_PROFILE=profile.slug,
            GPUHUB_IMAGE=profile.image or self.policy.defaults.image,
            GPUHUB_GPU_COUNT=str(choice.gpu_count),
            GPUHUB_GPU_FLAVOR=choice.flavor or "",
            GPUHUB_SERVER_NAME=self.name or "",
        )
        return env
