"""``gpuhub loadtest``: the peak-load test an operator runs against a live hub (issue 28).

N simulated researchers, as the browser would drive them through the hub's REST API: each is
a hub user this run creates (``<prefix><run>-NNNN``), put in a team's group, given a token,
asks for a server with a profile of the policy, follows the spawn's progress stream (the
spawn page's own request) until the server is ready, runs one cell in a real kernel over the
Jupyter websocket, stays idle a while, stops. Shapes: ``storm`` (everyone at once: Monday
09:00) or ``ramp`` (arrivals spread evenly over ``--ramp`` seconds).

It reports spawn-to-ready (median, p95, max), the cell's round trip, the stop, the wait for
admission per team (from the hub's own histogram ``gpuhub_team_admission_wait_seconds``,
read before and after), every HTTP error by status and every timeout, and the hub's CPU and
memory (its ``process_*`` series on ``/hub/metrics``), and the proxy's when the proxy runs on
this machine (read from ``/proc``): as a table, and as JSON that a later run compares with
(``--baseline``: each figure as now / before).

Bounded and clean: at most ``MAX_USERS`` users, a deadline for the whole run, and a cleanup
that always runs (servers stopped, tokens and users deleted; a user this run did not create
is never touched). It refuses to start without ``--yes`` naming the hub it will load.

The admin token needs: ``admin:users`` (create and delete users), ``tokens`` (one for each
simulated user), ``admin:groups`` (put them in a team's group), ``read:metrics``, and
``servers`` (stop them at the end); a hub admin's token has them all.
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

from .measure import Sampler, pid_listening_on, summary

MAX_USERS = 2000
DEFAULT_CODE = "sum(i * i for i in range(200_000))"
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
class UserRun:
    name: str
    group: str
    profile: str | None
    spawn_seconds: float | None = None
    cell_seconds: float | None = None
    stop_seconds: float | None = None
    error: str | None = None
    created: bool = False


@dataclass
class Errors:
    http: Counter = field(default_factory=Counter)  # "503 POST /users/{name}/server" -> count
    timeouts: int = 0
    connection: int = 0
    failed_spawns: int = 0
    cells: int = 0

    def total(self) -> int:
        return sum(self.http.values()) + self.timeouts + self.connection + self.failed_spawns + self.cells


class HubRefused(Exception):
    """The hub answered with an error the run cannot go on from."""


def _route(path: str) -> str:
    """A path with the simulated user's name taken out, so errors group by endpoint."""
    return re.sub(r"/users/[^/]+", "/users/{name}", re.sub(r"/kernels/[^/]+", "/kernels/{id}", path.split("?")[0]))


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

    async def fetch(self, method: str, url: str, token: str | None = None, body=None, count: bool = True,
                    timeout: float | None = None, streaming_callback=None):
        from tornado.httpclient import HTTPClientError, HTTPRequest

        url, headers = _loopback(url)
        headers["Authorization"] = f"token {token or self.token}"
        data = None
        if body is not None:
            data = json.dumps(body)
            headers["Content-Type"] = "application/json"
        elif method in ("POST", "PUT", "PATCH"):
            data = ""
        request = HTTPRequest(url, method=method, headers=headers, body=data, follow_redirects=False,
                              request_timeout=timeout or self.timeout, connect_timeout=min(30.0, self.timeout),
                              streaming_callback=streaming_callback, allow_nonstandard_methods=True)
        try:
            response = await self.client.fetch(request, raise_error=False)
        except HTTPClientError as e:  # 599: a timeout or a dropped connection
            if count:
                if "Timeout" in str(e) or "timed out" in str(e).lower():
                    self.errors.timeouts += 1
                else:
                    self.errors.connection += 1
            raise
        except OSError:
            if count:
                self.errors.connection += 1
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
        response = await api.fetch("GET", url, token=token, timeout=max(1.0, deadline - time.monotonic()),
                                   streaming_callback=on_chunk)
        if response.code >= 400 and not final:
            raise HubRefused(f"progress: {response.code} {_message(response)}")
    if not final:
        raise TimeoutError("no ready or failed event before the deadline")
    return final


