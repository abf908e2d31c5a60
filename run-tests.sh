#!/usr/bin/env bash
# Run the whole test suite. Installs what it needs (Python deps into .venv; Debian's
# chromium, prometheus, gcc and strace for the browser, metrics and attack tests when running as root). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
source ./scripts-lib.sh
ensure_venv ".[lab,mlflow,test]"
ensure_node_proxy
ensure_chromium
ensure_prometheus
ensure_attack_tools
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"
