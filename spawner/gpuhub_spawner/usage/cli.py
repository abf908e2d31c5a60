"""``gpuhub usage``: GPU-hours per team or user from the hub, in the terminal.

Finds the hub and authenticates exactly like ``gpuhub job`` (``--hub URL`` or
``JUPYTERHUB_API_URL``; ``GPUHUB_TOKEN`` or ``JUPYTERHUB_API_TOKEN``, never a token on the
command line). What it shows depends on the token's role: everyone for viewers and admins,
a lead's teams, a researcher's own allocations and teams' totals.
"""

from __future__ import annotations

import argparse
import csv
import io
from urllib.parse import urlencode

from ..jobs.client import HUB_HELP, HubError, api_base, call, report
from .history import CSV_LINE_END, csv_cell, describe_ends


def _fmt_s(v) -> str:
    return "-" if v is None else f"{v:.0f}s"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpuhub usage", description=__doc__.splitlines()[0])
    p.add_argument("--hub", help=HUB_HELP)
    p.add_argument("--since", default="7d", help="how far back: 24h, 7d, 30d (default 7d)")
    p.add_argument("--by", choices=("team", "user"), default="team")
    p.add_argument("--period", choices=("day", "week"), default="day", help="rows per day or per week")
    p.add_argument("--csv", action="store_true", help="print the totals as CSV")
    args = p.parse_args(argv)
    try:
        base = api_base(args.hub)
        rep = call(base, "GET", "/gpuhub/usage?" + urlencode({"since": args.since, "by": args.by, "period": args.period}))
    except HubError as e:
        return report("gpuhub usage", e)
    s = rep["summary"]
    cols = ["gpu_hours", "busy_gpu_hours", "idle_gpu_hours", "allocations", "culls"]
    if args.csv:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator=CSV_LINE_END)
        w.writerow([args.by] + cols)
        for name, t in s["totals"].items():  # team or user names: neutralised like the hub's CSV
            w.writerow([csv_cell(name)] + [csv_cell(t[c]) for c in cols])
        print(buf.getvalue(), end="")
        return 0
    print(f"GPU usage since {args.since} by {args.by} (as {rep['user']}, view: {rep['view']})")
    width = max([len(args.by)] + [len(n) for n in s["totals"]]) + 2
    print(f"{args.by:<{width}}{'GPU-h':>10}{'busy':>10}{'idle':>10}{'allocs':>8}{'culls':>7}")
    for name, t in s["totals"].items():
        print(
            f"{name:<{width}}{t['gpu_hours']:>10.3f}{t['busy_gpu_hours']:>10.3f}{t['idle_gpu_hours']:>10.3f}"
            f"{t['allocations']:>8}{t['culls']:>7}"
        )
    if not s["totals"]:
        print("(no allocations)")
    for per in s["periods"]:
        parts = ", ".join(f"{n} {v:.3f}" for n, v in per["gpu_hours"].items())
        print(f"  {args.period} of {per['date']}: {parts}")
    w = s["waits"]
    print(f"queue waits: {w['count']} admissions, median {_fmt_s(w['median_seconds'])}, p95 {_fmt_s(w['p95_seconds'])}")
    if s["ended"]:
        print("how allocations ended: " + describe_ends(s["ended"]))
    fair = rep.get("fair_share")
    if fair and fair["teams"]:
        # docs/fair-share.md: who goes first among equal priorities
        print(f"fair share now (recent GPU use, halving every {fair['half_life']}; use/share above 1: used more than its share):")
        width = max(len(f["label"]) for f in fair["teams"]) + 2
        print(f"  {'team':<{width}}{'weight':>8}{'share':>8}{'recent GPU-h':>14}{'use/share':>11}")
        for f in sorted(fair["teams"], key=lambda f: (f["use_per_share"] is None, f["use_per_share"] or 0)):
            ratio = "-" if f["use_per_share"] is None else f"{f['use_per_share']:.2f}"
            print(f"  {f['label']:<{width}}{f['weight']:>8g}{f['share_pct']:>7.1f}%{f['recent_gpu_hours']:>14.1f}{ratio:>11}")
    return 0
