"""``gpuhub loadtest``: the peak-load test an operator runs against a live hub (issue 28).

N simulated researchers, as the browser would drive them through the hub's REST API: each is
a hub user this run creates (``<prefix><run>-NNNN``), put in a team's group, given a token,
asks for a server with a profile of the policy, follows the spawn's progress stream (the
spawn page's own request) until the server is ready, runs one cell in a real kernel over the
Jupyter websocket, stays idle a while, stops. Shapes: ``storm`` (everyone at once: Monday
09:00) or ``ramp`` (arrivals spread evenly over ``--ramp`` seconds). With ``--jobs N`` the first
N of them then hand a batch job to the hub's jobs API (``POST /hub/api/gpuhub/jobs``, their own
token, as ``gpuhub job submit`` does) and follow it until it ends (``GET .../jobs/<id>``, as
``gpuhub job status`` does); a job still unfinished at the deadline is cancelled.

It reports spawn-to-ready (median, p95, max), the cell's round trip, the stop, the wait for
admission per team (from the hub's own histogram ``gpuhub_team_admission_wait_seconds``,
read before and after), every HTTP error by status and every timeout, and the hub's CPU and
memory (its ``process_*`` series on ``/hub/metrics``), and the proxy's when the proxy runs on
this machine (read from ``/proc``): as a table, and as JSON that a later run compares with
(``--baseline``: each figure as now / before). Jobs: submitted, refused, succeeded, failed,
cancelled, the wait from submission to the first attempt's start and the run from there to the
end (both from the hub's job record), and the HTTP errors on the jobs endpoints.

Bounded and clean: at most ``MAX_USERS`` users, a deadline for the whole run, and a cleanup
that always runs (the run's unfinished jobs cancelled, servers stopped, tokens and users
deleted; a user this run did not create is never touched). It refuses to start without
``--yes`` naming the hub it will load. The hub keeps every job's record (its evidence: no API
deletes one); they stay in its job history under the deleted users' names.

The admin token needs: ``admin:users`` (create and delete users), ``tokens`` (one for each
simulated user), ``admin:groups`` (put them in a team's group), ``read:metrics``, and
``servers`` (stop them at the end); a hub admin's token has them all. Jobs are submitted,
followed and cancelled with each simulated user's own token (``custom:gpuhub:jobs``, which
every user's token carries): nothing more of the admin's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import sys
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from ..jobs.records import FINAL as JOB_FINAL
from .measure import Sampler, pid_listening_on, summary

MAX_USERS = 2000
DEFAULT_CODE = "sum(i * i for i in range(200_000))"
DEFAULT_JOB_COMMAND = "sleep 5"
JOBS_API = "/gpuhub/jobs"
# Each simulated researcher reads their job's record every 2 s (``gpuhub job logs -f`` polls every
# second); beyond 50 jobs less often, so that all of them together send at most 25 requests a second.
JOB_POLL_SECONDS = 2.0
JOB_POLLS_PER_SECOND = 25.0
_NAME_PREFIX = re.compile(r"^[a-z][a-z0-9-]{0,19}$")


@dataclass
class Mix:
    """Which team's group a simulated user is in and which profile it asks for."""

    group: str
    profile: str | None

    @classmethod
    def parse(cls, text: str) -> "Mix":
        group, _, profile = text.partition(":")
        if not group:
            raise argparse.ArgumentTypeError(f"--mix {text!r}: expected GROUP[:PROFILE], e.g. vision-lab:a100-1")
        return cls(group, profile or None)


@dataclass
class JobRun:
    """The batch job one simulated researcher submits (``--jobs``), as the hub recorded it."""

    profile: str
    id: str | None = None
    state: str | None = None  # the hub's word (queued, running, succeeded, failed, cancelled), or "refused"
    submit_seconds: float | None = None  # the POST's round trip
    queue_seconds: float | None = None  # submitted -> the first attempt started (the hub's record)
    run_seconds: float | None = None  # the first attempt started -> the job ended (retries included)
    attempts: int = 0
    preempted: int = 0  # attempts stopped for an interactive server and queued again
    error: str | None = None
    at_deadline: bool = False  # still unfinished when the run's deadline came
    cancelled_in_cleanup: bool = False


@dataclass
class UserRun:
    name: str
    group: str
    profile: str | None
    spawn_seconds: float | None = None
    cell_seconds: float | None = None
    stop_seconds: float | None = None
    error: str | None = None
    created: bool = False
    token: str | None = None  # the simulated user's own; gone with the user
    job: JobRun | None = None


@dataclass
class Errors:
    http: Counter = field(default_factory=Counter)  # "503 POST /users/{name}/server" -> count
    timeouts: int = 0
    connection: int = 0
    failed_spawns: int = 0
    cells: int = 0
    job_transport: int = 0  # of the timeouts and dropped connections: those on the jobs endpoints

    def total(self) -> int:
        return sum(self.http.values()) + self.timeouts + self.connection + self.failed_spawns + self.cells


