"""Move history from an MLflow server that already exists into the hub-managed one
(``gpuhub mlflow import-history``, docs/mlflow.md "Moving history into the hub's MLflow").

The runs themselves travel with MLflow's own export/import tooling, ``mlflow-export-import``
(its ``export-experiment`` and ``import-experiment`` commands, run as child processes with the
servers' logins in their environment, never on a command line): params, the whole metric
history, tags, artifacts and the original user and times (kept as ``mlflow_exim.*`` tags, and
``mlflow.user``). What the tool does not carry is who may see what: the old server's
per-experiment permissions of each of its accounts are copied onto the imported experiment, for
the same user names (accounts made where missing, with a random password: the hub's service
adopts them at the user's first request). Experiments whose name already exists on the hub's
server are skipped, never merged, so running it twice imports nothing twice.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import requests

from .secrets import Passwords, load_or_create_key
from .upstream import ADMIN_USERNAME

API = "/api/2.0/mlflow"
API3 = "/api/3.0/mlflow"  # MLflow 3's permissions API (users/permissions/grant, ...)


class MigrationError(Exception):
    pass


@dataclass
class Server:
    url: str  # including a static prefix, e.g. http://mlflow:5000/services/mlflow
    username: str
    password: str = field(repr=False)

    def session(self) -> requests.Session:
        s = requests.Session()
        s.auth = (self.username, self.password)
        return s

    def call(self, method: str, path: str, api: str = API, **kw) -> dict:
        r = self.session().request(method, self.url + api + path, timeout=60, **kw)
        if r.status_code >= 400:
            raise MigrationError(f"{self.url}: {method} {path} answered {r.status_code}: {r.text[:300]}")
        return r.json() if r.text.strip() else {}

    def experiments(self) -> dict[str, str]:
        """name -> id of every active experiment."""
        out, token = {}, None
        while True:
            body: dict = {"max_results": 1000, **({"page_token": token} if token else {})}
            data = self.call("POST", "/experiments/search", json=body)
            out.update({e["name"]: e["experiment_id"] for e in data.get("experiments", [])})
            token = data.get("next_page_token")
            if not token:
                return out

    def users(self) -> list[dict]:
        return self.call("GET", "/users/list").get("users", [])

    def environment(self) -> dict[str, str]:
        return {
            "MLFLOW_TRACKING_URI": self.url,
            "MLFLOW_TRACKING_USERNAME": self.username,
            "MLFLOW_TRACKING_PASSWORD": self.password,
        }


def hub_managed(data_dir: str | Path) -> Server:
    """The hub-managed server from the service's data dir (``<hub data>/mlflow``), as its admin.
    Run as the hub's user: the key there is readable by nobody else."""
    state = Path(data_dir) / "service"
    try:
        url = json.loads((state / "upstream.json").read_text())["url"]
        password = Passwords(load_or_create_key(state)).admin()
    except (OSError, KeyError, ValueError) as e:
        raise MigrationError(f"{state}: not the data dir of a running hub-managed MLflow ({e})") from None
    return Server(url, ADMIN_USERNAME, password)


def _tool(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if not found:
        raise MigrationError(f"{name} not found: install MLflow's export/import tool (pip install 'gpuhub-spawner[migrate]')")
    return found


def _run(cmd: list[str], server: Server) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")}
    env.update(server.environment(), MLFLOW_DISABLE_TELEMETRY="true")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise MigrationError(f"{Path(cmd[0]).name} failed ({done.returncode}): {(done.stderr or done.stdout)[-1500:]}")


PERSONAL_ROLE = "__user_"  # MLflow 3's basic-auth keeps a user's own grants in a role of theirs


def _permissions(server: Server, experiment_id: str) -> dict[str, str]:
    """user -> their own permission on ``experiment_id`` (admins excluded). MLflow 3.17's
    ``users/list`` gives each user's roles with their permissions; a user's own grants (an
    experiment they created, one shared with them) are in their personal role. Team roles are
    the hub's to give (docs/mlflow.md): not copied."""
    out = {}
    for u in server.users():
        if u.get("is_admin") or u["username"] == server.username:
            continue
        for role in u.get("roles", []):
            if not str(role.get("name", "")).startswith(PERSONAL_ROLE):
                continue
            for p in role.get("permissions", []):
                if p.get("resource_type") == "experiment" and str(p.get("resource_pattern")) == str(experiment_id):
                    out[u["username"]] = p["permission"]
    return out


def import_history(old: Server, new: Server, names: list[str] | None = None, say=print) -> dict:
    """Import ``names`` (default: every experiment of ``old``) into ``new``; returns what was done."""
    source = old.experiments()
    wanted = names or sorted(n for n in source if n != "Default")
    missing = [n for n in wanted if n not in source]
    if missing:
        raise MigrationError(f"no experiment {', '.join(map(repr, missing))} on {old.url}")
    existing = new.experiments()
    done: dict = {"imported": [], "skipped": [], "grants": []}
    with tempfile.TemporaryDirectory(prefix="gpuhub-mlflow-import-") as tmp:
        os.chmod(tmp, 0o700)
        for name in wanted:
            if name in existing:
                say(f"skipped {name!r}: an experiment of that name is already on the hub's MLflow")
                done["skipped"].append(name)
                continue
            out = Path(tmp) / source[name]
            _run([_tool("export-experiment"), "--experiment", name, "--output-dir", str(out)], old)
            _run(
                [_tool("import-experiment"), "--experiment-name", name, "--input-dir", str(out), "--import-source-tags", "True"],
                new,
            )
            new_id = new.experiments()[name]
            for user, permission in sorted(_permissions(old, source[name]).items()):
                try:
                    new.call("POST", "/users/create", json={"username": user, "password": secrets.token_urlsafe(24)})
                except MigrationError as e:
                    if "RESOURCE_ALREADY_EXISTS" not in str(e):
                        raise
                new.call(
                    "POST",
                    "/users/permissions/grant",
                    api=API3,
                    json={"username": user, "resource_type": "experiment", "resource_id": new_id, "permission": permission},
                )
                done["grants"].append((name, user, permission))
            say(f"imported {name!r} (runs, metrics, tags, artifacts; permissions: {_permissions(new, new_id) or 'none'})")
            done["imported"].append(name)
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="gpuhub mlflow import-history",
        description="Copy experiments from an existing MLflow server into the hub-managed one, owners kept.",
    )
    p.add_argument("--from", dest="source", required=True, help="the old server's URL (with its static prefix, if any)")
    p.add_argument(
        "--from-credentials",
        required=True,
        help="a file holding JSON {username, password} of the old server's admin (kept out of the command line)",
    )
    p.add_argument("--data-dir", required=True, help="the hub-managed MLflow's data dir (<hub data dir>/mlflow)")
    p.add_argument("--experiment", action="append", help="an experiment's name (repeat; default: all)")
    args = p.parse_args(argv)
    try:
        creds = json.loads(Path(args.from_credentials).read_text())
        old = Server(args.source.rstrip("/"), creds["username"], creds["password"])
        done = import_history(old, hub_managed(args.data_dir), args.experiment)
    except (OSError, KeyError, ValueError) as e:
        print(f"gpuhub mlflow import-history: {e}", file=sys.stderr)
        return 2
    except MigrationError as e:
        print(f"gpuhub mlflow import-history: {e}", file=sys.stderr)
        return 1
    print(f"{len(done['imported'])} imported, {len(done['skipped'])} skipped, {len(done['grants'])} permissions copied")
    return 0
