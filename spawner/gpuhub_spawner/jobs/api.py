"""Hub API and pages for batch jobs.

- ``POST /hub/api/gpuhub/jobs`` ``{"spec": "<job.yaml text>", "filename": "job.yaml"}``: submit.
  400 with located ``issues`` for a bad file; 403/409 with the reason when the team may
  not run it (nothing is queued then); 201 with the record.
- ``GET  /hub/api/gpuhub/jobs``: the caller's jobs (``?all=1``: everyone's, admins).
- ``GET  /hub/api/gpuhub/jobs/<id>``: the record (``status`` starts with the state word).
- ``GET  /hub/api/gpuhub/jobs/<id>/logs?offset=N``: log bytes from N (all attempts, in order).
- ``POST /hub/api/gpuhub/jobs/<id>/cancel`` (or ``DELETE .../<id>``): its GPUs are free on return.
- ``/hub/gpuhub/jobs`` and ``/hub/gpuhub/jobs/<id>``: the same as pages.

Access is by the *request's* scopes: ``custom:gpuhub:jobs`` filtered to the owner
(every user, their tokens and their servers' tokens), ``custom:gpuhub:jobs:all`` for
admins. Someone else's job answers 404, as JupyterHub does for users.
"""

from __future__ import annotations

import inspect
import json

from jupyterhub.apihandlers import APIHandler
from jupyterhub.handlers import BaseHandler
from jupyterhub.scopes import Scope
from tornado import web

from ..policy import PolicyError
from ..policy.access import ChoiceError
from .manager import JobManager
from .records import JOB_ID, FINAL
from .spec import parse_job

JOBS = "custom:gpuhub:jobs"
JOBS_ALL = "custom:gpuhub:jobs:all"
ID = r"(job-[0-9a-f]{10})"
MAX_LOG_CHUNK = 1 << 20


class _JobsMixin:
    @property
    def manager(self) -> JobManager:
        from . import current_manager

        return current_manager(self.config)

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
        # Hub admins: admin:servers implies everyone's jobs (as in hub/scopes.py).
        return self.parsed_scopes.get(JOBS_ALL) == Scope.ALL or self.parsed_scopes.get("admin:servers") == Scope.ALL

    def can_see(self, owner: str) -> bool:
        return self.see_all() or self._allowed(JOBS_ALL, owner) or self._allowed(JOBS, owner)

    def job_for_request(self, job_id: str):
        rec = self.manager.jobs.get(job_id) if JOB_ID.match(job_id) else None
        if rec is None or not self.can_see(rec.user):
            raise web.HTTPError(404, "No such job.")
        return rec

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
            jobs = [self.manager.view(r) for r in self.manager.jobs.values() if self.can_see(r.user)]
        else:
            me = getattr(self.current_user, "name", None)
            jobs = [self.manager.view(r) for r in self.manager.jobs.values() if r.user == me and self.can_see(me)]
        self.write(json.dumps({"jobs": jobs}))

    @web.authenticated
    async def post(self):
        user = self.requester()
        body = self.get_json_body() or {}
        text, filename = body.get("spec"), str(body.get("filename") or "job.yaml")[:200]
        if not isinstance(text, str) or len(text) > 256 * 1024:
            raise web.HTTPError(400, "Send the job file's text as 'spec' (at most 256 KiB).")
        try:
            spec = parse_job(text, filename)
        except PolicyError as e:
            self.set_status(400)
            self.write(json.dumps({
                "status": 400, "message": f"{filename}: {len(e.issues)} error(s)",
                "issues": [i.format(filename) for i in e.issues],
            }))
            return
        try:
            rec = self.manager.submit(user, [g.name for g in user.groups], spec)
            if inspect.isawaitable(rec):
                rec = await rec
        except ChoiceError as e:
            self.log.warning("Refusing %s's job: %s", user.name, e.message)
            raise web.HTTPError(e.status, e.message) from None
        self.set_status(201)
        self.write(json.dumps(self.manager.view(rec)))


class JobHandler(_JobsMixin, APIHandler):
    @web.authenticated
    async def get(self, job_id):
        rec = await self.fresh(self.job_for_request(job_id))
        self.write(json.dumps(self.manager.view(rec)))

    @web.authenticated
    async def delete(self, job_id):
        await self._cancel(job_id)

    async def _cancel(self, job_id):
        rec = self.job_for_request(job_id)
        if rec.state in FINAL:
            self.set_status(409)
            self.write(json.dumps({"status": 409, "message": f"{job_id} already ended ({rec.state})", **self.manager.view(rec)}))
            return
        await self.manager.cancel(job_id)
        self.write(json.dumps(self.manager.view(rec)))


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
                with open(path, "rb") as f:
                    f.seek(max(0, offset - pos))
                    out += f.read(MAX_LOG_CHUNK - len(out))
            pos += size
        end = max(offset, min(pos, offset + len(out)))
        self.write(json.dumps({
            "text": out.decode(errors="replace"), "offset": end, "state": rec.state,
            "done": rec.state in FINAL and end >= pos, "status": self.manager.status_line(rec),
        }))


class JobsPageHandler(_JobsMixin, BaseHandler):
    @web.authenticated
    async def get(self, job_id=None):
        from .manager import _ts as when

        if job_id:
            rec = await self.fresh(self.job_for_request(job_id))
            html = await self.render_template("gpuhub_jobs.html", job=self.manager.view(rec), jobs=[], when=when)
        else:
            jobs = [self.manager.view(r) for r in reversed(list(self.manager.jobs.values())) if self.can_see(r.user)]
            html = await self.render_template("gpuhub_jobs.html", job=None, jobs=jobs, when=when)
        self.finish(html)


handlers = [
    (r"/api/gpuhub/jobs/?", JobsHandler),
    (rf"/api/gpuhub/jobs/{ID}", JobHandler),
    (rf"/api/gpuhub/jobs/{ID}/cancel", JobCancelHandler),
    (rf"/api/gpuhub/jobs/{ID}/logs", JobLogsHandler),
    (r"/gpuhub/jobs/?", JobsPageHandler),
    (rf"/gpuhub/jobs/{ID}", JobsPageHandler),
]
