#!/usr/bin/env bash
# Write notebook-requirements.lock from notebook-requirements.in: every package the images add,
# with its exact version, resolved by pip for the images' Python (docker-stacks: CPython 3.12 on
# manylinux x86_64) from wheels only. Run it when an .in line changes, commit both, rebuild.
set -euo pipefail
cd "$(dirname "$0")"
py="${PYTHON:-../.venv/bin/python}"
pyver="${IMAGE_PYTHON_VERSION:-3.12}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$py" -m pip install -q --dry-run --ignore-installed --report "$work/report.json" --only-binary=:all: \
  --python-version "$pyver" --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --target "$work/target" -r notebook-requirements.in
"$py" - "$work/report.json" "$pyver" > notebook-requirements.lock <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
print("# Written by images/relock.sh from notebook-requirements.in (do not edit: change the .in, run it).")
print(f"# Resolved by pip {report.get('pip_version', '?')} for CPython {sys.argv[2]} on manylinux x86_64, wheels only.")
for name, version in sorted((i["metadata"]["name"].lower(), i["metadata"]["version"]) for i in report["install"]):
    print(f"{name}=={version}")
PY
echo "notebook-requirements.lock: $(grep -c '==' notebook-requirements.lock) packages" >&2
