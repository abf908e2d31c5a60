"""``gpuhub job``: submit, list, status, logs, cancel, show — a thin client of the hub API.

The hub and the token are found like every ``gpuhub`` client command's (``jobs.client``):
``--hub URL`` or ``JUPYTERHUB_API_URL``; ``GPUHUB_TOKEN`` or ``JUPYTERHUB_API_TOKEN`` (set
in every server, so it works in a notebook terminal with no setup), never on the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ..policy import PolicyError
from .client import HUB_HELP, HubError, api_base, call, hub_option, report
from .spec import parse_job


def _home_relative(path: str) -> str:
    return path if not path or path.startswith("/") else "~/" + path


def _time(t) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def parameter_value(text: str):
    """``-p name=value``'s value as papermill's own CLI reads it: bool, None, int, float, else text."""
    if text in ("True", "true"):
        return True
    if text in ("False", "false"):
        return False
    if text in ("None", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def notebook_job(args, home: str | None = None) -> tuple[str, str]:
    """The job file (YAML text) a ``gpuhub job submit train.ipynb ...`` stands for, and its name.

    The notebook runs from the user's home on the hub: a path on this machine must be in
    the home (as in a server's terminal); with ``--home-path`` it is taken as relative to the
    home on the hub (from a laptop)."""
    import yaml

    if not args.profile:
        raise HubError(0, "a notebook job needs --profile (a profile your team may use)")
    if args.home_path:
        rel = args.file.lstrip("/") if not args.file.startswith("~/") else args.file[2:]
    else:
        home = os.path.realpath(home or os.path.expanduser("~"))
        path = os.path.realpath(args.file)
        if not os.path.isfile(path):
            raise HubError(0, f"cannot read {args.file}: no such file (from a laptop, give --home-path)")
        rel = os.path.relpath(path, home)
        if rel.startswith(".."):
            raise HubError(0, f"{args.file} is not in your home directory ({home}): jobs run from your home")
    params: dict = {}
    for item in args.parameter or []:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise HubError(0, f"-p {item!r}: give a parameter as name=value")
        params[name] = parameter_value(value)
    spec: dict = {"profile": args.profile, "notebook": rel}
    for key, value in (("team", args.team), ("name", args.name), ("timeLimit", args.time_limit), ("experiment", args.experiment)):
        if value:
            spec[key] = value
    if params:
        spec["parameters"] = params
    if args.retries is not None or args.retry_on:
        spec["retries"] = {"limit": args.retries or 0, **({"reasons": _reasons(args.retry_on)} if args.retry_on else {})}
    return yaml.safe_dump(spec, sort_keys=False), os.path.basename(args.file)


def _reasons(text: str) -> list:
    return [int(r) if r.strip().isdigit() else r.strip() for r in text.split(",") if r.strip()]


def _submit(args, base):
    if args.file.endswith(".ipynb"):
        text, filename = notebook_job(args)
    else:
        if args.profile or args.parameter:
            raise HubError(0, "--profile and -p are for a notebook (train.ipynb); a job file says them itself")
        try:
            text = open(args.file).read()
        except OSError as e:
            raise HubError(0, f"cannot read {args.file}: {e.strerror}") from None
        filename = os.path.basename(args.file)
    parse_job(text, filename)  # located errors at once, before any network
    body = {"spec": text, "filename": filename}
    if args.stop_server:
        # Inside a server its name is set; from elsewhere, the default server.
        body["stop_server"] = os.environ.get("JUPYTERHUB_SERVER_NAME", "")
    job = call(base, "POST", "/gpuhub/jobs", body)
    print(job["status"])
    if args.stop_server:
        print(f"your server: {job.get('stopped_server', 'not stopped')}")
    print(job["id"])  # the last line is the id: JOB=$(gpuhub job submit job.yaml | tail -1)


def _list(args, base):
    jobs = call(base, "GET", "/gpuhub/jobs" + ("?all=1" if args.all else ""))["jobs"]
    if not jobs:
        print("no jobs")
    for j in jobs:
        print(
            f"{j['id']}  {j['state']:<9}  {j['user']:<12} {j['profile']['slug']:<12} attempts={len(j['attempts'])}  "
            f"submitted {_time(j['submitted'])}  {j.get('name') or ''}"
            + (f" ({j['kind']})" if j.get("kind") not in (None, "command") else "")
        )


def _status(args, base):
    print(call(base, "GET", f"/gpuhub/jobs/{args.id}")["status"])


def _show(args, base):
    job = call(base, "GET", f"/gpuhub/jobs/{args.id}")
    if args.json:
        print(json.dumps(job, indent=2, sort_keys=True))
        return
    p = job["profile"]
    print(f"{job['status']}\n")
    rows = [
        ("job", job["id"] + (f" ({job['name']})" if job.get("name") else "")),
        ("user / team", f"{job['user']} / {job['team']}"),
        ("profile", f"{p['slug']}: {p['gpu']['count']} GPU {p['gpu']['flavor'] or ''}, {p['cpu']}m CPU, {p['memory']} B memory"),
        ("priority", f"{job['priority_class'] or '-'} ({job['priority']})"),
        ("policy sha256", job["policy_sha256"]),
        ("image", job["image"] + (f" ({job['image_digest']})" if job["image_digest"] else "")),
        *([("ray entrypoint", job["ray"]["entrypoint"])] if job.get("ray") else []),
        ("command", " ".join(job["command"])),
        ("working dir", "~/" + job["working_dir"]),
        ("checkpoints", _home_relative(job["checkpoint_dir"])),
        ("env (names)", ", ".join(job["env_names"])),
        ("experiment", job.get("experiment") or "(your personal experiment)"),
        ("time limit", f"{job['time_limit']:g}s" if job.get("time_limit") else "-"),
        ("retries", f"{job['retries']['limit']} on {', '.join(map(str, job['retries']['reasons']))}"),
        ("submitted", _time(job["submitted"])),
        ("finished", _time(job.get("finished"))),
    ]
    for k, v in rows:
        print(f"{k:>14}: {v}")
    for a in job["attempts"]:
        git = a.get("git") or {}
        print(f"\nattempt {a['number']}: {a.get('reason') or 'in progress'} {a.get('message') or ''}")
        for k in ("queued", "admitted", "started", "finished"):
            print(f"{k:>14}: {_time(a.get(k))}")
        print(f"{'devices':>14}: {', '.join(a['devices']) or 'none'}")
        print(f"{'exit code':>14}: {a['exit_code'] if a.get('exit_code') is not None else '-'}")
        print(f"{'git':>14}: {git.get('commit', '-')}{' (dirty)' if git.get('dirty') else ''}")
        print(f"{'MLflow runs':>14}: {', '.join(a.get('mlflow_run_ids') or []) or '-'}")
        # The hub shows the log's name, never where it lies on the hub's machine.
        log_name = os.path.basename(a.get("log") or "")
        shown = f"{log_name} (gpuhub job logs {job['id']})" if log_name else "-"
        print(f"{'log':>14}: {shown}")


def _logs(args, base):
    offset = 0
    while True:
        chunk = call(base, "GET", f"/gpuhub/jobs/{args.id}/logs?offset={offset}")
        sys.stdout.write(chunk["text"])
        sys.stdout.flush()
        offset = chunk["offset"]
        if chunk["text"]:
            continue  # the hub answers in chunks (64 KiB): read on
        if args.follow and not chunk["done"]:
            time.sleep(1)
            continue
        if args.follow:
            print(chunk["status"], file=sys.stderr)
        return


def _cancel(args, base):
    print(call(base, "POST", f"/gpuhub/jobs/{args.id}/cancel")["status"])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpuhub job", description="Batch jobs in your team's GPU queue (docs/jobs.md).")
    parser.add_argument("--hub", help=HUB_HELP)
    hub = hub_option()  # ... also accepted after the command
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, **kwargs):
        return sub.add_parser(name, parents=[hub], **kwargs)

    s = add("submit", help="validate and submit a job file or a notebook (.ipynb); prints the job id last")
    s.add_argument("file", help="job.yaml, or a notebook to execute top to bottom as a job (train.ipynb)")
    nb = s.add_argument_group("a notebook (train.ipynb)")
    nb.add_argument("--profile", help="the profile it runs with")
    nb.add_argument("-p", "--parameter", action="append", metavar="NAME=VALUE", help="into the cell tagged 'parameters'")
    nb.add_argument("--team", help="only if you are in several teams")
    nb.add_argument("--name", help="shown in lists and on the runs' tags")
    nb.add_argument("--retries", type=int, help="how many of its own failures to retry")
    nb.add_argument("--retry-on", help="comma-separated: preempted,interrupted,failed,oom or exit codes")
    nb.add_argument("--time-limit", help="e.g. 6h")
    nb.add_argument("--experiment", help="MLflow experiment")
    nb.add_argument("--home-path", action="store_true", help="FILE is a path in your home on the hub (from a laptop)")
    s.add_argument("--stop-server", action="store_true", help="and stop my server (frees its GPU) once the job is queued")
    s.set_defaults(func=_submit)
    lst = add("list", help="your jobs")
    lst.add_argument("--all", action="store_true", help="everyone's (admins)")
    lst.set_defaults(func=_list)
    for name, func, text in (
        ("status", _status, "the state word first, then where it stands"),
        ("cancel", _cancel, "leave the queue or stop it; its GPUs are free at once"),
        ("show", _show, "the full record of every attempt"),
    ):
        p = add(name, help=text)
        p.add_argument("id")
        if name == "show":
            p.add_argument("--json", action="store_true")
        p.set_defaults(func=func)
    lg = add("logs", help="the output of every attempt")
    lg.add_argument("id")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    lg.set_defaults(func=_logs)
    args = parser.parse_args(argv)
    try:
        base = api_base(args.hub)
        args.func(args, base)
    except PolicyError as e:
        print(f"{e.filename}: {len(e.issues)} error(s)", file=sys.stderr)
        for issue in e.issues:
            print("  " + issue.format(e.filename), file=sys.stderr)
        return 1
    except HubError as e:
        report("gpuhub job", e)
        for line in e.issues:
            print("  " + line, file=sys.stderr)
        return 1
    return 0