class HubRefused(Exception):
    """The hub answered with an error the run cannot go on from."""


def _route(path: str) -> str:
    """A path with the simulated user's name (and kernel and job ids) taken out, so errors group by endpoint."""
    path = re.sub(r"/jobs/job-[^/]+", "/jobs/{id}", path.split("?")[0])
    return re.sub(r"/users/[^/]+", "/users/{name}", re.sub(r"/kernels/[^/]+", "/kernels/{id}", path))


def _is_jobs_route(route: str) -> bool:
    return f"/hub/api{JOBS_API}" in route


def _loopback(url: str) -> tuple[str, dict]:
    """``*.localhost`` names (a user's own origin on the demo hub) resolve to loopback, as browsers
    do (RFC 6761) and glibc does not: connect to 127.0.0.1 and send the name as Host."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if host == "localhost" or host.endswith(".localhost"):
        netloc = "127.0.0.1" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc)), {"Host": parts.netloc}
    return url, {}


class Api:
    """The hub's REST API with one admin token, counting what goes wrong."""

    def __init__(self, hub_url: str, token: str, timeout: float, max_clients: int):
        from tornado.httpclient import AsyncHTTPClient

        self.hub_url = hub_url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.errors = Errors()
        self.client = AsyncHTTPClient(force_instance=True, max_clients=max_clients)

    async def fetch(
        self,
        method: str,
        url: str,
        token: str | None = None,
        body=None,
        count: bool = True,
        timeout: float | None = None,
        streaming_callback=None,
    ):
        from tornado.httpclient import HTTPClientError, HTTPRequest

        url, headers = _loopback(url)
        headers["Authorization"] = f"token {token or self.token}"
        data = None
        if body is not None:
            data = json.dumps(body)
            headers["Content-Type"] = "application/json"
        elif method in ("POST", "PUT", "PATCH"):
            data = ""
        request = HTTPRequest(
            url,
            method=method,
            headers=headers,
            body=data,
            follow_redirects=False,
            request_timeout=timeout or self.timeout,
            connect_timeout=min(30.0, self.timeout),
            streaming_callback=streaming_callback,
            allow_nonstandard_methods=True,
        )
        try:
            response = await self.client.fetch(request, raise_error=False)
        except HTTPClientError as e:  # 599: a timeout or a dropped connection
            if count:
                if "Timeout" in str(e) or "timed out" in str(e).lower():
                    self.errors.timeouts += 1
                else:
                    self.errors.connection += 1
                self.errors.job_transport += _is_jobs_route(urlsplit(url).path)
            raise
        except OSError:
            if count:
                self.errors.connection += 1
                self.errors.job_transport += _is_jobs_route(urlsplit(url).path)
            raise
        if response.code >= 400 and count:
            self.errors.http[f"{response.code} {method} {_route(urlsplit(url).path)}"] += 1
        return response

    async def hub(self, method: str, path: str, body=None, expect=(200, 201, 202, 204), **kw):
        response = await self.fetch(method, f"{self.hub_url}/hub/api{path}", body=body, **kw)
        if response.code not in expect:
            raise HubRefused(f"{method} /hub/api{path}: {response.code} {_message(response)}")
        return json.loads(response.body) if response.body else None

    def close(self) -> None:
        self.client.close()


def _message(response) -> str:
    try:
        return str(json.loads(response.body).get("message", ""))[:300]
    except (ValueError, AttributeError, TypeError):
        return (response.body or b"")[:200].decode(errors="replace")


# -- one simulated researcher ------------------------------------------------------------------
async def _follow_progress(api: Api, user: UserRun, token: str, deadline: float) -> dict:
    """Read the spawn's progress stream (as the spawn page does) until ready or failed."""
    final: dict = {}
    buffer = b""

    def on_chunk(chunk: bytes) -> None:
        nonlocal buffer
        buffer += chunk
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            for line in block.split(b"\n"):
                if line.startswith(b"data:"):
                    try:
                        event = json.loads(line[5:].strip())
                    except ValueError:
                        continue
                    if event.get("ready") or event.get("failed"):
                        final.update(event)

    url = f"{api.hub_url}/hub/api/users/{quote(user.name)}/server/progress"
    while not final and time.monotonic() < deadline:
        response = await api.fetch(
            "GET", url, token=token, timeout=max(1.0, deadline - time.monotonic()), streaming_callback=on_chunk
        )
        if response.code >= 400 and not final:
            raise HubRefused(f"progress: {response.code} {_message(response)}")
    if not final:
        raise TimeoutError("no ready or failed event before the deadline")
    return final


