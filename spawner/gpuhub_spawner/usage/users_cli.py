"""``gpuhub user``: admins off-board a leaver and reinstate them (docs/runbooks/offboarding.md).

- ``gpuhub user offboard NAME``: stop their servers, jobs and Ray clusters, revoke every token
  and browser session, take them out of gpuhub's roles, keep or archive their home (the policy's
  ``offboarding.home``), block their login until reinstated; prints what each step did.
  Running it again is harmless and says the user was already off-boarded.
- ``gpuhub user reinstate NAME``: lift the block; they may log in again.
- ``gpuhub user list``: every account, its running servers, and who is off-boarded.

Finds the hub and authenticates like every ``gpuhub`` client command (``--hub URL`` or
``JUPYTERHUB_API_URL``; an admin's token in ``GPUHUB_TOKEN``, never on the command line).
"""

from __future__ import annotations

import argparse
from urllib.parse import quote

from ..jobs.client import HubError, api_base, call, hub_option, report

PROG = "gpuhub user"


def _offboard(base: str, name: str) -> int:
    rep = call(base, "POST", f"/gpuhub/users/{quote(name, safe='')}/offboard")
    if rep.get("already"):
        print(f"{name} was already off-boarded; every step was checked again:")
    else:
        print(f"{name} off-boarded by {rep['by']}:")
    for step in rep["steps"]:
        if "failed" in step:
            print(f"  {step['step']}: FAILED: {step['failed']}")
        else:
            print(f"  {step['step']}: {step['done']}")
    if rep.get("failed"):
        print(f"{PROG} offboard: steps that failed: {', '.join(rep['failed'])} (see the hub's log); run it again once fixed")
        return 1
    return 0


def _reinstate(base: str, name: str) -> int:
    rep = call(base, "POST", f"/gpuhub/users/{quote(name, safe='')}/reinstate")
    if rep["was_blocked"]:
        print(f"{name} reinstated by {rep['by']}: they may log in again (groups come back from the identity provider)")
    else:
        print(f"{name} was not off-boarded; nothing to do")
    return 0


def _list(base: str) -> int:
    for u in call(base, "GET", "/gpuhub/users")["users"]:
        state = f"off-boarded by {u['offboarded']['by']}" if u["offboarded"] else "active"
        servers = ", ".join(u["servers"]) or "-"
        print(f"{u['name']:<24} {state:<28} servers: {servers}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], parents=[hub_option()])
    sub = p.add_subparsers(dest="action", required=True)
    for action, words in (("offboard", "off-board a leaver"), ("reinstate", "lift an off-boarding's login block")):
        s = sub.add_parser(action, help=words, parents=[hub_option()])
        s.add_argument("name")
    sub.add_parser("list", help="every account, its servers, who is off-boarded", parents=[hub_option()])
    args = p.parse_args(argv)
    try:
        base = api_base(getattr(args, "hub", None))
        if args.action == "offboard":
            return _offboard(base, args.name)
        if args.action == "reinstate":
            return _reinstate(base, args.name)
        return _list(base)
    except HubError as e:
        return report(f"{PROG} {args.action}", e)