async def _run_cell(api: Api, server_url: str, token: str, code: str, timeout: float) -> None:
    """One cell in a new kernel, over the Jupyter websocket (as JupyterLab does), then closed."""
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    base = server_url if "://" in server_url else api.hub_url + server_url
    r = await api.fetch("POST", base + "api/sessions", token=token,
                        body={"path": "loadtest.ipynb", "name": "loadtest.ipynb", "type": "notebook",
                              "kernel": {"name": "python3"}})
    if r.code >= 400:
        raise HubRefused(f"starting a kernel: {r.code} {_message(r)}")
    session = json.loads(r.body)
    try:
        url, headers = _loopback(base.replace("http", "ws", 1) + f"api/kernels/{session['kernel']['id']}/channels")
        headers["Authorization"] = f"token {token}"
        # The server answers the upgrade only once the new kernel replied to kernel_info (up to
        # its 60 s kernel_info_timeout on a loaded machine): tornado's default 20 s would give
        # up first and count a kernel that was merely slow as a failed cell.
        ws = await asyncio.wait_for(websocket_connect(HTTPRequest(url, headers=headers, connect_timeout=timeout,
                                                                  request_timeout=timeout)), timeout)
        try:
            msg_id = uuid.uuid4().hex
            ws.write_message(json.dumps({
                "header": {"msg_id": msg_id, "username": "loadtest", "session": uuid.uuid4().hex,
                           "msg_type": "execute_request", "version": "5.3"},
                "parent_header": {}, "metadata": {}, "channel": "shell",
                "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                            "allow_stdin": False, "stop_on_error": True}}))
            replied = idle = False
            end = time.monotonic() + timeout
            while not (replied and idle):
                raw = await asyncio.wait_for(ws.read_message(), max(0.1, end - time.monotonic()))
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
        token = (await api.hub("POST", f"/users/{name}/tokens",
                               body={"note": "gpuhub loadtest", "expires_in": int(args.deadline) + 600}))["token"]
        t0 = time.monotonic()
        await api.hub("POST", f"/users/{name}/server", body={"profile": user.profile} if user.profile else {},
                      token=token)
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
                raise HubRefused(f"group {group!r} is not on the hub and could not be created: {response.code} "
                                 f"{_message(response)}")
            created_groups.append(group)
        response = await api.fetch("POST", url + "/users", body={"users": names})
        if response.code >= 400:
            raise HubRefused(f"adding users to group {group!r}: {response.code} {_message(response)}")


async def _cleanup(api: Api, users: list[UserRun], created_groups: list[str], deadline: float) -> list[str]:
    """Stop every server of this run and delete its users; what could not be cleaned."""
    left: list[str] = []

    async def one(u: UserRun) -> None:
        if not u.created:
            return
        try:
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
    run = secrets.token_hex(2)
    return [UserRun(f"{args.prefix}{run}-{i:04d}", args.mix[i % len(args.mix)].group,
                    args.mix[i % len(args.mix)].profile) for i in range(args.users)]


async def run(args, token: str) -> dict:
    users = plan(args)
    api = Api(args.hub_url, token, timeout=args.request_timeout, max_clients=max(10, 3 * args.users + 4))
    port = urlsplit(args.hub_url).port or (443 if args.hub_url.startswith("https") else 80)
    host = urlsplit(args.hub_url).hostname or ""
    proxy_pid = args.proxy_pid or (pid_listening_on(port) if host in ("localhost", "127.0.0.1", "::1") else None)
    sampler = Sampler(api, args.sample_every, proxy_pid)
    t_start = time.monotonic()
    deadline = t_start + args.deadline
    report: dict = {"hub": args.hub_url, "users": args.users, "shape": args.shape,
                    "mix": [f"{m.group}:{m.profile or '(default)'}" for m in args.mix],
                    "idle_seconds": args.idle, "code": args.code, "started_at": time.time()}
    left: list[str] = []
    created_groups: list[str] = []
    try:
        await sampler.sample()
        await _create_users(api, users, created_groups)
        sampling = asyncio.ensure_future(sampler.run())
        spread = args.ramp if args.shape == "ramp" else 0.0
        t0 = time.monotonic()
        tasks = [asyncio.ensure_future(_simulate(api, u, args, t0 + spread * i / max(1, len(users)), deadline))
                 for i, u in enumerate(users)]
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
    report.update({
        "wall_seconds": round(time.monotonic() - t_start, 2),
        "spawn_to_ready_seconds": summary([u.spawn_seconds for u in users if u.spawn_seconds is not None]),
        "cell_seconds": summary([u.cell_seconds for u in users if u.cell_seconds is not None]),
        "stop_seconds": summary([u.stop_seconds for u in users if u.stop_seconds is not None]),
        "queue_wait_by_team": waits,
        "completed": sum(1 for u in users if u.stop_seconds is not None and not u.error),
        "errors": {"http": dict(api.errors.http), "timeouts": api.errors.timeouts,
                   "connection": api.errors.connection, "failed_spawns": api.errors.failed_spawns,
                   "failed_cells": api.errors.cells, "users_failed": len(failed),
                   "first_failures": [f"{u.name}: {u.error}" for u in failed[:5]]},
        "hub_process": sampler.hub_figures(),
        "proxy_process": sampler.proxy_figures(),
        "metrics_note": sampler.unreadable,
        "not_cleaned_up": left,
    })
    return report


# -- output ----------------------------------------------------------------------------------
COMPARED = [("spawn_to_ready_seconds", "median"), ("spawn_to_ready_seconds", "p95"), ("cell_seconds", "median"),
            ("stop_seconds", "median"), ("hub_process", "cpu_cores_mean"), ("hub_process", "rss_max_mib"),
            ("proxy_process", "cpu_cores_mean"), ("proxy_process", "rss_max_mib")]


def _get(report: dict, section: str, key: str):
    value = (report.get(section) or {}).get(key)
    return value if isinstance(value, (int, float)) else None


def table(report: dict, baseline: dict | None = None) -> str:
    lines = [f"gpuhub loadtest: {report['users']} users ({report['shape']}) against {report['hub']}, "
             f"{report['wall_seconds']} s; {report['completed']} completed, {report['errors']['users_failed']} failed"]
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
        lines.append(f"  queue wait {team:<23}{w['mean_seconds']:>10} mean, p95 <= {w['p95_seconds']} "
                     f"(histogram buckets), {w['admitted']} admitted")
    e = report["errors"]
    lines.append(f"  errors: http {sum(e['http'].values())} {dict(e['http']) or ''}, timeouts {e['timeouts']}, "
                 f"connection {e['connection']}, failed spawns {e['failed_spawns']}, failed cells {e['failed_cells']}")
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpuhub loadtest", description=__doc__.split("\n\n")[0])
    p.add_argument("--hub-url", required=True, help="the hub's public URL, e.g. http://localhost:8000")
    p.add_argument("--yes", metavar="HUB_URL", help="required: the same URL again, to confirm which hub you load")
    p.add_argument("--users", type=int, default=10, help=f"simulated researchers (1-{MAX_USERS}, default 10)")
    p.add_argument("--mix", type=Mix.parse, action="append", metavar="GROUP[:PROFILE]",
                   help="a team's group and the profile its users ask for; repeat to mix (users take turns)")
    p.add_argument("--shape", choices=("storm", "ramp"), default="storm",
                   help="storm: everyone at once (Monday 09:00); ramp: arrivals spread over --ramp seconds")
    p.add_argument("--ramp", type=float, default=60.0, help="seconds over which a ramp's arrivals spread (default 60)")
    p.add_argument("--idle", type=float, default=5.0, help="seconds each user stays idle before stopping (default 5)")
    p.add_argument("--code", default=DEFAULT_CODE, help="the cell each user runs ('' for none)")
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
        problems.append(f"refusing to load {args.hub_url}: this creates {args.users} users and starts their servers "
                        f"there. Say so with --yes {args.hub_url}")
    if not 1 <= args.users <= MAX_USERS:
        problems.append(f"--users {args.users}: between 1 and {MAX_USERS}")
    if not _NAME_PREFIX.match(args.prefix):
        problems.append(f"--prefix {args.prefix!r}: lower-case letters, digits and '-', starting with a letter, at most 20")
    if args.deadline <= 0 or args.deadline > 6 * 3600 or args.idle < 0 or args.ramp < 0:
        problems.append("--deadline must be in (0, 21600] seconds; --idle and --ramp not negative")
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
    args.mix = args.mix or [Mix("students", None)]
    try:
        report = asyncio.run(run(args, token))
    except HubRefused as e:
        print(f"gpuhub loadtest: {e}", file=sys.stderr)
        return 1
    print(table(report, baseline))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=list) + "\n")
    return 0 if not report["errors"]["users_failed"] and not report["not_cleaned_up"] else 1

