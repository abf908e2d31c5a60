#!/usr/bin/env bash
# Run the whole test suite. Installs what it needs (Python deps into .venv; Debian's
# chromium, prometheus, gcc and strace for the browser, metrics and attack tests when running as root). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
source ./scripts-lib.sh
start_system_packages # Debian's tools, in the background while pip installs
ensure_venv ".[lab,mlflow,ray,test]"
wait_system_packages
ensure_node_proxy
ensure_wall_tools
ensure_chromium
ensure_prometheus
ensure_attack_tools
# Parallel workers (pytest-xdist; 4: on 2 cores they keep both ~75% busy with real hubs,
# servers, MLflow and Chromium, where 2 left them waiting. 6 kept them ~99% busy from the fifth
# minute and took 15:24-16:41 of tests against 16:43-17:03, but under that load 2 of 4 whole
# runs failed a test (runs 38-42, 2026-12-05: JupyterLab's theme twice in a row, and a race
# in the lab extension, since fixed, that the load exposed), where runs 33-36 with 4 passed), each taking whole test files (a module's hub is shared by
# its tests; every hub has its own ports, account prefix and data folder). The slowest files
# are handed out first (tests/conftest.py; --no-loadscope-reorder keeps that order, where
# xdist would hand out the files with the most tests first). GPUHUB_TEST_WORKERS=1 runs serially; an explicit
# -n / --numprocesses / -p no:xdist in the arguments wins.
# One layer (--layer NAME: unit tests, seconds each) runs in one process: four workers took
# longer to start than its tests take.
default_workers=4
if printf '%s\n' "$@" | grep -qE '^--layer(=.*)?$'; then
  default_workers=1
fi
workers="${GPUHUB_TEST_WORKERS:-$default_workers}"
xdist=()
if [ "$workers" != "1" ] && ! printf '%s\n' "$@" | grep -qE '^(-n|--numprocesses)(=?[0-9a-z]*)?$|^-n[0-9]+$|no:xdist'; then
  xdist=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
# Python may write its bytecode caches here, whatever the environment says (CI's sets
# PYTHONDONTWRITEBYTECODE): without them every worker compiles and assert-rewrites all 180 test
# files again at collection (7 CPU-s each, 2.4 with the caches) and every hub its imports.
unset PYTHONDONTWRITEBYTECODE
set +e
.venv/bin/python -m pytest ${xdist[@]+"${xdist[@]}"} "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
