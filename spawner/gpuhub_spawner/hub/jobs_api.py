"""Hub API and pages for batch jobs.

- ``POST /hub/api/gpuhub/jobs`` ``{"spec": "<job.yaml text>", "filename": "job.yaml"}``: submit.
  400 with located ``issues`` for a bad file; 403/409 with the reason when the team may
  not run it (nothing is queued then); 201 with the record.
- ``GET  /hub/api/gpuhub/jobs``: the caller's jobs (``?all=1``: everyone's, admins).
- ``GET  /hub/api/gpuhub/jobs/<id>``: the record (``status`` starts with the state word).
- ``GET  /hub/api/gpuhub/jobs/<id>/logs?offset=N``: log bytes from N (all attempts, in order).
- ``POST /hub/api/gpuhub/jobs/<id>/cancel`` (or ``DELETE .../<id>``): its GPUs are free on return.
- ``GET  /hub/api/gpuhub/jobs/<id>/notebook[?attempt=N]``: a notebook job's executed notebook
  (a download), and ``/hub/gpuhub/jobs/<id>/notebook`` as a page: the owner's only.
- ``"stop_server": "<name>"`` in a submission stops that server of the submitter once the job is
  queued (its own token, or one with the user's server rights).
- ``/hub/gpuhub/jobs`` and ``/hub/gpuhub/jobs/<id>``: the same as pages.
- ``GET  /hub/api/gpuhub/profiles``: the profiles the caller's teams may use, team by team, in the
  spawn page's words (JupyterLab's "Run as job" picker); the caller's own teams only.

Access is by the *request's* scopes: ``custom:gpuhub:jobs`` filtered to the owner
(every user, their tokens and their servers' tokens), ``custom:gpuhub:jobs:all`` for
admins. Someone else's job answers 404, as JupyterHub does for users.

Submissions are read with bounded work on the hub's event loop (``policy.bounded``): the
body's size is checked before it is decoded (413), a user in no team is refused before
the job file is parsed, and the job file itself is scanned (size, values, depth, no
anchors or aliases) before it is composed. What is shown holds no host paths: logs are
named, not located, and the hub's data directory never appears in a message.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jupyterhub.apihandlers import APIHandler
from jupyterhub.handlers import BaseHandler
from jupyterhub.scopes import Scope
from tornado import web

from ..policy import PolicyError, PolicyStore
from ..policy.access import ChoiceError, no_team_message, profile_choices, teams_for
from ..policy.bounded import MAX_JOB_BODY_BYTES, MAX_JOB_FILE_BYTES, MAX_JOB_FILE_NODES, InputRefused, loads_json
from ..jobs.common import _ts as when
from ..jobs.records import JOB_ID, FINAL
from ..jobs.notebook import MAX_NOTEBOOK_BYTES, load_bounded as notebook_load, render_cells
from ..jobs.spec import parse_job
from .context import app_of

if TYPE_CHECKING:
    from traitlets.config import Config

JOBS = "custom:gpuhub:jobs"
JOBS_ALL = "custom:gpuhub:jobs:all"
ID = r"(job-[0-9a-f]{10})"
# A log chunk is the job's own bytes: 64 KiB of invalid UTF-8 is 192 KB of UTF-8 JSON
# (a few ms to build; 1 MiB as \uXXXX escapes was 6 MB and ~60 ms). `gpuhub job logs`
# reads on from the returned offset.
MAX_LOG_CHUNK = 64 * 1024


def _scrub(value, replacements: list[tuple[str, str]]):
    if isinstance(value, str):
        for old, new in replacements:
            value = value.replace(old, new)
        return value
    if isinstance(value, dict):
        return {k: _scrub(v, replacements) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v, replacements) for v in value]
    return value


class _JobsMixin:
    if TYPE_CHECKING:
        # What jupyterhub's BaseHandler (a tornado RequestHandler) gives the handlers this mixin goes before.
        config: Config
        current_user: Any  # jupyterhub.user.User, or the service (untyped)
        parsed_scopes: dict[str, Any]  # scope -> its filters ({"user": {...}}) or Scope.ALL

        def find_user(self, name: str) -> Any: ...  # jupyterhub.user.User | None

    @property
    def manager(self):
        """This hub's jobs backend (``local.job_manager`` or ``kube.job_manager``)."""
        return app_of(self).jobs(self.config)

    async def fresh(self, rec):
        """On Kubernetes, read the Job back before answering (one machine is always current)."""
        refresh = getattr(self.manager, "refresh", None)
        if refresh is not None and rec.state not in FINAL:
            await refresh(rec)
        return rec

    def _allowed(self, scope: str, owner: str) -> bool:
        f = self.parsed_scopes.get(scope)
        if f is None:
            return False
        if f == Scope.ALL:
            return True
        return owner in f.get("user", ())

    def see_all(self) -> bool:
        # Hub admins: admin:servers implies everyone's jobs (as in policy/scopes.py).
        return self.parsed_scopes.get(JOBS_ALL) == Scope.ALL or self.parsed_scopes.get("admin:servers") == Scope.ALL

    def can_see(self, owner: str) -> bool:
        return self.see_all() or self._allowed(JOBS_ALL, owner) or self._allowed(JOBS, owner)

    def shown(self, rec) -> dict:
        """The record as users see it: no host paths (the hub's data directory, log paths).

        Logs are named (``attempt-2.log``; read them with ``gpuhub job logs``); a message that
        names a file in the user's home says ``~/...``, anything else of the data
        directory says ``<hub data>``. The record on disk keeps the full paths for admins.
        """
        view = self.manager.view(rec)
        for a in view.get("attempts", []):
            for key in ("log", "notebook"):
                if a.get(key):
                    a[key] = os.path.basename(a[key])
        return _scrub(view, self._host_paths(rec))

    def _host_paths(self, rec) -> list[tuple[str, str]]:
        out = []
        data_dir = getattr(self.manager, "data_dir", None)
        if data_dir:
            for root in dict.fromkeys((str(Path(data_dir).resolve()), str(Path(data_dir).absolute()))):
                out += [(f"{root}/home/{rec.user}", "~"), (root, "<hub data>")]
        return out

    def job_for_request(self, job_id: str):
        rec = self.manager.jobs.get(job_id) if JOB_ID.match(job_id) else None
        if rec is None or not self.can_see(rec.user):
            raise web.HTTPError(404, "No such job.")
        return rec

    def owner_only(self, job_id: str):
        """A notebook job's executed notebook: its owner's only (their data, their outputs);
        anyone else, admins included, gets the same 404 as for a job that does not exist."""
        rec = self.manager.jobs.get(job_id) if JOB_ID.match(job_id) else None
        me = getattr(self.current_user, "name", None)
        if rec is None or rec.user != me or getattr(self.current_user, "kind", "user") != "user" or not self._allowed(JOBS, me):
            raise web.HTTPError(404, "No such job.")
        return rec

    def executed_notebook(self, rec, attempt: str | None):
        """The path of an attempt's executed notebook (the last attempt that has one by default)."""
        atts = [a for a in rec.attempts if getattr(a, "notebook", "")]
        if attempt:
            atts = [a for a in atts if str(a.number) == attempt]
        if not atts or not os.path.exists(atts[-1].notebook):
            raise web.HTTPError(404, "This job has no executed notebook (yet).")
        return atts[-1]

    def may_stop_server(self, user, name: str) -> bool:
        """Whether this request may stop ``user``'s server ``name``: a token with the user's
        server rights, or that server's own token (a server may end itself)."""
        for scope in ("delete:servers", "servers"):
            f = self.parsed_scopes.get(scope)
            if f == Scope.ALL or (f and (user.name in f.get("user", ()) or f"{user.name}/{name}" in f.get("server", ()))):
                return True
        f = self.parsed_scopes.get("access:servers")
        return f is not None and f != Scope.ALL and f"{user.name}/{name}" in f.get("server", ())

    def requester(self):
        who = self.current_user
        if who is None or getattr(who, "kind", "user") != "user":
            raise web.HTTPError(403, "Jobs are submitted by users (with their own token or their server's).")
        if not self._allowed(JOBS, who.name):
            raise web.HTTPError(403, f"This needs the scope {JOBS}.")
        return who


