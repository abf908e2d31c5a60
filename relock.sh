#!/usr/bin/env bash
# Write requirements.lock: every package .venv gets for gpuhub with all its extras and the
# notebook package, at the version pip resolves for this machine's Python. ensure_venv
# (scripts-lib.sh) installs with it as constraints, so a release upstream cannot change what
# CI installs between two runs, and uv installs it without a resolver's search. Run it when a
# dependency in pyproject.toml (or the notebook package's) changes; commit both.
set -euo pipefail
cd "$(dirname "$0")"
py="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$py" -m pip install -q --disable-pip-version-check --dry-run --ignore-installed --report "$work/report.json" \
  -e ".[lab,mlflow,migrate,ray,test]" -e images/gpuhub-notebook
"$py" - "$work/report.json" > requirements.lock <<'PY'
import json, platform, sys
report = json.load(open(sys.argv[1]))
print("# Written by relock.sh from pyproject.toml and images/gpuhub-notebook (do not edit: change those, run it).")
print(f"# Resolved by pip {report.get('pip_version', '?')} for CPython {platform.python_version()} on {platform.machine()}.")
own = {"gpuhub-spawner", "gpuhub-notebook"}
for name, version in sorted((i["metadata"]["name"].lower(), i["metadata"]["version"]) for i in report["install"]):
    if name not in own:
        print(f"{name}=={version}")
PY
echo "requirements.lock: $(grep -c '==' requirements.lock) packages" >&2