def execute_request(code: str, username: str) -> tuple[str, dict]:
    """A Jupyter messaging protocol 5.3 ``execute_request`` on the shell channel (a cell run as
    the notebook UI runs it), with its message id: what a reply's parent_header names."""
    msg_id = uuid.uuid4().hex
    return msg_id, {
        "header": {
            "msg_id": msg_id,
            "username": username,
            "session": uuid.uuid4().hex,
            "msg_type": "execute_request",
            "version": "5.3",
        },
        "parent_header": {},
        "metadata": {},
        "channel": "shell",
        "content": {
            "code": code,
            "silent": False,
            "store_history": False,
            "user_expressions": {},
            "allow_stdin": False,
            "stop_on_error": True,
        },
    }


async def _run_cell(api: Api, server_url: str, token: str, code: str, timeout: float) -> None:
    """One cell in a new kernel, over the Jupyter websocket (as JupyterLab does), then closed."""
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    base = server_url if "://" in server_url else api.hub_url + server_url
    r = await api.fetch(
        "POST",
        base + "api/sessions",
        token=token,
        body={"path": "loadtest.ipynb", "name": "loadtest.ipynb", "type": "notebook", "kernel": {"name": "python3"}},
    )
    if r.code >= 400:
        raise HubRefused(f"starting a kernel: {r.code} {_message(r)}")
    session = json.loads(r.body)
    try:
        url, headers = _loopback(base.replace("http", "ws", 1) + f"api/kernels/{session['kernel']['id']}/channels")
        headers["Authorization"] = f"token {token}"
        # The server answers the upgrade only once the new kernel replied to kernel_info (up to
        # its 60 s kernel_info_timeout on a loaded machine): tornado's default 20 s would give
        # up first and count a kernel that was merely slow as a failed cell.
        async with asyncio.timeout(timeout):  # not wait_for: 3.11's loses a cancel that finds it done
            ws = await websocket_connect(HTTPRequest(url, headers=headers, connect_timeout=timeout, request_timeout=timeout))
        try:
            msg_id, request = execute_request(code, "loadtest")
            ws.write_message(json.dumps(request))
            replied = idle = False
            end = time.monotonic() + timeout
            while not (replied and idle):
                async with asyncio.timeout(max(0.1, end - time.monotonic())):
                    raw = await ws.read_message()
                if raw is None:
                    raise HubRefused("the kernel's websocket closed")
                msg = json.loads(raw)
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind = msg["header"]["msg_type"]
                if kind == "error":
                    raise HubRefused(f"the cell failed: {msg['content'].get('ename')}: {msg['content'].get('evalue')}")
                replied = replied or kind == "execute_reply"
                idle = idle or (kind == "status" and msg["content"].get("execution_state") == "idle")
        finally:
            ws.close()
    finally:
        await api.fetch("DELETE", base + f"api/sessions/{session['id']}", token=token, count=False)


async def _simulate(api: Api, user: UserRun, args, start_at: float, deadline: float) -> None:
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    name = quote(user.name)
    try:
        # Valid through the cleanup, which cancels the user's jobs with it.
        lifetime = int(args.deadline + args.cleanup_timeout) + 600
        token = (await api.hub("POST", f"/users/{name}/tokens", body={"note": "gpuhub loadtest", "expires_in": lifetime}))[
            "token"
        ]
        user.token = token
        t0 = time.monotonic()
        await api.hub("POST", f"/users/{name}/server", body={"profile": user.profile} if user.profile else {}, token=token)
        event = await _follow_progress(api, user, token, deadline)
        if event.get("failed"):
            api.errors.failed_spawns += 1
            raise HubRefused(f"spawn failed: {str(event.get('message', ''))[:300]}")
        user.spawn_seconds = time.monotonic() - t0
        model = await api.hub("GET", f"/users/{name}")
        server_url = (model.get("servers") or {}).get("", {}).get("url") or model.get("server")
        try:
            if args.code:
                t1 = time.monotonic()
                try:
                    await _run_cell(api, server_url, token, args.code, max(5.0, deadline - time.monotonic()))
                except Exception:
                    api.errors.cells += 1
                    raise
                user.cell_seconds = time.monotonic() - t1
            await asyncio.sleep(min(args.idle, max(0.0, deadline - time.monotonic())))
        except Exception:
            # A researcher whose cell failed still leaves: a server left running would hold its
            # GPU and the team's place until the run's deadline, and the queue behind it with it.
            await _stop(api, user.name, deadline)
            raise
        t2 = time.monotonic()
        await _stop(api, user.name, deadline)
        user.stop_seconds = time.monotonic() - t2
    except asyncio.CancelledError:
        user.error = user.error or "cancelled at the run's deadline"
        raise
    except Exception as e:  # noqa: BLE001 - one user's failure is a figure of the run, not its end
        user.error = f"{type(e).__name__}: {e}"[:400]
    if user.job is not None and user.token:
        # The notebook was for exploring; the long run goes to a job (even when the server
        # failed: a researcher still submits their training, and the hub's answer is a figure).
        try:
            await _run_job(api, user, args, deadline)
        except asyncio.CancelledError:
            user.job.at_deadline = user.job.id is not None and user.job.state not in JOB_FINAL
            user.error = user.error or (
                f"job {user.job.id} still {user.job.state} at the run's deadline"
                if user.job.at_deadline
                else "cancelled at the run's deadline"
            )
            raise
        if user.job.error:
            user.error = user.error or user.job.error


