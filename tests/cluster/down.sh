#!/usr/bin/env bash
# Stop everything tests/cluster/up.sh started (by the pids it recorded), newest first.
# --purge also removes $GPUHUB_CLUSTER_DIR (etcd's data, certificates, logs): the next up.sh
# starts from an empty cluster. The build cache is never touched.
set -uo pipefail
DIR="${GPUHUB_CLUSTER_DIR:-/tmp/gpuhub-cluster}"
RUN="$DIR/run"
for name in kuberay kueue kwok kube-scheduler kube-controller-manager kube-apiserver etcd; do
  f="$RUN/$name.pid"
  [ -s "$f" ] || continue
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
    echo "stopped $name (pid $pid)"
  fi
  rm -f "$f"
done
if [ "${1:-}" = "--purge" ]; then
  rm -rf "$DIR"
  rmdir /visibility /etc/kueue/metrics/certs /etc/kueue/metrics /etc/kueue 2>/dev/null || true
  echo "removed $DIR"
fi
