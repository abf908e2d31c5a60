"""Policy changes from the hub (issue 26): preview an edit's impact, apply it, history, rollback.

- ``GET  /hub/api/gpuhub/policy`` — the policy in force (its version and text), the last load's
  result and the versions (number, hash, who, when, how, summary).
- ``POST /hub/api/gpuhub/policy/preview`` ``{"yaml": ...}`` — the located errors, or the impact in
  plain words (``admission.impact``).
- ``POST /hub/api/gpuhub/policy/apply`` ``{"yaml": ..., "base": HASH, "summary": ...}`` — validated,
  written atomically, versioned, audited with the diff, in force when the answer comes.
- ``POST /hub/api/gpuhub/policy/rollback`` ``{"version": N or HASH}`` — an old version, through
  the same checks; ``"preview": true`` answers its impact without applying it (the page
  previews a rollback and asks to confirm it, as for an edit), ``"base": HASH`` refuses it (409)
  when the policy changed since that preview.
- ``/hub/gpuhub/policy`` — the page.

Who: ``custom:gpuhub:policy`` (admins: implied by ``admin:servers``) previews anything and alone
applies and rolls back. A team lead (``custom:gpuhub:lead``, teams from the live policy) previews
edits of their own teams only, sees only their teams' impact and the policy with profile
environment values masked. Everyone else gets 403. Bodies are bounded before they are parsed
(``policy.bounded``); a refused apply leaves the file and the policy in force as they were.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jupyterhub import orm
from jupyterhub.apihandlers import APIHandler
from jupyterhub.handlers import BaseHandler
from tornado import web

from ..admission.impact import Holding, Person, Request, impact, read_candidate, touched_teams
from ..policy import PolicyStore
from ..policy.bounded import InputRefused, loads_json
from ..policy.scopes import LEAD, POLICY, allowed
from ..usage.policy_text import masked_text_as_written
from ..usage.policy_versions import MASK, PolicyVersions, VersionNotFound, text_hash
from .context import PolicyChanges, app_of

if TYPE_CHECKING:
    from tornado.httputil import HTTPServerRequest
    from traitlets.config import Config

MAX_BODY_BYTES = 256 * 1024  # the hub's limit for every request body (policy.bounded)

log = logging.getLogger("JupyterHub.gpuhub.policy")
# The state between requests is the hub's (hub/context.py, PolicyChanges): evaluations (parse,
# impact), masking and applies run in its one thread, one at a time: never in the default pool
# that spawns (ensure_account), reloads and the culler share, never on the hub's loop.


def off_loop(changes: PolicyChanges, fn, *args):
    return asyncio.get_running_loop().run_in_executor(changes.executor, fn, *args)


async def masked_of(changes: PolicyChanges, text: str) -> str | None:
    """The masked text of ``text`` as the admin wrote it (comments and layout kept), computed once
    per hash, in the policy executor."""
    h = text_hash(text)
    masked = changes.masked
    if h not in masked:
        value = await off_loop(changes, masked_text_as_written, text)
        if len(masked) >= changes.MASKED_KEPT:
            masked.pop(next(iter(masked)))
        masked[h] = value
    return masked[h]


def start_versions(hub, directory: str, writer=None) -> PolicyVersions:
    """At hub start (``wiring``): the versions store of this hub's policy file, following its
    reloads. ``writer``: where applies write when not that file (Kubernetes: the ConfigMap)."""
    store = PolicyStore.instance(config=hub.config)
    versions = PolicyVersions(directory, store.policy_file, writer)
    versions.follow(store)
    app_of(hub.tornado_settings).policy_changes.versions = versions
    return versions


class _PolicyMixin:
    if TYPE_CHECKING:
        # What jupyterhub's BaseHandler (a tornado RequestHandler) gives the handlers this mixin goes before.
        config: Config
        current_user: Any  # jupyterhub.user.User, or the service (untyped)
        request: HTTPServerRequest
        db: Any  # the hub's SQLAlchemy session

        def find_user(self, name: str) -> Any: ...  # jupyterhub.user.User | None

    @property
    def changes(self) -> PolicyChanges:
        return app_of(self).policy_changes

    def versions(self) -> PolicyVersions:
        if self.changes.versions is None:
            raise web.HTTPError(503, "policy versions are not set up on this hub")
        return self.changes.versions

    @property
    def store(self) -> PolicyStore:
        return PolicyStore.instance(config=self.config)

    def reader(self) -> tuple[bool, set[str]]:
        """(may apply, the teams the reader leads); 403 for anyone else."""
        admin = allowed(self, POLICY)
        user = self.current_user
        groups = {g.name for g in getattr(user, "groups", [])} if getattr(user, "kind", "user") == "user" else set()
        leads = {t.name for t in self.store.current.teams if groups & set(t.leads)} if allowed(self, LEAD) else set()
        if not admin and not leads:
            raise web.HTTPError(
                403,
                "Only admins and team leads may see and preview policy changes "
                f"(scope {POLICY}, or {LEAD} for a team the policy says you lead).",
            )
        return admin, leads

    def body(self) -> dict:
        try:
            # The YAML travels as one JSON string; its own brackets count towards the containers
            # bound (an upper bound, counted before decoding: policy.bounded's default, 10,000).
            data = loads_json(self.request.body, max_bytes=MAX_BODY_BYTES, empty={})
        except InputRefused as e:
            raise web.HTTPError(e.status, e.message) from None
        if not isinstance(data, dict):
            raise web.HTTPError(400, "the request body must be a JSON object")
        return data

    def current_text(self) -> str:
        try:
            return Path(self.store.policy_file).read_text()
        except OSError as e:
            raise web.HTTPError(500, f"cannot read the policy file: {e.strerror}") from None

    def state(self) -> dict:
        """The hub's users, what is admitted and what waits: the impact's inputs (on the loop)."""
        people = [Person(u.name, tuple(g.name for g in u.groups)) for u in self.db.query(orm.User)]
        view = app_of(self).admission_view(self.config)
        queue = view.queue
        held = [
            Holding(a.key, a.user, a.team, a.profile, dict(a.demand), a.since, a.priority, self._last_activity(a.key))
            for a in queue.holdings()
        ]
        waiting = [Request(t.key, t.user, t.team, t.profile, dict(t.demand), t.priority, t.created) for t in queue.waiting]
        free = None
        table = getattr(view, "devices", None)
        if table is not None:
            free = {f"gpu/{f.name}": len(table.free_devices(f.name)) for f in self.store.current.flavors}
        return {"people": people, "holdings": held, "waiting": waiting, "free_devices": free}

    def _last_activity(self, key: str):
        if key.startswith("job:"):
            return None
        name, _, server = key.partition("/")
        user = self.find_user(name)
        spawner = user.orm_spawners.get(server) if user is not None else None
        last = getattr(spawner, "last_activity", None)
        if last is None:
            return None
        from datetime import timezone

        return (last if last.tzinfo else last.replace(tzinfo=timezone.utc)).timestamp()

    async def evaluate(self, text: str, admin: bool, leads: set[str]) -> dict:
        """Located errors first; else the impact (a lead's: their teams', or a refusal with the reason).
        One evaluation per user at a time (429), in the policy executor; a lead's edit of another
        team is refused from the touched teams alone, before any impact is computed."""
        who = getattr(self.current_user, "name", "?")
        in_flight = self.changes.in_flight
        if who in in_flight:
            raise web.HTTPError(429, "You already have a policy change being checked: wait for its answer, then try again.")
        in_flight.add(who)
        try:
            return await self._evaluate(text, admin, leads)
        finally:
            in_flight.discard(who)

    async def _evaluate(self, text: str, admin: bool, leads: set[str]) -> dict:
        current = self.store.current
        state = self.state()
        insiders = {p.name for p in state["people"] if {t.name for t in current.teams if set(p.groups) & set(t.groups)} & leads}
        app = app_of(self)
        config = self.config
        new_warnings: list[str] = []  # the candidate's warnings the policy in force does not have

        def work():
            policy, errors = read_candidate(text)
            if policy is None:
                return None, errors, None
            literal = () if admin else _literal_env(policy)
            policy = _unmask(policy, current)  # '***' keeps the value in force, for everyone
            if not admin:  # cheap (teams + profiles): refuse before computing any impact
                # Her own team's entries: what she may edit; the cohort's other teams are only affected.
                touched, everyone = touched_teams(current, policy, literal, cohorts=False)
                outside = sorted(touched - leads)
                if everyone or outside:
                    why = "; ".join(everyone + ([f"it changes team(s) you do not lead: {', '.join(outside)}"] if outside else []))
                    return (
                        None,
                        None,
                        f"A team lead may preview changes to their own team(s) ({', '.join(sorted(leads))}) only: {why}.",
                    )
            found = impact(current, policy, literal_env=literal, **state)
            already = set(app.policy_warnings(config, current))
            for warning in app.policy_warnings(config, policy):  # what `gpuhub validate` says, here too
                found.add("warnings", warning, teams=found.touched_teams)
                if warning not in already:
                    new_warnings.append(warning)
            try:  # the backend's own objects the edit changes (Kubernetes: Kueue's), and what it refuses
                for words, teams in app.backend_changes(current, policy) or []:
                    found.add("kueue", words, teams=teams)
            except ValueError as e:  # a flavor named like the CPU flavor: render refuses it
                found.add("kueue", f"The Kueue objects cannot be rendered: {e}.", teams=found.touched_teams)
            return policy, [], found

        policy, errors, found = await off_loop(self.changes, work)
        if errors is None:
            raise web.HTTPError(403, found)
        if errors:
            status = max((e.get("status", 400) for e in errors), default=400)
            return {"ok": False, "status": status, "errors": errors}
        if not admin:
            # The effect on the other teams of her cohort(s), read-only, their people not named.
            peers = {m.name for t in current.teams if t.name in leads and t.cohort for m in current.cohort_members(t)}
            found = found.for_lead(leads | peers, insiders)
        return {"ok": True, "policy": policy, "impact": found, "new_warnings": new_warnings}


def _literal_env(policy) -> set[str]:
    """Slugs of profiles with an environment value other than the mask: for a lead, a change of that
    profile whatever its value (so a preview never tells whether a guessed secret is right)."""
    return {p.slug for p in policy.profiles if any(v != MASK for v in p.env.values())}


def _unmask(policy, current):
    """Masked environment values ('***') in a candidate mean the values in force."""
    profiles = []
    changed = False
    for p in policy.profiles:
        old = current.profile(p.slug)
        if old is not None and any(v == MASK and k in old.env for k, v in p.env.items()):
            p = p.model_copy(update={"env": {k: (old.env[k] if v == MASK and k in old.env else v) for k, v in p.env.items()}})
            changed = True
        profiles.append(p)
    return policy.model_copy(update={"profiles": profiles}) if changed else policy


def unmask_text(text: str, current) -> str:
    """``text`` with each masked environment value ('***') of a profile in force replaced by the value
    in force, in place (the rest of the text, comments included, as written): what an apply writes."""
    if MASK not in text:
        return text
    import yaml

    root = yaml.compose(text, Loader=yaml.SafeLoader)  # marks in characters (the text is bounded, parsed before)
    spans = []

    def get(node, key):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value == key:
                    return v
        return None

    profiles = get(root, "profiles")
    for p in profiles.value if isinstance(profiles, yaml.SequenceNode) else []:
        slug, env = get(p, "slug"), get(p, "env")
        old = current.profile(slug.value) if isinstance(slug, yaml.ScalarNode) else None
        if old is None or not isinstance(env, yaml.MappingNode):
            continue
        for k, v in env.value:
            if isinstance(v, yaml.ScalarNode) and v.value == MASK and k.value in old.env:
                spans.append((v.start_mark.index, v.end_mark.index, json.dumps(str(old.env[k.value]))))
    for start, end, value in sorted(spans, reverse=True):
        text = text[:start] + value + text[end:]
    return text


class PolicyAPIHandler(_PolicyMixin, APIHandler):
    @web.authenticated
    async def get(self):
        admin, leads = self.reader()
        text = self.current_text()
        vs = self.versions()
        latest = vs.latest()
        current = dict(latest) if latest and latest["hash"] == text_hash(text) else None
        note = None
        if admin:
            shown = text
            history = list(reversed(vs.versions()))
        else:
            shown = await masked_of(self.changes, text)
            if shown is None:  # never the raw text: the last version that parses, masked
                note = "The policy file on disk does not parse"
                for v in reversed(vs.versions()):
                    try:
                        shown = await masked_of(self.changes, vs.text_of(v))
                    except OSError:
                        continue
                    if shown is not None:
                        note += f"; shown is version {v['n']}, the last that does"
                        break
                note += "."
            history = [_for_lead(v, leads) for v in reversed(vs.versions())]
        self.set_header("Content-Type", "application/json")
        self.write(
            json.dumps(
                {
                    "role": "admin" if admin else "lead",
                    "lead_teams": sorted(leads),
                    "may_apply": admin,
                    "version": current if admin or current is None else _for_lead(current, leads),
                    "hash": text_hash(text),
                    "path": self.store.policy_file if admin else None,
                    "text": shown,
                    "note": note,
                    "status": self.store.status.as_dict()
                    if admin
                    else {k: v for k, v in self.store.status.as_dict().items() if k in ("loaded_at", "stale", "failed_at")},
                    "versions": history,
                }
            )
        )


def _for_lead(version: dict, leads: set[str]) -> dict:
    """A version as a lead sees it: number, hash, who, when, how; its summary only when all it
    changed is the lead's own teams (recorded at the apply)."""
    out = {k: version[k] for k in ("n", "hash", "by", "at", "source") if k in version}
    teams = version.get("teams")
    if isinstance(teams, list) and teams and set(teams) <= leads and not version.get("every_team"):
        out["summary"] = version.get("summary")
    return out