class JobsHandler(_JobsMixin, APIHandler):
    @web.authenticated
    def get(self):
        if self.get_argument("all", "") in ("1", "true"):
            jobs = [self.shown(r) for r in self.manager.jobs.values() if self.can_see(r.user)]
        else:
            me = getattr(self.current_user, "name", None)
            jobs = [self.shown(r) for r in self.manager.jobs.values() if r.user == me and self.can_see(me)]
        self.write(json.dumps({"jobs": jobs}))

    @web.authenticated
    async def post(self):
        user = self.requester()
        # Nothing of the body is read before its size is known (413), and a user in no team
        # is refused before their job file is parsed: it could never run.
        try:
            # A job file's flow lists and mappings ([a, b], {A: 1}) count as brackets too.
            body = loads_json(
                self.request.body,
                what="A job submission",
                max_bytes=MAX_JOB_BODY_BYTES,
                max_depth=4,
                max_nodes=64,
                max_containers=MAX_JOB_FILE_NODES + 16,
                empty={},
            )
        except InputRefused as e:
            raise web.HTTPError(e.status, e.message) from None
        policy = PolicyStore.instance(config=self.config).policy  # re-read if the file changed
        if not teams_for(policy, [g.name for g in user.groups]):
            self.log.warning("Refusing %s's job: in no team", user.name)
            raise web.HTTPError(403, no_team_message(policy))
        text = body.get("spec") if isinstance(body, dict) else None
        filename = body.get("filename") if isinstance(body, dict) else None
        filename = os.path.basename(filename)[:200] if isinstance(filename, str) and filename.strip() else "job.yaml"
        if not isinstance(text, str):
            raise web.HTTPError(400, "Send the job file's text as 'spec'.")
        if len(text) > MAX_JOB_FILE_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_JOB_FILE_BYTES:
            raise web.HTTPError(413, f"A job file may have at most {MAX_JOB_FILE_BYTES} bytes.")
        try:
            spec = parse_job(text, filename)
        except PolicyError as e:
            self.set_status(400)
            self.write(
                json.dumps(
                    {
                        "status": 400,
                        "message": f"{filename}: {len(e.issues)} error(s)",
                        "issues": [i.format(filename) for i in e.issues],
                    }
                )
            )
            return
        kinds = getattr(self.manager, "job_kinds", ("command", "notebook"))
        if spec.kind not in kinds:
            raise web.HTTPError(501, f"Jobs of kind {spec.kind!r} do not run on this hub's backend yet (docs/jobs.md).")
        stop = body.get("stop_server") if isinstance(body, dict) else None
        stop = stop if isinstance(stop, str) and len(stop) <= 255 else None
        releasing = stop if stop is not None and self._stoppable(user, stop) else None
        try:
            kwargs = {"releasing": releasing} if releasing is not None else {}
            rec = self.manager.submit(user, [g.name for g in user.groups], spec, **kwargs)
            if inspect.isawaitable(rec):
                rec = await rec
        except ChoiceError as e:
            self.log.warning("Refusing %s's job: %s", user.name, e.message)
            raise web.HTTPError(e.status, e.message) from None
        view = self.shown(rec)
        if stop is not None:
            view["stopped_server"] = await self._stop_server(user, stop)
        self.set_status(201)
        self.write(json.dumps(view))

    def _stoppable(self, user, name: str) -> bool:
        spawner = user.spawners[name] if name in user.spawners else None
        return spawner is not None and spawner.active and self.may_stop_server(user, name)

    async def _stop_server(self, user, name: str) -> str:
        """'and stop my server': free the interactive GPU once the job is queued."""
        spawner = user.spawners[name] if name in user.spawners else None
        if spawner is None or not spawner.active:
            return "no such server running"
        if not self.may_stop_server(user, name):
            return "not stopped: this token may not stop that server"
        self.log.info("Stopping %s's server %r: its owner moved the work to a job", user.name, name)
        # In the background: the answer goes back to the server that asked before it is stopped.
        asyncio.ensure_future(self.stop_single_user(user, name))
        return "stopping"