def job_spec(user: UserRun, args, seconds_left: float) -> str:
    """The job file a researcher would write: the profile, the command, and a time limit that
    ends it on the hub's side even if this run is gone by then: after the deadline and the
    cleanup's time (the cleanup cancels it first, so the report says what the run did)."""
    import yaml

    assert user.job is not None  # a user who submits a job
    limit = max(1, int(seconds_left + args.cleanup_timeout)) + 60
    return yaml.safe_dump(
        {
            "name": f"gpuhub loadtest {user.name}",
            "profile": user.job.profile,
            "command": args.job_command,
            "timeLimit": f"{limit}s",
        },
        sort_keys=False,
    )


def job_figures(job: JobRun, record: dict) -> None:
    """What the hub's record says: state, attempts, the wait to the first start and the run to the end."""
    job.state = record.get("state")
    attempts = record.get("attempts") or []
    job.attempts = len(attempts)
    job.preempted = sum(1 for a in attempts if a.get("reason") == "preempted")
    started = next((a["started"] for a in attempts if a.get("started")), None)
    if started is not None and record.get("submitted"):
        job.queue_seconds = round(max(0.0, started - record["submitted"]), 3)
    if started is not None and record.get("finished") and job.state in JOB_FINAL:
        job.run_seconds = round(max(0.0, record["finished"] - started), 3)


async def _run_job(api: Api, user: UserRun, args, deadline: float) -> None:
    """Submit the job with the user's own token, then follow it until it ends or the deadline."""
    job = user.job
    assert job is not None  # _simulate runs it for a user with a job
    base = f"{api.hub_url}/hub/api{JOBS_API}"
    text = job_spec(user, args, deadline - time.monotonic())
    t0 = time.monotonic()
    try:
        r = await api.fetch("POST", base, token=user.token, body={"spec": text, "filename": "loadtest-job.yaml"})
    except Exception as e:  # noqa: BLE001 - counted by fetch; the cleanup looks for it by listing
        job.error = f"job submission: {type(e).__name__}: {e}"[:400]
        return
    if r.code != 201:
        # 4xx: the hub refused it with a reason (profile, team, caps); 5xx: it failed to answer
        job.state = "refused" if r.code < 500 else None
        job.error = f"job {'refused' if r.code < 500 else 'submission'}: {r.code} {_message(r)}"[:400]
        return
    job.submit_seconds = time.monotonic() - t0
    record = json.loads(r.body)
    job.id = record["id"]
    job_figures(job, record)
    poll = max(JOB_POLL_SECONDS, args.jobs / JOB_POLLS_PER_SECOND)
    while job.state not in JOB_FINAL and time.monotonic() < deadline:
        await asyncio.sleep(max(0.0, min(poll, deadline - time.monotonic())))
        try:
            r = await api.fetch("GET", f"{base}/{job.id}", token=user.token)
        except Exception:  # noqa: BLE001 - counted; read again at the next poll
            continue
        if r.code == 200:
            record = json.loads(r.body)
            job_figures(job, record)
        elif r.code == 404:
            job.error = f"job {job.id}: the hub no longer knows it (404)"
            return
    if job.state not in JOB_FINAL:  # the cleanup cancels it
        job.at_deadline = True
        job.error = f"job {job.id} still {job.state} at the run's deadline"
    elif job.state != "succeeded":
        job.error = f"job {job.id} {str(record.get('status') or job.state)[:300]}"


async def _stop(api: Api, name: str, deadline: float) -> None:
    """Stop the user's server and wait until the hub says it is gone. A spawn still pending
    (e.g. waiting in the queue) cannot be stopped yet (400): asked again until it can."""
    q = quote(name)
    while time.monotonic() < deadline:
        model = await api.hub("GET", f"/users/{q}", expect=(200, 404))
        if not model or "" not in (model.get("servers") or {}):
            return
        await api.hub("DELETE", f"/users/{q}/server", expect=(202, 204, 400, 404), count=False)
        await asyncio.sleep(0.5)
    raise TimeoutError(f"{name}'s server still there at the deadline")


