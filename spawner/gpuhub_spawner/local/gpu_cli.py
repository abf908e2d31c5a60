"""``gpuhub gpu list | drain ID | uncordon ID``: this machine's GPUs and their health, for admins.

Finds the hub and authenticates like ``gpuhub job`` (``--hub URL`` or ``JUPYTERHUB_API_URL``;
``GPUHUB_TOKEN`` or ``JUPYTERHUB_API_TOKEN``, never a token on the command line). Listing
needs an admin's token (``custom:gpuhub:status:all``), drain and uncordon ``admin:servers``;
the hub audits both. A drained GPU stays with its holder until it stops, then nobody gets it;
uncordon puts it back unless its error counters still say it is bad (docs/gpu-health.md).
"""

from __future__ import annotations

import argparse
import time
from urllib.parse import quote

from ..jobs.client import HUB_HELP, HubError, api_base, call, hub_option, report


def _since(t) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpuhub gpu", description=__doc__.splitlines()[0])
    p.add_argument("--hub", help=HUB_HELP)
    sub = p.add_subparsers(dest="action", required=True)
    hub = hub_option()  # --hub also after the command, as for every gpuhub client command
    sub.add_parser("list", parents=[hub], help="every GPU: health, drain, holder")
    for action in ("drain", "uncordon"):
        a = sub.add_parser(
            action,
            parents=[hub],
            help="take a GPU out once its holder is done"
            if action == "drain"
            else "put a drained or failed GPU back into service",
        )
        a.add_argument("id", help="the GPU's id as `gpuhub gpu list` shows it (a UUID)")
    args = p.parse_args(argv)
    try:
        base = api_base(args.hub)
        if args.action == "list":
            rep = call(base, "GET", "/gpuhub/gpus")
        else:
            rep = call(base, "POST", f"/gpuhub/gpus/{quote(args.id, safe='')}/{args.action}", {})
    except HubError as e:
        return report("gpuhub gpu", e)
    if args.action != "list":
        print(rep["message"])
        return 0
    rows = [("GPU", "FLAVOR", "HEALTH", "SINCE", "HOLDER", "WHY")]
    for g in rep["gpus"]:
        health = g["state"] + (" (drained)" if g["drained"] else "")
        since = _since(g["since"]) if g["state"] != "healthy" else _since(g.get("drained_at"))
        why = g["reason"] or (f"drained by {g['drained']}" if g["drained"] else "")
        rows.append((g["id"], g["flavor"], health, since, g["key"] or "-", why))
    widths = [max(len(str(r[i])) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)) + "  " + r[5])
    return 0