class ProfilesHandler(_JobsMixin, APIHandler):
    """The spawn page's profile picker as data, for a job's submitter: the teams of the user the
    token belongs to and the profiles each may use (``policy.access.profile_choices``). A menu,
    not an authority: a submission is checked again (``resolve_choice``)."""

    @web.authenticated
    def get(self):
        user = self.requester()
        policy = PolicyStore.instance(config=self.config).policy  # re-read if the file changed
        teams = profile_choices(policy, [g.name for g in user.groups])
        body: dict[str, Any] = {"user": user.name, "teams": teams}
        if not teams:
            body["message"] = no_team_message(policy)
        self.set_header("Cache-Control", "no-store")
        self.write(json.dumps(body))


class JobHandler(_JobsMixin, APIHandler):
    @web.authenticated
    async def get(self, job_id):
        rec = await self.fresh(self.job_for_request(job_id))
        self.write(json.dumps(self.shown(rec)))

    @web.authenticated
    async def delete(self, job_id):
        await self._cancel(job_id)

    async def _cancel(self, job_id):
        rec = self.job_for_request(job_id)
        if rec.state in FINAL:
            self.set_status(409)
            self.write(json.dumps({"status": 409, "message": f"{job_id} already ended ({rec.state})", **self.shown(rec)}))
            return
        await self.manager.cancel(job_id)
        self.write(json.dumps(self.shown(rec)))