# -- the run ---------------------------------------------------------------------------------
async def _create_users(api: Api, users: list[UserRun], created_groups: list[str]) -> None:
    for u in users:
        response = await api.fetch("POST", f"{api.hub_url}/hub/api/users/{quote(u.name)}")
        if response.code == 409:
            raise HubRefused(f"user {u.name} already exists: not ours, left alone; choose another --prefix")
        if response.code not in (200, 201):
            raise HubRefused(f"creating user {u.name}: {response.code} {_message(response)}")
        u.created = True
    by_group: dict[str, list[str]] = defaultdict(list)
    for u in users:
        by_group[u.group].append(u.name)
    for group, names in by_group.items():
        url = f"{api.hub_url}/hub/api/groups/{quote(group)}"
        if (await api.fetch("GET", url, count=False)).code == 404:
            # The identity provider's group reaches the hub with its first member's login: a team
            # whose members have not logged in yet has none. Made for this run, deleted after it.
            response = await api.fetch("POST", url)
            if response.code != 201:
                raise HubRefused(
                    f"group {group!r} is not on the hub and could not be created: {response.code} {_message(response)}"
                )
            created_groups.append(group)
        response = await api.fetch("POST", url + "/users", body={"users": names})
        if response.code >= 400:
            raise HubRefused(f"adding users to group {group!r}: {response.code} {_message(response)}")


async def _cancel_jobs(api: Api, u: UserRun, deadline: float) -> list[str]:
    """Cancel every unfinished job of the user (with their own token: the jobs they would see
    with ``gpuhub job list``, so one whose submission got no answer too) and wait until the hub
    says it ended. What could not be."""
    job = u.job
    assert job is not None  # _cleanup calls it for a user with a job
    base = f"{api.hub_url}/hub/api{JOBS_API}"
    states: dict[str, str | None] = {}
    if job.id:
        states[job.id] = job.state
    r = await api.fetch("GET", base, token=u.token, count=False)
    if r.code == 200:
        for record in json.loads(r.body).get("jobs", []):
            if record.get("user") != u.name:
                continue
            states[record["id"]] = record.get("state")
            if record["id"] == job.id:
                job_figures(job, record)  # it may have ended after its last read
    elif not job.id or job.state is None:
        return [f"{u.name}'s jobs: not listed ({r.code} {_message(r)}), a job whose submission got no answer may be left"]
    left = []
    for job_id, state in states.items():
        if state in JOB_FINAL:
            continue
        r = await api.fetch("POST", f"{base}/{job_id}/cancel", token=u.token, count=False)
        if r.code not in (200, 409):  # 409: it ended meanwhile
            left.append(f"job {job_id} of {u.name}: cancel answered {r.code} {_message(r)}"[:200])
            continue
        state = json.loads(r.body).get("state") if r.body else None
        while state not in JOB_FINAL and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            r = await api.fetch("GET", f"{base}/{job_id}", token=u.token, count=False)
            state = json.loads(r.body).get("state") if r.code == 200 else state
        if state not in JOB_FINAL:
            left.append(f"job {job_id} of {u.name}: still {state} after cancelling")
            continue
        if job_id == job.id:
            job.cancelled_in_cleanup = state == "cancelled"
            job.state = state
    return left


async def _cleanup(api: Api, users: list[UserRun], created_groups: list[str], deadline: float) -> list[str]:
    """Cancel the run's unfinished jobs, stop every server of this run and delete its users;
    what could not be cleaned."""
    left: list[str] = []

    async def one(u: UserRun) -> None:
        if not u.created:
            return
        try:
            if u.job is not None and u.token:
                # Before the user goes: their token goes with them, and deleting a user does not
                # end their jobs (an admin can still cancel one: `gpuhub job cancel ID`).
                try:
                    left.extend(await _cancel_jobs(api, u, deadline))
                except Exception as e:  # noqa: BLE001 - the server and the user are still cleaned
                    left.append(f"{u.name}'s jobs: {type(e).__name__}: {e}"[:200])
            await _stop(api, u.name, deadline)
            await api.hub("DELETE", f"/users/{quote(u.name)}", expect=(204, 404))
        except Exception as e:  # noqa: BLE001
            left.append(f"{u.name}: {type(e).__name__}: {e}"[:200])

    await asyncio.gather(*(one(u) for u in users))
    for group in created_groups:
        response = await api.fetch("DELETE", f"{api.hub_url}/hub/api/groups/{quote(group)}", count=False)
        if response.code not in (204, 404):
            left.append(f"group {group}: {response.code}")
    return left


def plan(args) -> list[UserRun]:
    """The run's users; the first ``--jobs`` of them (every mix in turn) also submit a job."""
    run = secrets.token_hex(2)
    users = [
        UserRun(f"{args.prefix}{run}-{i:04d}", args.mix[i % len(args.mix)].group, args.mix[i % len(args.mix)].profile)
        for i in range(args.users)
    ]
    for u in users[: args.jobs]:
        profile = args.job_profile or u.profile
        assert profile is not None  # _job_problems refused jobs of a mix without a profile
        u.job = JobRun(profile)
    return users


