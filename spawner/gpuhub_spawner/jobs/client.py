"""The hub's REST API from a terminal: what every ``gpuhub`` client command shares.

``gpuhub job``, ``gpuhub ray``, ``gpuhub usage``, ``gpuhub policy`` and ``gpuhub gpu`` find
the hub and authenticate the same way, and report a refusal the same way:

- the hub: ``--hub URL`` (the hub's address, e.g. https://hub.example.org, accepted before
  and after the subcommand) or ``JUPYTERHUB_API_URL`` (set in every server);
- the token: ``GPUHUB_TOKEN`` (a token from the hub's token page) or ``JUPYTERHUB_API_TOKEN``
  (set in every server, so a notebook terminal needs no setup). Never on the command line,
  where other users' ``ps`` would see it;
- a refusal: ``HubError`` with the hub's own message (and located issues where it sends
  them), printed as ``gpuhub <command>: <message> (HTTP <status>)`` (``report``).

Standard library only and nothing of gpuhub's, so it is the lowest client module: every
command's module (services and backends alike) imports it, never one another.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

HUB_HELP = "the hub's URL (default: $JUPYTERHUB_API_URL)"


class HubError(Exception):
    def __init__(self, status: int, message: str, issues: list[str] | None = None):
        self.status, self.message, self.issues = status, message, issues or []
        super().__init__(message)


def api_base(hub: str | None) -> str:
    url = hub or os.environ.get("JUPYTERHUB_API_URL")
    if not url:
        raise HubError(0, "no hub: pass --hub URL or set JUPYTERHUB_API_URL (it is set inside every gpuhub server)")
    url = url.rstrip("/")
    if url.endswith("/hub/api"):
        return url
    if url.endswith("/hub"):
        return url + "/api"
    return url + "/hub/api"


def token() -> str:
    tok = os.environ.get("GPUHUB_TOKEN") or os.environ.get("JUPYTERHUB_API_TOKEN")
    if not tok:
        raise HubError(
            0,
            "no token: set GPUHUB_TOKEN to a token from the hub's token page "
            "(inside a gpuhub server JUPYTERHUB_API_TOKEN is already set)",
        )
    return tok


def call(base: str, method: str, path: str, body: dict | None = None) -> dict:
    # UTF-8 as is, not \uXXXX escapes: the hub bounds the body in bytes (policy.bounded).
    data = json.dumps(body, ensure_ascii=False).encode() if body is not None else None
    req = urllib.request.Request(
        base + path,
        data=data,
        method=method,
        headers={
            "Authorization": f"token {token()}",
            "Content-Type": "application/json",
            "Accept": "application/json",
        },
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            err = json.loads(e.read() or b"{}")
        except ValueError:
            err = {}
        raise HubError(e.code, err.get("message") or e.reason, err.get("issues")) from None
    except urllib.error.URLError as e:
        raise HubError(0, f"cannot reach the hub at {base}: {e.reason}") from None


def hub_option() -> argparse.ArgumentParser:
    """A parent parser for each subcommand: ``--hub`` is also accepted after the command
    (``gpuhub job submit job.yaml --hub URL``), where people type it; absent there, the value
    given before the command (the main parser's own ``--hub``) stands."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--hub", default=argparse.SUPPRESS, help=HUB_HELP)
    return parent


def report(prog: str, e: HubError) -> int:
    """Print the hub's refusal as ``<prog>: <message> (HTTP <status>)`` on stderr; the exit
    status for it (1). A command whose hub answers carry located issues prints them after."""
    print(f"{prog}: {e.message}" + (f" (HTTP {e.status})" if e.status else ""), file=sys.stderr)
    return 1