class JobCancelHandler(JobHandler):
    @web.authenticated
    async def post(self, job_id):
        await self._cancel(job_id)


class JobLogsHandler(_JobsMixin, APIHandler):
    @web.authenticated
    async def get(self, job_id):
        rec = await self.fresh(self.job_for_request(job_id))
        try:
            offset = max(0, int(self.get_argument("offset", "0")))
        except ValueError:
            raise web.HTTPError(400, "offset must be a whole number") from None
        out, pos = bytearray(), 0
        for path in self.manager.log_files(rec):
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if offset < pos + size and len(out) < MAX_LOG_CHUNK:
                with open(path, "rb") as f:  # noqa: ASYNC230 (at most MAX_LOG_CHUNK of a local file)
                    f.seek(max(0, offset - pos))
                    out += f.read(MAX_LOG_CHUNK - len(out))
            pos += size
        end = max(offset, min(pos, offset + len(out)))
        self.write(
            json.dumps(
                {
                    "text": out.decode(errors="replace"),
                    "offset": end,
                    "state": rec.state,
                    "done": rec.state in FINAL and end >= pos,
                    "status": _scrub(self.manager.status_line(rec), self._host_paths(rec)),
                },
                ensure_ascii=False,
            )
        )


class JobNotebookHandler(_JobsMixin, APIHandler):
    """The executed notebook as a file (``.ipynb``, a download: never rendered by the browser)."""

    @web.authenticated
    def get(self, job_id):
        rec = self.owner_only(job_id)
        att = self.executed_notebook(rec, self.get_argument("attempt", None))
        with open(att.notebook, "rb") as f:  # noqa: ASYNC230 (bounded local file)
            data = f.read(MAX_NOTEBOOK_BYTES + 1)
        if len(data) > MAX_NOTEBOOK_BYTES:
            raise web.HTTPError(413, f"The executed notebook is larger than {MAX_NOTEBOOK_BYTES // 2**20} MiB.")
        self.set_header("Content-Type", "application/x-ipynb+json")
        self.set_header("Content-Disposition", f'attachment; filename="{rec.id}-attempt-{att.number}.ipynb"')
        self.set_header("X-Content-Type-Options", "nosniff")
        self.finish(data)


class JobNotebookPageHandler(_JobsMixin, BaseHandler):
    """The executed notebook as a page: sources and text outputs escaped, PNG/JPEG images;
    no HTML or script of the notebook reaches the hub's origin."""

    @web.authenticated
    async def get(self, job_id):
        rec = self.owner_only(job_id)
        att = self.executed_notebook(rec, self.get_argument("attempt", None))
        nb = await asyncio.to_thread(notebook_load, att.notebook)
        cells = await asyncio.to_thread(render_cells, nb) if nb else None
        html = await self.render_template(
            "gpuhub_job_notebook.html", job=self.shown(rec), attempt=att.number, cells=cells, when=when
        )
        self.finish(html)


class JobsPageHandler(_JobsMixin, BaseHandler):
    @web.authenticated
    async def get(self, job_id=None):
        if job_id:
            rec = await self.fresh(self.job_for_request(job_id))
            html = await self.render_template("gpuhub_jobs.html", job=self.shown(rec), jobs=[], when=when)
        else:
            jobs = [self.shown(r) for r in reversed(list(self.manager.jobs.values())) if self.can_see(r.user)]
            html = await self.render_template("gpuhub_jobs.html", job=None, jobs=jobs, when=when)
        self.finish(html)


handlers = [
    (r"/api/gpuhub/profiles/?", ProfilesHandler),
    (r"/api/gpuhub/jobs/?", JobsHandler),
    (rf"/api/gpuhub/jobs/{ID}", JobHandler),
    (rf"/api/gpuhub/jobs/{ID}/cancel", JobCancelHandler),
    (rf"/api/gpuhub/jobs/{ID}/logs", JobLogsHandler),
    (rf"/api/gpuhub/jobs/{ID}/notebook", JobNotebookHandler),
    (rf"/gpuhub/jobs/{ID}/notebook", JobNotebookPageHandler),
    (r"/gpuhub/jobs/?", JobsPageHandler),
    (rf"/gpuhub/jobs/{ID}", JobsPageHandler),
]