def job_report(users: list[UserRun], api: Api, args) -> dict | None:
    """The job figures of the run (``--jobs``): counts, HTTP errors on the jobs endpoints, failures."""
    if not args.jobs:
        return None
    jobs = [u.job for u in users if u.job is not None]
    submitted = [j for j in jobs if j.id]
    by_state = Counter(j.state for j in submitted)
    failed = [(u.name, u.job) for u in users if u.job is not None and u.job.error]
    return {
        "requested": args.jobs,
        "command": args.job_command,
        "profiles": sorted({j.profile for j in jobs}),
        "submitted": len(submitted),
        "refused": sum(1 for j in jobs if j.state == "refused"),
        "not_submitted": sum(1 for j in jobs if not j.id and j.state != "refused"),
        "succeeded": by_state["succeeded"],
        "failed": by_state["failed"],
        "cancelled": by_state["cancelled"],
        "cancelled_at_deadline": sum(1 for j in submitted if j.at_deadline and j.state == "cancelled"),
        "unfinished": sum(1 for j in submitted if j.state not in JOB_FINAL),
        "preempted_attempts": sum(j.preempted for j in submitted),
        "http_errors": {k: v for k, v in api.errors.http.items() if _is_jobs_route(k)},
        "transport_errors": api.errors.job_transport,
        "first_failures": [f"{name}: {job.error}" for name, job in failed[:5]],
    }


async def run(args, token: str) -> dict:
    users = plan(args)
    api = Api(args.hub_url, token, timeout=args.request_timeout, max_clients=max(10, 3 * args.users + 4))
    port = urlsplit(args.hub_url).port or (443 if args.hub_url.startswith("https") else 80)
    host = urlsplit(args.hub_url).hostname or ""
    proxy_pid = args.proxy_pid or (pid_listening_on(port) if host in ("localhost", "127.0.0.1", "::1") else None)
    sampler = Sampler(api, args.sample_every, proxy_pid)
    t_start = time.monotonic()
    deadline = t_start + args.deadline
    report: dict = {
        "hub": args.hub_url,
        "users": args.users,
        "shape": args.shape,
        "mix": [f"{m.group}:{m.profile or '(default)'}" for m in args.mix],
        "idle_seconds": args.idle,
        "code": args.code,
        "started_at": time.time(),
    }
    if args.jobs:
        report.update({"job_users": args.jobs, "job_command": args.job_command})
    left: list[str] = []
    created_groups: list[str] = []
    try:
        await sampler.sample()
        await _create_users(api, users, created_groups)
        sampling = asyncio.ensure_future(sampler.run())
        spread = args.ramp if args.shape == "ramp" else 0.0
        t0 = time.monotonic()
        tasks = [
            asyncio.ensure_future(_simulate(api, u, args, t0 + spread * i / max(1, len(users)), deadline))
            for i, u in enumerate(users)
        ]
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        sampling.cancel()
        await sampler.sample()
    finally:
        left = await _cleanup(api, users, created_groups, time.monotonic() + args.cleanup_timeout)
        api.close()
    failed = [u for u in users if u.error]
    waits = sampler.waits()
    longest = max((u.spawn_seconds for u in users if u.spawn_seconds is not None), default=None)
    for w in waits.values():
        # The histogram's buckets are coarse (300 s, then 900 s): interpolating inside one can say
        # more than any request waited. No admission wait is longer than the longest spawn.
        if w["p95_seconds"] is not None and longest is not None and w["p95_seconds"] > longest:
            w["p95_seconds"] = round(longest, 3)
    report.update(
        {
            "wall_seconds": round(time.monotonic() - t_start, 2),
            "spawn_to_ready_seconds": summary([u.spawn_seconds for u in users if u.spawn_seconds is not None]),
            "cell_seconds": summary([u.cell_seconds for u in users if u.cell_seconds is not None]),
            "stop_seconds": summary([u.stop_seconds for u in users if u.stop_seconds is not None]),
            "queue_wait_by_team": waits,
            "job_submit_seconds": summary([u.job.submit_seconds for u in users if u.job and u.job.submit_seconds is not None]),
            "job_queue_wait_seconds": summary([u.job.queue_seconds for u in users if u.job and u.job.queue_seconds is not None]),
            "job_run_seconds": summary([u.job.run_seconds for u in users if u.job and u.job.run_seconds is not None]),
            "jobs": job_report(users, api, args),
            "completed": sum(1 for u in users if u.stop_seconds is not None and not u.error),
            "errors": {
                "http": dict(api.errors.http),
                "timeouts": api.errors.timeouts,
                "connection": api.errors.connection,
                "failed_spawns": api.errors.failed_spawns,
                "failed_cells": api.errors.cells,
                "users_failed": len(failed),
                "first_failures": [f"{u.name}: {u.error}" for u in failed[:5]],
            },
            "hub_process": sampler.hub_figures(),
            "proxy_process": sampler.proxy_figures(),
            "metrics_note": sampler.unreadable,
            "not_cleaned_up": left,
        }
    )
    return report