class PolicyActionHandler(_PolicyMixin, APIHandler):
    @web.authenticated
    async def post(self, action: str):
        admin, leads = self.reader()
        body = self.body()
        if action != "preview" and not admin:
            raise web.HTTPError(
                403, f"Only admins may {action} the policy (scope {POLICY}); team leads may preview changes to their own team."
            )
        rollback_to = None
        if action == "rollback":
            ref = body.get("version")
            if not isinstance(ref, (str, int)) or isinstance(ref, bool) or len(str(ref)) > 64:
                raise web.HTTPError(400, 'say which version: {"version": 3} or a hash')
            try:
                rollback_to = self.versions().find(ref)
                text = self.versions().text_of(rollback_to)
            except VersionNotFound as e:
                raise web.HTTPError(404, str(e)) from None
        else:
            sent = body.get("yaml")
            if not isinstance(sent, str):
                raise web.HTTPError(400, 'send the new policy as {"yaml": "..."}')
            text = sent
        # The policy in force is the file's: an edit on disk the store has not re-read yet takes
        # effect (and enters the history) first, so the impact and the summary are measured
        # against what is really in force, not against the text before that edit.
        current = await self.store.fresh()
        checked_against = text_hash(self.current_text())
        result = await self.evaluate(text, admin, leads)
        self.set_header("Content-Type", "application/json")
        if not result["ok"]:
            self.set_status(result["status"])
            self.write(
                json.dumps(
                    {
                        "ok": False,
                        "message": f"the new policy has {len(result['errors'])} error(s); nothing was applied"
                        if action != "preview"
                        else f"the new policy has {len(result['errors'])} error(s)",
                        "errors": result["errors"],
                        "issues": [e["text"] for e in result["errors"]],
                    }
                )
            )
            return
        found = result["impact"]
        confirm = result["new_warnings"]  # applying them needs "force": the admin saw and accepted them
        if action == "preview" or (action == "rollback" and body.get("preview") is True):
            self.write(
                json.dumps(
                    {
                        "ok": True,
                        "impact": found.as_dict(),
                        "text": found.text(),
                        "base": text_hash(self.current_text()),
                        "confirm": confirm,
                    }
                )
            )
            return
        if confirm and body.get("force") is not True:
            raise web.HTTPError(
                409,
                "the new policy promises what this hub cannot keep: "
                + "; ".join(confirm)
                + ". Nothing was applied: confirm to apply it anyway (the page asks; the CLI takes --force).",
            )
        text = await off_loop(self.changes, unmask_text, text, current)  # masked values ('***') keep the values in force
        if self.changes.apply_lock is None:
            self.changes.apply_lock = asyncio.Lock()
        async with self.changes.apply_lock:
            before = self.current_text()
            base = body.get("base")
            if action in ("apply", "rollback") and isinstance(base, str) and base and base != text_hash(before):
                raise web.HTTPError(
                    409,
                    f"the policy changed since your preview (it is now {text_hash(before)}, "
                    f"you previewed against {base[:12]}): preview again",
                )
            if text_hash(before) != checked_against:
                raise web.HTTPError(409, "the policy changed while this was checked: preview again")
            if text_hash(text) == text_hash(before):
                raise web.HTTPError(409, "nothing to apply: this is the policy in force")
            summary = body.get("summary")
            if not isinstance(summary, str) or not summary.strip():
                summary = (f"rollback to version {rollback_to['n']}: " if rollback_to else "") + found.one_line()
            summary = re.sub(r"\s+", " ", summary).strip()[:200]
            by = getattr(self.current_user, "name", "?")
            try:  # the write, its fsyncs and the audited diff off the loop
                version = await off_loop(
                    self.changes,
                    lambda: self.versions().apply(
                        text,
                        by,
                        summary,
                        rollback_to=rollback_to,
                        expected_hash=text_hash(before),
                        teams=sorted(found.touched_teams),
                        every_team=bool(found.global_changes),
                    ),
                )
            except OSError as e:
                raise web.HTTPError(
                    409,
                    f"cannot write the policy file {self.store.policy_file}: {e.strerror}; nothing "
                    "was applied (on Kubernetes the hub writes the policy's ConfigMap once "
                    "wired for it: docs/policy-changes.md)",
                ) from None
            except RuntimeError as e:  # the writer's place changed under it (the ConfigMap): nothing written
                raise web.HTTPError(409, str(e)) from None
            except Exception as e:  # noqa: BLE001 - the API server refused (RBAC, unreachable): nothing written
                log.warning("Policy apply by %s failed at %s: %s", by, self.versions().where, e)
                raise web.HTTPError(
                    502,
                    f"could not write the policy to {self.versions().where}: "
                    f"{getattr(e, 'reason', None) or type(e).__name__}; nothing was applied",
                ) from None
            await self.store.fresh()
        status = self.store.status
        self.write(
            json.dumps(
                {
                    "ok": not status.stale,
                    "version": version,
                    "impact": found.as_dict(),
                    "text": found.text(),
                    "status": status.as_dict(),
                }
            )
        )


class PolicyPageHandler(_PolicyMixin, BaseHandler):
    @web.authenticated
    async def get(self):
        admin, leads = self.reader()
        self.finish(await self.render_template("gpuhub_policy.html", may_apply=admin, lead_teams=sorted(leads)))


handlers = [
    (r"/gpuhub/policy/?", PolicyPageHandler),
    (r"/api/gpuhub/policy/?", PolicyAPIHandler),
    (r"/api/gpuhub/policy/(preview|apply|rollback)", PolicyActionHandler),
]
