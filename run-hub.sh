#!/usr/bin/env bash
# Start gpuhub on one machine: http://localhost:8000 (each user server on <user>.localhost:8000) (demo users, virtual GPUs without NVML).
# Installs what it needs into .venv on first use. Extra arguments go to `gpuhub run`.
set -euo pipefail
cd "$(dirname "$0")"
source ./scripts-lib.sh
ensure_venv ".[lab,mlflow,ray]"  # ray: `gpuhub ray up` on the demo (docs/ray.md)
ensure_node_proxy
ensure_wall_tools
exec .venv/bin/gpuhub run "$@"