# -- output ----------------------------------------------------------------------------------
COMPARED = [
    ("spawn_to_ready_seconds", "median"),
    ("spawn_to_ready_seconds", "p95"),
    ("cell_seconds", "median"),
    ("stop_seconds", "median"),
    ("job_submit_seconds", "median"),
    ("job_queue_wait_seconds", "median"),
    ("job_queue_wait_seconds", "p95"),
    ("job_run_seconds", "median"),
    ("job_run_seconds", "p95"),
    ("hub_process", "cpu_cores_mean"),
    ("hub_process", "rss_max_mib"),
    ("proxy_process", "cpu_cores_mean"),
    ("proxy_process", "rss_max_mib"),
]
JOB_COUNTS = ("submitted", "succeeded", "failed", "refused", "cancelled")


def _get(report: dict, section: str, key: str):
    value = (report.get(section) or {}).get(key)
    return value if isinstance(value, (int, float)) else None


def table(report: dict, baseline: dict | None = None) -> str:
    lines = [
        f"gpuhub loadtest: {report['users']} users ({report['shape']}) against {report['hub']}, "
        f"{report['wall_seconds']} s; {report['completed']} completed, {report['errors']['users_failed']} failed"
    ]
    head = f"  {'figure':<34}{'now':>10}" + (f"{'before':>10}{'ratio':>8}" if baseline else "")
    lines.append(head)
    for section, key in COMPARED:
        now = _get(report, section, key)
        if now is None:
            continue
        row = f"  {section + ' ' + key:<34}{now:>10}"
        if baseline:
            before = _get(baseline, section, key)
            row += f"{before if before is not None else '-':>10}"
            row += f"{(now / before):>7.2f}x" if before else f"{'-':>8}"
        lines.append(row)
    for team, w in sorted(report.get("queue_wait_by_team", {}).items()):
        lines.append(
            f"  queue wait {team:<23}{w['mean_seconds']:>10} mean, p95 <= {w['p95_seconds']} "
            f"(histogram buckets), {w['admitted']} admitted"
        )
    jobs = report.get("jobs")
    if jobs:
        lines.append(
            f"  jobs: {jobs['submitted']} of {jobs['requested']} submitted ({', '.join(jobs['profiles'])}: "
            f"{jobs['command']!r}), {jobs['succeeded']} succeeded, {jobs['failed']} failed, "
            f"{jobs['refused']} refused, {jobs['cancelled']} cancelled "
            f"({jobs['cancelled_at_deadline']} at the deadline), {jobs['preempted_attempts']} preempted attempts"
        )
        lines.append(
            f"  jobs API errors: http {sum(jobs['http_errors'].values())} {jobs['http_errors'] or ''}, "
            f"timeouts or dropped connections {jobs['transport_errors']}"
        )
        before = (baseline or {}).get("jobs")
        if before:
            lines.append("  jobs before: " + ", ".join(f"{before.get(k, '-')} {k}" for k in JOB_COUNTS))
    e = report["errors"]
    lines.append(
        f"  errors: http {sum(e['http'].values())} {dict(e['http']) or ''}, timeouts {e['timeouts']}, "
        f"connection {e['connection']}, failed spawns {e['failed_spawns']}, failed cells {e['failed_cells']}"
    )
    for failure in e["first_failures"]:
        lines.append(f"    {failure}")
    if report.get("metrics_note"):
        lines.append(f"  note: {report['metrics_note']}")
    if report.get("not_cleaned_up"):
        lines.append(f"  NOT cleaned up: {report['not_cleaned_up']}")
    return "\n".join(lines)


def _token(args, problems: list[str]) -> str | None:
    if args.token_file:
        try:
            return Path(args.token_file).read_text(errors="replace")[:4096].strip() or None
        except OSError as e:
            problems.append(f"--token-file {args.token_file}: {e.strerror}")
            return ""
    return os.environ.get("GPUHUB_ADMIN_TOKEN") or os.environ.get("JUPYTERHUB_API_TOKEN")


