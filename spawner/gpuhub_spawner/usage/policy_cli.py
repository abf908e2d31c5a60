"""``gpuhub policy``: preview a policy edit's impact, apply it, list versions, roll back (docs/policy-changes.md).

Talks to the hub like ``gpuhub job`` and ``gpuhub usage`` (``--hub URL`` or ``JUPYTERHUB_API_URL``;
the token from ``GPUHUB_TOKEN`` or ``JUPYTERHUB_API_TOKEN``, never on the command line). Applying
and rolling back need an admin's token; a team lead's token previews changes to their own team.
``gpuhub policy diff NEW.yaml --against CURRENT.yaml`` works offline, without a hub (quotas,
profiles and validation; who runs and waits is only known to a hub).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..jobs.client import HUB_HELP, HubError, api_base, call, report


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise HubError(0, f"cannot read {path}: {e.strerror}") from None


def _issues(path: str, issues: list[str]) -> None:
    for text in issues:
        print("  " + (path + text[len("new policy") :] if text.startswith("new policy") else text), file=sys.stderr)


def _print_impact(rep: dict) -> None:
    print(rep.get("text") or "No change for anyone.")


def _diff(args) -> int:
    if args.against:
        from ..admission.impact import impact, read_candidate
        from ..policy import PolicyError, load_policy

        try:
            current = load_policy(args.against)
        except PolicyError as e:
            print(f"{args.against}: the policy to compare against has {len(e.issues)} error(s)", file=sys.stderr)
            _issues(args.against, [i.format(e.filename) for i in e.issues])
            return 1
        new, errors = read_candidate(_read(args.file), args.file)
        if new is None:
            print(f"{args.file}: {len(errors)} error(s)", file=sys.stderr)
            _issues(args.file, [e["text"] for e in errors])
            return 1
        print(f"Impact of {args.file} against {args.against} (offline: who runs and waits is known only to a hub)")
        print(impact(current, new).text())
        return 0
    rep = call(api_base(args.hub), "POST", "/gpuhub/policy/preview", {"yaml": _read(args.file)})
    print(f"Impact of {args.file} against the hub's policy in force ({rep.get('base')}); nothing is applied:")
    _print_impact(rep)
    return 0


def _apply(args) -> int:
    body: dict = {"yaml": _read(args.file)}
    if args.summary:
        body["summary"] = args.summary
    if args.force:
        body["force"] = True  # apply even what breaks a promise the hub cannot keep (its warnings)
    rep = call(api_base(args.hub), "POST", "/gpuhub/policy/apply", body)
    v = rep["version"]
    print(f"Applied {args.file}: version {v['n']} ({v['hash']}) is in force.")
    _print_impact(rep)
    return 0 if rep.get("ok") else 1


def _history(args) -> int:
    rep = call(api_base(args.hub), "GET", "/gpuhub/policy")
    print(f"{'version':>7}  {'hash':<12}  {'when':<19}  {'who':<20}  {'how':<15}  summary")
    for v in rep["versions"]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v["at"]))
        mark = " *" if rep.get("version") and rep["version"]["n"] == v["n"] else ""
        print(f"{v['n']:>7}  {v['hash']:<12}  {when:<19}  {v['by'][:20]:<20}  {v['source']:<15}  {v.get('summary') or '-'}{mark}")
    if not rep["versions"]:
        print("(no versions recorded yet)")
    elif any(rep.get("version") and rep["version"]["n"] == v["n"] for v in rep["versions"]):
        print("* the version in force now")
    if rep.get("role") == "lead":
        print("(a lead sees the summaries of versions that changed only their teams: '-' for the others)")
    return 0


def _rollback(args) -> int:
    rep = call(api_base(args.hub), "POST", "/gpuhub/policy/rollback", {"version": args.version})
    v = rep["version"]
    print(f"Rolled back to version {args.version}: version {v['n']} ({v['hash']}) is in force.")
    _print_impact(rep)
    return 0 if rep.get("ok") else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpuhub policy", description=__doc__.splitlines()[0])
    hub = argparse.ArgumentParser(add_help=False)
    hub.add_argument("--hub", help=HUB_HELP)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("diff", parents=[hub], help="preview NEW.yaml's impact (nothing is applied)")
    d.add_argument("file")
    d.add_argument("--against", metavar="FILE", help="compare with this policy file, offline, instead of a hub")
    d.set_defaults(func=_diff)
    a = sub.add_parser("apply", parents=[hub], help="admins: make NEW.yaml the policy in force")
    a.add_argument("file")
    a.add_argument("--summary", help="one line for the history (default: what changed)")
    a.add_argument(
        "--force",
        action="store_true",
        help="apply although the new policy promises what this hub cannot keep (the warnings `diff` shows)",
    )
    a.set_defaults(func=_apply)
    h = sub.add_parser("history", parents=[hub], help="the policy's versions: hash, who, when, summary")
    h.set_defaults(func=_history)
    r = sub.add_parser("rollback", parents=[hub], help="admins: apply an old version again (number or hash)")
    r.add_argument("version")
    r.set_defaults(func=_rollback)
    args = p.parse_args(argv)
    try:
        return args.func(args)
    except HubError as e:
        report(f"gpuhub policy {args.command}", e)
        _issues(getattr(args, "file", "new policy"), e.issues)
        return 1
