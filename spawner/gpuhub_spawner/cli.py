"""``gpuhub``: validate the policy, render Kueue objects, run the one-machine hub, submit
batch jobs, read GPU usage."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _validate(args) -> int:
    from .policy import PolicyError, load_policy

    status = 0
    for path in args.files:
        try:
            policy = load_policy(path)
        except PolicyError as e:
            status = 1
            print(f"{path}: {len(e.issues)} error(s)", file=sys.stderr)
            for issue in e.issues:
                print("  " + issue.format(path), file=sys.stderr)
            continue
        print(f"{path}: OK ({len(policy.teams)} teams, {len(policy.profiles)} profiles, {len(policy.flavors)} flavors)")
        for warning in _machine_warnings(policy, args):
            print(f"  warning: {warning}", file=sys.stderr)
    return status


def _machine_warnings(policy, args) -> list[str]:
    """What this machine cannot give that the policy promises (one-machine mode): its GPUs
    by NVML, or the policy's virtual ones; and warnings shorter than the activity interval."""
    from .policy.checks import capacity_warnings, warning_interval_warnings

    out = warning_interval_warnings(policy, getattr(args, "activity_interval", 300.0))
    if getattr(args, "machine", True):
        from .local.devices import capacity_by_flavor, discover_nvml

        from .policy.grants import grant_warnings

        out = capacity_warnings(policy, capacity_by_flavor(policy, discover_nvml())) + grant_warnings(policy) + out
    return out


def _run(args) -> int:
    from .wiring.config import demo_password, private_dir

    config = Path(args.config).resolve()
    data = private_dir(args.data_dir)  # 0700 from the first byte
    env = dict(os.environ, GPUHUB_DATA_DIR=str(data), GPUHUB_PORT=str(args.port))
    if args.policy:
        env["GPUHUB_POLICY"] = str(Path(args.policy).resolve())
    policy_path = env.get("GPUHUB_POLICY", str(config.parent / "profiles.yaml"))
    rc = _validate(argparse.Namespace(files=[policy_path]))
    if rc:
        print("Fix the policy before starting the hub.", file=sys.stderr)
        return rc
    login = "demo"
    if getattr(args, "site", None):  # login, HTTPS, accounts: checked before the hub starts
        from .hub.site import load_site

        from .policy import PolicyError

        env["GPUHUB_SITE_CONFIG"] = str(Path(args.site).resolve())
        try:
            login = load_site(env["GPUHUB_SITE_CONFIG"]).auth.kind
        except PolicyError as e:
            for issue in e.issues:
                print("  " + issue.format(e.filename), file=sys.stderr)
            print("Fix the site file before starting the hub.", file=sys.stderr)
            return 1
    os.environ.update(env)
    if login == "demo":
        from .hub.origins import public_url

        password = demo_password(data)
        url = public_url(args.port)
        print(
            f"\ngpuhub: starting on {url}\n"
            f"  log in as alice or bob (Vision Lab), carol (NLP), dave (both), erin (Students),\n"
            f"  lena (Vision Lab's lead), victor (viewer), mallory (no team) or admin — password: {password}\n"
            f"  GPUs and queues: {url}/hub/gpuhub   usage: {url}/hub/gpuhub/usage\n"
            + (
                f"  MLflow (runs of everyone's notebooks, with your hub login): {_mlflow_url(url)}\n"
                if os.environ.get("GPUHUB_MLFLOW", "1") != "0"
                else ""
            ),
            flush=True,
        )
    else:
        print(f"\ngpuhub: starting on port {args.port} with {login} login\n", flush=True)
    from jupyterhub.app import main as hub_main

    return hub_main(["-f", str(config)]) or 0


def _mlflow_url(hub_url: str) -> str:
    """Where a browser opens the hub's MLflow service: its own origin with per-user origins
    (JupyterHub's service subdomain ``<name>--service.<domain>``), else under the hub."""
    if os.environ.get("GPUHUB_SUBDOMAINS", "1") == "0" or "://127.0.0.1" in hub_url:
        return f"{hub_url}/services/mlflow/#/experiments"
    return hub_url.replace("://", "://mlflow--service.", 1) + "/services/mlflow/#/experiments"


def main(argv: list[str] | None = None) -> int:
    program = argv is None  # the ``gpuhub`` command itself, not a caller in a larger process
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["validate"]:
            return _quick(lambda: _main(argv), program)
        return _main(argv)
    except BrokenPipeError:
        if not program:
            raise
        # The reader stopped reading (``gpuhub policy history | head -n 3``, as the runbooks do):
        # it has what it wanted. Quiet, with no traceback, and a success, so a runbook under
        # ``set -o pipefail`` goes on; stdout now goes nowhere, so Python's flush at exit does
        # not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _quick(command, program: bool) -> int:
    """Run a command that only reads files (``gpuhub validate``) at the cost of its own work.

    - The cyclic garbage collector is off while it runs: the command builds ~100,000 objects
      (pydantic's schemas, the YAML nodes, the policy) and no cycles worth freeing, and each
      collection would scan them all again. Back as it was afterwards.
    - As the program (``gpuhub validate ...``), everything it built is frozen out of the
      collector before the interpreter exits: its shutdown collections would otherwise scan
      every object once more (~0.1 s) just before the memory goes back anyway.
    - pydantic's plugin scan (the entry points of every installed distribution, on the first
      model built) is skipped unless ``PYDANTIC_DISABLE_PLUGINS`` is set (set it empty to keep
      the scan): plugins observe validation in applications, not a one-off file check.
    """
    import gc

    if program:
        os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    was_on = gc.isenabled()
    gc.disable()
    try:
        return command()
    finally:
        if program:
            gc.freeze()
        if was_on:
            gc.enable()


