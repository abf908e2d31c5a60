"""``gpuhub ray up | list | status | down``: Ray clusters in your team's GPU queue (docs/ray.md).

A thin client of the hub API, found and authenticated like every ``gpuhub`` client command
(``jobs.client``: ``--hub`` or ``JUPYTERHUB_API_URL``; ``GPUHUB_TOKEN`` or
``JUPYTERHUB_API_TOKEN``, never on the command line).
``up`` prints the hub's words while the cluster waits (``--no-wait``: once) and, when it
runs, the address for ``ray.init`` last.
"""

from __future__ import annotations

import argparse
import sys
import time

from ..jobs.client import HUB_HELP, HubError, api_base, call, hub_option, report


def _up(args, base):
    body = {"gpus": args.gpus, "workers": args.workers, "profile": args.profile, "team": args.team, "name": args.name}
    view = call(base, "POST", "/gpuhub/ray", {k: v for k, v in body.items() if v is not None})
    name, last = view["name"], None
    print(f"Ray cluster {name}: {view['status']}", flush=True)
    last = view["status"]
    if args.no_wait:
        return 0
    deadline = time.time() + args.timeout if args.timeout else None
    while view["state"] in ("queued", "starting"):
        if deadline and time.time() > deadline:
            print(
                f"gpuhub ray: still {view['state']} after {args.timeout}s; `gpuhub ray status {name}` to look again, "
                f"`gpuhub ray down {name}` to give up",
                file=sys.stderr,
            )
            return 2
        time.sleep(1)
        view = call(base, "GET", f"/gpuhub/ray/{name}")
        if view["status"] != last:
            print(f"Ray cluster {name}: {view['status']}", flush=True)
            last = view["status"]
    if view["state"] != "running":
        return 1
    if view.get("dashboard"):
        print(f"dashboard: {view['dashboard']} (on your server's origin, with your login, while your server runs)")
    print(f"export RAY_ADDRESS={view['address']} RAY_AUTH_MODE=token")
    return 0


def _list(args, base):
    views = call(base, "GET", "/gpuhub/ray" + ("?all=1" if args.all else ""))["clusters"]
    if not views:
        print("no Ray clusters")
    for v in views:
        who = f"{v['user']:<12} " if args.all else ""
        print(f"{v['name']:<16} {who}{v['gpus']} GPU(s) {v['workers']} worker(s)  {v['status']}")


def _status(args, base):
    print(call(base, "GET", f"/gpuhub/ray/{args.name}")["status"])


def _down(args, base):
    print(call(base, "POST", f"/gpuhub/ray/{args.name}/stop")["status"])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpuhub ray", description="Ray clusters in your team's GPU queue (docs/ray.md).")
    parser.add_argument("--hub", help=HUB_HELP)
    hub = hub_option()
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", parents=[hub], help="start a cluster; waits in the queue, prints the address last")
    up.add_argument("--gpus", type=int, help="GPUs (the profile of your team with that many)")
    up.add_argument("--workers", type=int, default=0, help="worker processes besides the head (GPUs are split among them)")
    up.add_argument("--profile", help="a profile your team may use (default: the one with --gpus GPUs)")
    up.add_argument("--team", help="only if you are in several teams")
    up.add_argument("--name", help="lowercase letters, digits and '-' (default: ray-<random>)")
    up.add_argument("--no-wait", action="store_true", help="return once queued")
    up.add_argument("--timeout", type=float, default=0, help="give up waiting after this many seconds (0: never)")
    up.set_defaults(func=_up)
    lst = sub.add_parser("list", parents=[hub], help="your clusters")
    lst.add_argument("--all", action="store_true", help="everyone's (admins)")
    lst.set_defaults(func=_list)
    for name, func, text in (
        ("status", _status, "the state word first, then where it stands"),
        ("down", _down, "stop it (or leave the queue); its GPUs go back to the queue"),
    ):
        p = sub.add_parser(name, parents=[hub], help=text)
        p.add_argument("name")
        p.set_defaults(func=func)
    args = parser.parse_args(argv)
    try:
        return args.func(args, api_base(args.hub)) or 0
    except HubError as e:
        return report("gpuhub ray", e)
