"""``gpuhub loadtest --jobs``: the job file it sends, the figures it reads from the hub's record,
the report and its comparison, and the submit/follow/cancel client against a stand-in of the
hub's jobs API (``hub/jobs_api.py``'s routes and answers). The real hub: tests/integration/test_loadtest.py."""

from __future__ import annotations

import argparse
import json
import time

import pytest
from tornado import web
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets

from gpuhub_spawner.jobs.spec import parse_job
from gpuhub_spawner.ops import loadtest as L


def args(**kw):
    base = dict(
        users=4,
        jobs=2,
        mix=[L.Mix("load-team", "gpu-1")],
        job_profile=None,
        job_command="sleep 1",
        deadline=60.0,
        cleanup_timeout=30.0,
    )
    base.update(kw)
    return argparse.Namespace(**base)


def test_the_job_file_is_one_a_researcher_could_submit_with_a_time_limit_past_the_cleanup():
    a = args(prefix="lt-")
    users = L.plan(a)
    assert [u.job is not None for u in users] == [True, True, False, False]  # the first --jobs users
    assert users[0].job.profile == "gpu-1"
    spec = parse_job(L.job_spec(users[0], a, 42.7))
    assert (
        spec.profile == "gpu-1" and spec.argv == ["/bin/sh", "-c", "sleep 1"] and spec.time_limit == 42 + 30 + 60
    )  # the deadline, the cleanup, a minute
    assert L.plan(args(prefix="lt-", job_profile="cpu"))[1].job.profile == "cpu"


def test_command_line_problems_are_named_before_anything_is_sent():
    assert "between 0 and --users" in L._job_problems(args(jobs=5))[0]
    assert "--job-profile" in L._job_problems(args(mix=[L.Mix("students", None)]))[0]
    assert L._job_problems(args(mix=[L.Mix("students", None)], job_profile="cpu")) == []
    assert "not a valid shell command" in L._job_problems(args(job_command="'open"))[0]
    assert L._job_problems(args(jobs=0, mix=[L.Mix("students", None)])) == []


def test_figures_come_from_the_hubs_record():
    job = L.JobRun("gpu-1")
    L.job_figures(
        job,
        {
            "state": "succeeded",
            "submitted": 100.0,
            "finished": 130.0,
            "attempts": [{"started": 110.0, "reason": "preempted"}, {"started": 120.0, "reason": "succeeded"}],
        },
    )
    assert (job.queue_seconds, job.run_seconds, job.attempts, job.preempted) == (10.0, 20.0, 2, 1)
    queued = L.JobRun("gpu-1")
    L.job_figures(queued, {"state": "queued", "submitted": 100.0, "attempts": [{"queued": 100.0}]})
    assert queued.queue_seconds is None and queued.run_seconds is None
    assert L._route("/hub/api/gpuhub/jobs/job-0123456789/cancel") == "/hub/api/gpuhub/jobs/{id}/cancel"


def report(jobs: dict | None, run_median: float | None) -> dict:
    return {
        "users": 2,
        "shape": "storm",
        "hub": "http://h",
        "wall_seconds": 9.0,
        "completed": 2,
        "errors": {
            "http": {},
            "timeouts": 0,
            "connection": 0,
            "failed_spawns": 0,
            "failed_cells": 0,
            "users_failed": 0,
            "first_failures": [],
        },
        "job_run_seconds": {"n": 2, "median": run_median, "p95": run_median, "max": run_median} if run_median else None,
        "jobs": jobs,
    }


JOBS = {
    "requested": 2,
    "command": "sleep 1",
    "profiles": ["gpu-1"],
    "submitted": 2,
    "refused": 0,
    "succeeded": 2,
    "failed": 0,
    "cancelled": 0,
    "cancelled_at_deadline": 0,
    "preempted_attempts": 0,
    "http_errors": {"503 POST /hub/api/gpuhub/jobs": 1},
    "transport_errors": 0,
}


def test_the_table_shows_job_figures_and_compares_them_with_a_baseline():
    text = L.table(report(JOBS, 4.0), report(dict(JOBS, succeeded=1), 2.0))
    row = next(line for line in text.splitlines() if "job_run_seconds median" in line)
    assert row.split()[-3:] == ["4.0", "2.0", "2.00x"]
    assert "jobs: 2 of 2 submitted (gpu-1: 'sleep 1'), 2 succeeded" in text
    assert "jobs API errors: http 1" in text and "jobs before: 2 submitted, 1 succeeded" in text
    # A run without jobs, compared with one that had them: no job rows.
    assert "jobs" not in L.table(report(None, None), report(JOBS, 2.0))