def _main(argv: list[str]) -> int:
    if argv[:1] == ["job"]:
        from .jobs.cli import main as job_main  # batch jobs: docs/jobs.md

        return job_main(argv[1:])
    if argv[:1] == ["ray"]:
        from .rayclusters.cli import main as ray_main  # Ray clusters: docs/ray.md

        return ray_main(argv[1:])
    if argv[:1] == ["env"]:
        from .user_envs import main as env_main  # your own packages in your home: docs/own-packages.md

        return env_main(argv[1:])
    if argv[:1] == ["usage"]:
        from .usage.cli import main as usage_main  # GPU-hours per team/user: docs/usage.md

        return usage_main(argv[1:])
    if argv[:1] == ["gpu"]:
        from .local.gpu_cli import main as gpu_main  # GPU health, drain, uncordon: docs/gpu-health.md

        return gpu_main(argv[1:])
    if argv[:1] == ["policy"]:
        from .usage.policy_cli import main as policy_main  # preview, apply, history, rollback: docs/policy-changes.md

        return policy_main(argv[1:])
    if argv[:1] == ["user"]:
        from .usage.users_cli import main as user_main  # admins: off-board a leaver (docs/runbooks/offboarding.md)

        return user_main(argv[1:])
    if argv[:1] == ["loadtest"]:
        from .ops.loadtest import main as loadtest_main  # operators: peak load against a live hub (docs/loadtest.md)

        return loadtest_main(argv[1:])
    if argv[:2] == ["mlflow", "import-history"]:
        from .mlflow.migrate import main as migrate_main  # history from an existing server: docs/mlflow.md

        return migrate_main(argv[2:])
    if argv[:1] == ["render"]:
        from .kube.render import main as render_main

        return render_main(argv[1:])
    parser = argparse.ArgumentParser(prog="gpuhub", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="check policy files; every error with its line:column")
    v.add_argument("files", nargs="+")
    v.add_argument(
        "--no-machine",
        dest="machine",
        action="store_false",
        help="skip the checks against this machine's GPUs (a policy for a Kubernetes cluster)",
    )
    v.add_argument(
        "--activity-interval",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="JupyterHub's activity report interval the idle warnings are checked against (default 300)",
    )
    v.set_defaults(func=_validate)
    r = sub.add_parser("run", help="start the one-machine hub (demo users, virtual GPUs without NVML)")
    r.add_argument("--config", default="jupyterhub_config/jupyterhub_config.py")
    r.add_argument("--policy", default=None, help="policy file (default: profiles.yaml beside the config)")
    r.add_argument("--data-dir", default=os.environ.get("GPUHUB_DATA_DIR", "data"))
    r.add_argument("--port", type=int, default=int(os.environ.get("GPUHUB_PORT", 8000)))
    r.add_argument(
        "--site", default=os.environ.get("GPUHUB_SITE_CONFIG"), help="site file: login, HTTPS, accounts (docs/authentication.md)"
    )
    r.set_defaults(func=_run)
    if argv[:1] != ["validate"]:  # its module is not needed to validate a file
        from .local.service import add_parser as add_service_parser

        add_service_parser(sub)
    sub.add_parser("render", help="render cluster objects: `gpuhub render kueue FILE`")
    sub.add_parser(
        "mlflow",
        help="admins: `gpuhub mlflow import-history --from URL ...` copies an existing server's experiments in (docs/mlflow.md)",
    )
    sub.add_parser("job", help="batch jobs in your team's GPU queue: `gpuhub job submit job.yaml` (docs/jobs.md)")
    sub.add_parser("ray", help="Ray clusters in your team's GPU queue: `gpuhub ray up --gpus 2` (docs/ray.md)")
    sub.add_parser(
        "env", help="your own packages: `gpuhub env create NAME` (a venv in ~/.venvs with a kernel; docs/own-packages.md)"
    )
    sub.add_parser("usage", help="GPU-hours by team or user: `gpuhub usage --since 7d --by team` (docs/usage.md)")
    sub.add_parser(
        "policy", help="admins: `gpuhub policy diff | apply NEW.yaml`, `history`, `rollback N` (docs/policy-changes.md)"
    )
    sub.add_parser(
        "loadtest",
        help="operators: N simulated researchers against a live hub, `gpuhub loadtest --hub-url URL --yes URL` (docs/loadtest.md)",
    )
    sub.add_parser("user", help="admins: `gpuhub user offboard NAME | reinstate NAME | list` (docs/runbooks/offboarding.md)")
    sub.add_parser("gpu", help="admins: GPU health, `gpuhub gpu list | drain ID | uncordon ID` (docs/gpu-health.md)")
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