def _job_problems(args) -> list[str]:
    if not 0 <= args.jobs <= max(0, args.users):
        return [f"--jobs {args.jobs}: between 0 and --users ({args.users}): one job per simulated user at most"]
    if not args.jobs:
        return []
    problems = []
    lacking = sorted({m.group for m in args.mix[: args.jobs] if not m.profile})
    if not args.job_profile and lacking:
        problems.append(f"--jobs needs a profile for the jobs of {', '.join(lacking)}: --mix GROUP:PROFILE or --job-profile SLUG")
    from ..jobs.spec import parse_job
    from ..policy import PolicyError

    try:  # the job file, checked here as `gpuhub job submit` does: before anything is sent
        parse_job(job_spec(UserRun("u", "g", None, job=JobRun(args.job_profile or "p")), args, 60), "--job-command")
    except PolicyError as e:
        problems += [f"--job-command: {i.message}" for i in e.issues]
    return problems


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpuhub loadtest", description=__doc__.split("\n\n")[0])
    p.add_argument("--hub-url", required=True, help="the hub's public URL, e.g. http://localhost:8000")
    p.add_argument("--yes", metavar="HUB_URL", help="required: the same URL again, to confirm which hub you load")
    p.add_argument("--users", type=int, default=10, help=f"simulated researchers (1-{MAX_USERS}, default 10)")
    p.add_argument(
        "--mix",
        type=Mix.parse,
        action="append",
        metavar="GROUP[:PROFILE]",
        help="a team's group and the profile its users ask for; repeat to mix (users take turns)",
    )
    p.add_argument(
        "--shape",
        choices=("storm", "ramp"),
        default="storm",
        help="storm: everyone at once (Monday 09:00); ramp: arrivals spread over --ramp seconds",
    )
    p.add_argument("--ramp", type=float, default=60.0, help="seconds over which a ramp's arrivals spread (default 60)")
    p.add_argument("--idle", type=float, default=5.0, help="seconds each user stays idle before stopping (default 5)")
    p.add_argument("--code", default=DEFAULT_CODE, help="the cell each user runs ('' for none)")
    p.add_argument(
        "--jobs",
        type=int,
        default=0,
        metavar="N",
        help="the first N users (0 to --users, default 0) then submit a batch job each and follow it to its end",
    )
    p.add_argument("--job-profile", metavar="SLUG", help="the jobs' profile (default: the profile of the user's --mix)")
    p.add_argument(
        "--job-command",
        default=DEFAULT_JOB_COMMAND,
        help=f"the job's command, one shell string (default {DEFAULT_JOB_COMMAND!r})",
    )
    p.add_argument("--deadline", type=float, default=900.0, help="seconds for the whole run, cleanup apart (default 900)")
    p.add_argument("--cleanup-timeout", type=float, default=180.0, help="seconds for stopping and deleting (default 180)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds for one API request (default 120)")
    p.add_argument("--sample-every", type=float, default=2.0, help="seconds between reads of /hub/metrics (default 2)")
    p.add_argument("--prefix", default="loadtest-", help="name prefix of the users this run creates (default loadtest-)")
    p.add_argument("--proxy-pid", type=int, help="the proxy's process id (found by its port when the hub is local)")
    p.add_argument("--token-file", help="a file with an admin token (else $GPUHUB_ADMIN_TOKEN or $JUPYTERHUB_API_TOKEN)")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON (a later run's --baseline)")
    p.add_argument("--baseline", metavar="FILE", help="a report an earlier run wrote: each figure as now / before")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    problems = []
    if args.yes is None or args.yes.rstrip("/") != args.hub_url.rstrip("/"):
        jobs = f" and submits {args.jobs} jobs" if args.jobs else ""
        problems.append(
            f"refusing to load {args.hub_url}: this creates {args.users} users and starts their servers{jobs} "
            f"there. Say so with --yes {args.hub_url}"
        )
    if not 1 <= args.users <= MAX_USERS:
        problems.append(f"--users {args.users}: between 1 and {MAX_USERS}")
    if not _NAME_PREFIX.match(args.prefix):
        problems.append(f"--prefix {args.prefix!r}: lower-case letters, digits and '-', starting with a letter, at most 20")
    if args.deadline <= 0 or args.deadline > 6 * 3600 or args.idle < 0 or args.ramp < 0:
        problems.append("--deadline must be in (0, 21600] seconds; --idle and --ramp not negative")
    args.mix = args.mix or [Mix("students", None)]
    problems += _job_problems(args)
    token = _token(args, problems)
    if token is None:
        problems.append("no admin token: --token-file FILE, or GPUHUB_ADMIN_TOKEN in the environment")
    baseline = None
    if args.baseline:
        try:
            baseline = json.loads(Path(args.baseline).read_text())
        except (OSError, ValueError) as e:
            problems.append(f"--baseline {args.baseline}: {e}")
    if problems:
        for line in problems:
            print(f"gpuhub loadtest: {line}", file=sys.stderr)
        return 2
    assert token is not None  # else a problem above
    try:
        report = asyncio.run(run(args, token))
    except HubRefused as e:
        print(f"gpuhub loadtest: {e}", file=sys.stderr)
        return 1
    print(table(report, baseline))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=list) + "\n")
    return 0 if not report["errors"]["users_failed"] and not report["not_cleaned_up"] else 1