# -- the client against a stand-in of the hub's jobs API ---------------------------------------
class FakeJobs:
    """``POST /jobs`` (201, the record), ``GET /jobs``, ``GET /jobs/<id>``, ``POST /jobs/<id>/cancel``,
    for one token. A job runs ``run_for`` seconds after it was submitted, or forever."""

    def __init__(self, run_for: float | None, refuse: int | None = None):
        self.run_for, self.refuse, self.jobs, self.specs, self.cancels = run_for, refuse, {}, [], []

    def record(self, job_id: str) -> dict:
        rec = self.jobs[job_id]
        now = time.time()
        if rec["state"] == "running" and self.run_for is not None and now >= rec["submitted"] + 0.1 + self.run_for:
            rec.update(state="succeeded", finished=rec["submitted"] + 0.1 + self.run_for, status="succeeded")
        return dict(rec)

    def app(self) -> web.Application:
        fake = self

        class Jobs(web.RequestHandler):
            def post(self):
                assert self.request.headers["Authorization"] == "token user-token"
                if fake.refuse:
                    self.set_status(fake.refuse)
                    self.finish({"status": fake.refuse, "message": "your team may not use this profile"})
                    return
                fake.specs.append(parse_job(json.loads(self.request.body)["spec"]))
                job_id = f"job-{len(fake.jobs):010x}"
                t = time.time()
                fake.jobs[job_id] = {
                    "id": job_id,
                    "user": "lt-0000",
                    "state": "running",
                    "submitted": t,
                    "finished": None,
                    "attempts": [{"started": t + 0.1}],
                    "status": "running",
                }
                self.set_status(201)
                self.finish(fake.record(job_id))

            def get(self):
                self.finish({"jobs": [fake.record(j) for j in fake.jobs]})

        class Job(web.RequestHandler):
            def get(self, job_id):
                self.finish(fake.record(job_id))

        class Cancel(web.RequestHandler):
            def post(self, job_id):
                fake.cancels.append(job_id)
                fake.jobs[job_id].update(state="cancelled", finished=time.time(), status="cancelled: by its owner")
                self.finish(fake.record(job_id))

        return web.Application(
            [
                (r"/hub/api/gpuhub/jobs", Jobs),
                (r"/hub/api/gpuhub/jobs/(job-[0-9a-f]+)", Job),
                (r"/hub/api/gpuhub/jobs/(job-[0-9a-f]+)/cancel", Cancel),
            ]
        )


async def against(fake: FakeJobs, deadline_in: float, poll: float = 0.2):
    [sock] = bind_sockets(0, "127.0.0.1")
    server = HTTPServer(fake.app())
    server.add_sockets([sock])
    api = L.Api(f"http://127.0.0.1:{sock.getsockname()[1]}", "admin-token", timeout=10, max_clients=4)
    a = args(prefix="lt-", users=1, jobs=1)
    user = L.plan(a)[0]
    user.name, user.token = "lt-0000", "user-token"
    old = L.JOB_POLL_SECONDS
    L.JOB_POLL_SECONDS = poll
    try:
        await L._run_job(api, user, a, time.monotonic() + deadline_in)
        left = await L._cancel_jobs(api, user, time.monotonic() + 5)
        return user, api, left
    finally:
        L.JOB_POLL_SECONDS = old
        api.close()
        server.stop()


async def test_a_job_is_followed_to_its_end_from_the_record():
    fake = FakeJobs(run_for=0.5)
    user, api, left = await against(fake, deadline_in=10)
    job = user.job
    assert job.state == "succeeded" and job.error is None and left == [] and fake.cancels == []
    assert job.queue_seconds == pytest.approx(0.1, abs=0.01) and job.run_seconds == pytest.approx(0.5, abs=0.01)
    assert fake.specs[0].profile == "gpu-1" and 60 < fake.specs[0].time_limit <= 10 + 30 + 60


async def test_a_job_unfinished_at_the_deadline_is_cancelled_by_the_cleanup():
    fake = FakeJobs(run_for=None)
    user, api, left = await against(fake, deadline_in=1.0)
    job = user.job
    assert job.at_deadline and "still running at the run's deadline" in job.error
    assert left == [] and fake.cancels == [job.id] and job.state == "cancelled" and job.cancelled_in_cleanup
    figures = L.job_report([user], api, args(jobs=1, users=1))
    assert (figures["submitted"], figures["cancelled"], figures["cancelled_at_deadline"]) == (1, 1, 1)


async def test_a_refused_job_is_a_failure_with_the_hubs_reason_and_an_http_error_on_the_jobs_endpoint():
    fake = FakeJobs(run_for=0.1, refuse=403)
    user, api, left = await against(fake, deadline_in=5)
    assert user.job.state == "refused" and "403 your team may not use this profile" in user.job.error
    figures = L.job_report([user], api, args(jobs=1, users=1))
    assert figures["refused"] == 1 and figures["submitted"] == 0
    assert figures["http_errors"] == {"403 POST /hub/api/gpuhub/jobs": 1}
