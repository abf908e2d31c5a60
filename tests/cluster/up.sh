#!/usr/bin/env bash
# Start a real Kubernetes control plane on this machine, without containers:
#   etcd, kube-apiserver, kube-controller-manager, kube-scheduler (Kubernetes 1.36),
#   kwok (fake nodes: GPU nodes labelled and tainted as the NVIDIA GPU Operator does, CPU
#   nodes; it fakes pod status), and the real Kueue controller v0.19.2 with its CRDs,
#   webhooks (serving certs made here) and visibility API; KubeRay's operator v1.5.0 with its
#   CRDs when build.sh kuberay has built it (issue 24).
# Builds missing binaries first (tests/cluster/build.sh; ~once per machine), then starts from
# the cache. Idempotent: a second `up.sh` with everything running only re-checks health.
# Writes $GPUHUB_CLUSTER_DIR/kubeconfig (default /tmp/gpuhub-cluster/kubeconfig).
# Stop with tests/cluster/down.sh (add --purge to drop etcd's data and certs).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
. "$here/versions.env"
CACHE="${GPUHUB_CLUSTER_CACHE:-$HOME/.cache/gpuhub-cluster}"
DIR="${GPUHUB_CLUSTER_DIR:-/tmp/gpuhub-cluster}"
BASE="${GPUHUB_CLUSTER_PORT_BASE:-32300}"
ETCD_PORT=$((BASE + 79)) ETCD_PEER=$((BASE + 80)) API_PORT=$((BASE + 43)) KCM_PORT=$((BASE + 57))
SCHED_PORT=$((BASE + 59)) KWOK_PORT=$((BASE + 47)) WEBHOOK_PORT=$((BASE + 44)) VIS_PORT=$((BASE + 82))
KUEUE_HEALTH=$((BASE + 81)) KUEUE_METRICS=$((BASE + 85))
BIN_ETCD="$CACHE/etcd-$ETCD_VERSION/bin" BIN_KUBE="$CACHE/kube-$KUBE_VERSION/bin"
BIN_KWOK="$CACHE/kwok-$KWOK_VERSION/bin" BIN_KUEUE="$CACHE/kueue-$KUEUE_VERSION/bin"
KUEUE_MOD="$CACHE/gopath/pkg/mod/sigs.k8s.io/kueue@$KUEUE_VERSION"
# KubeRay (issue 24): its CRDs (RayCluster, RayJob, RayService) always, from its module (a
# download, no build), installed before Kueue starts: Kueue sets up its ray.io integrations
# only for CRDs that exist when it starts. The operator only when build.sh kuberay built it.
BIN_KUBERAY="$CACHE/kuberay-$KUBERAY_VERSION/bin"
KUBERAY_MOD="$CACHE/gopath/pkg/mod/github.com/ray-project/kuberay/ray-operator@$KUBERAY_VERSION"
KUBERAY_HEALTH=$((BASE + 83)) KUBERAY_METRICS=$((BASE + 84))
SCHEMAS="${GPUHUB_SHARED_DIR:-$repo/../shared}/schemas/kueue-$KUEUE_VERSION"
KUBECTL="${GPUHUB_KUBECTL:-$(command -v kubectl || true)}"
PKI="$DIR/pki" LOGS="$DIR/logs" RUN="$DIR/run"
export KUBECONFIG="$DIR/kubeconfig"
t_start=$(date +%s.%N)
log() { printf '[up %6.1fs] %s\n' "$(echo "$(date +%s.%N) - $t_start" | bc)" "$*"; }

# -- binaries --------------------------------------------------------------------------------
need_build=()
[ -x "$BIN_ETCD/etcd" ] || need_build+=(etcd)
for c in kube-apiserver kube-controller-manager kube-scheduler; do [ -x "$BIN_KUBE/$c" ] || { need_build+=(kube); break; }; done
[ -x "$BIN_KWOK/kwok" ] || need_build+=(kwok)
[ -x "$BIN_KUEUE/kueue" ] || need_build+=(kueue)
if [ ${#need_build[@]} -gt 0 ]; then
  log "building ${need_build[*]} (once; see $CACHE/logs)"
  "$here/build.sh" "${need_build[@]}"
fi
# Kueue's install objects and kwok's stages are read from their modules (the Go module proxy).
if [ ! -d "$KUEUE_MOD/config" ] || [ ! -d "$CACHE/gopath/pkg/mod/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize" ]; then
  (cd /tmp && GOPATH="$CACHE/gopath" GOMODCACHE="$CACHE/gopath/pkg/mod" GOFLAGS=-mod=mod "${GPUHUB_GO:-/usr/local/go/bin/go}" \
    mod download "sigs.k8s.io/kueue@$KUEUE_VERSION" "sigs.k8s.io/kwok@$KWOK_VERSION")
fi
if [ ! -d "$KUBERAY_MOD/config/crd/bases" ]; then
  (cd /tmp && GOPATH="$CACHE/gopath" GOMODCACHE="$CACHE/gopath/pkg/mod" GOFLAGS=-mod=mod "${GPUHUB_GO:-/usr/local/go/bin/go}" \
    mod download "github.com/ray-project/kuberay/ray-operator@$KUBERAY_VERSION")
fi
[ -n "$KUBECTL" ] || { echo "up.sh: kubectl not found (set GPUHUB_KUBECTL)" >&2; exit 2; }
[ -d "$SCHEMAS" ] || { echo "up.sh: Kueue CRDs not found at $SCHEMAS (set GPUHUB_SHARED_DIR)" >&2; exit 2; }
mkdir -p "$PKI" "$LOGS" "$RUN" "$DIR/etcd" "$DIR/kueue-certs/webhook" "$DIR/kueue-certs/visibility" "$DIR/kueue-certs/metrics"

# -- certificates (made once per $DIR) -------------------------------------------------------
cert() { # name CN O SAN-ext signer
  local name=$1 cn=$2 o=$3 san=$4 ca=${5:-ca}
  [ -s "$PKI/$name.crt" ] && return 0
  openssl req -new -newkey rsa:2048 -nodes -keyout "$PKI/$name.key" -subj "/CN=$cn${o:+/O=$o}" -out "$PKI/$name.csr" 2>/dev/null
  printf 'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n%s\n' \
    "${san:+subjectAltName=$san}" >"$PKI/$name.ext"
  openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/$ca.crt" -CAkey "$PKI/$ca.key" -CAcreateserial -days 3650 \
    -extfile "$PKI/$name.ext" -out "$PKI/$name.crt" 2>/dev/null
}
if [ ! -s "$PKI/ca.crt" ]; then
  for ca in ca front-proxy-ca; do
    openssl req -x509 -new -newkey rsa:2048 -nodes -keyout "$PKI/$ca.key" -subj "/CN=gpuhub-cluster-$ca" -days 3650 -out "$PKI/$ca.crt" 2>/dev/null
  done
  openssl genrsa -out "$PKI/sa.key" 2048 2>/dev/null && openssl rsa -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
fi
cert apiserver kube-apiserver "" "DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,IP:127.0.0.1,IP:10.96.0.1"
cert admin admin system:masters ""
cert front-proxy-client front-proxy-client "" "" front-proxy-ca
cert kueue-webhook localhost "" "DNS:localhost,DNS:kueue-webhook-service.kueue-system.svc,IP:127.0.0.1"
for d in webhook visibility metrics; do cp "$PKI/kueue-webhook.crt" "$DIR/kueue-certs/$d/tls.crt"; cp "$PKI/kueue-webhook.key" "$DIR/kueue-certs/$d/tls.key"; cp "$PKI/ca.crt" "$DIR/kueue-certs/$d/ca.crt"; done

cat >"$KUBECONFIG" <<KC
apiVersion: v1
kind: Config
clusters:
- name: gpuhub-cluster
  cluster: {server: "https://127.0.0.1:$API_PORT", certificate-authority: "$PKI/ca.crt"}
users:
- name: admin
  user: {client-certificate: "$PKI/admin.crt", client-key: "$PKI/admin.key"}
contexts:
- name: gpuhub-cluster
  context: {cluster: gpuhub-cluster, user: admin}
current-context: gpuhub-cluster
KC

# -- processes ----------------------------------------------------------------------------
running() { [ -s "$RUN/$1.pid" ] && kill -0 "$(cat "$RUN/$1.pid")" 2>/dev/null; }
start() { # name command... (own session; pid in $RUN/name.pid; log in $LOGS/name.log)
  local name=$1; shift
  if running "$name"; then log "$name already running (pid $(cat "$RUN/$name.pid"))"; return 0; fi
  setsid "$@" >>"$LOGS/$name.log" 2>&1 < /dev/null &
  echo $! >"$RUN/$name.pid"
  log "started $name (pid $!, log $LOGS/$name.log)"
}
wait_for() { # what seconds command...
  local what=$1 secs=$2; shift 2
  local deadline=$(( $(date +%s) + secs ))
  until "$@" >/dev/null 2>&1; do
    if [ "$(date +%s)" -ge "$deadline" ]; then echo "up.sh: $what not ready in ${secs}s; logs in $LOGS" >&2; tail -n 20 "$LOGS"/*.log >&2; exit 1; fi
    sleep 0.5
  done
  log "$what ready"
}
k() { "$KUBECTL" --kubeconfig "$KUBECONFIG" "$@"; }

start etcd "$BIN_ETCD/etcd" --name gpuhub --data-dir "$DIR/etcd" \
  --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER" \
  --initial-cluster "gpuhub=http://127.0.0.1:$ETCD_PEER" --unsafe-no-fsync --quota-backend-bytes=2147483648 --log-level=warn
wait_for etcd 30 curl -sf "http://127.0.0.1:$ETCD_PORT/health"

# The API server's audit log records every request of the hub's service account (and nothing
# else): the real-plane tests run the hub with that identity (harness.install_hub_identity)
# and fail on any request the RBAC authorizer refused it (harness.hub_requests, issue 40).
cat >"$DIR/audit-policy.yaml" <<'AUDIT'
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    users: ["system:serviceaccount:gpuhub:hub"]
  - level: None
AUDIT
start kube-apiserver "$BIN_KUBE/kube-apiserver" --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
  --audit-policy-file="$DIR/audit-policy.yaml" --audit-log-path="$LOGS/audit.log" --audit-log-format=json \
  --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$API_PORT" \
  --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" --client-ca-file="$PKI/ca.crt" \
  --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local --service-cluster-ip-range=10.96.0.0/16 \
  --authorization-mode=Node,RBAC --allow-privileged=true --endpoint-reconciler-type=none \
  --proxy-client-cert-file="$PKI/front-proxy-client.crt" --proxy-client-key-file="$PKI/front-proxy-client.key" \
  --requestheader-client-ca-file="$PKI/front-proxy-ca.crt" --requestheader-allowed-names=front-proxy-client \
  --requestheader-username-headers=X-Remote-User --requestheader-group-headers=X-Remote-Group \
  --requestheader-extra-headers-prefix=X-Remote-Extra- --enable-priority-and-fairness=false
wait_for kube-apiserver 90 k get --raw /readyz

start kube-controller-manager "$BIN_KUBE/kube-controller-manager" --kubeconfig="$KUBECONFIG" \
  --authentication-kubeconfig="$KUBECONFIG" --authorization-kubeconfig="$KUBECONFIG" \
  --bind-address=127.0.0.1 --secure-port="$KCM_PORT" --leader-elect=false \
  --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" \
  --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key" \
  --controllers='*,-nodeipam,-service-lb-controller,-cloud-node-lifecycle,-route' --use-service-account-credentials=false
start kube-scheduler "$BIN_KUBE/kube-scheduler" --kubeconfig="$KUBECONFIG" \
  --authentication-kubeconfig="$KUBECONFIG" --authorization-kubeconfig="$KUBECONFIG" \
  --bind-address=127.0.0.1 --secure-port="$SCHED_PORT" --leader-elect=false
# kwok's own "fast" stages (node-initialize, node-heartbeat-with-lease, pod-ready, pod-complete,
# pod-delete), from the kwok module of the same version. Its pod-complete (every Job's pod
# Succeeded as soon as it runs: what the chart's helm hook Jobs need) is kept out of the users'
# namespace: there a Job's pod ends when its command does (StandInKubelet in harness.py reports
# the exit code), so a preempted Job can be caught mid-run and resumed.
USERS_NS=gpuhub-users
kwok_mod="$CACHE/gopath/pkg/mod/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage"
for f in node/fast/node-initialize node/heartbeat-with-lease/node-heartbeat-with-lease pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete; do
  echo "---"
  if [ "$f" = pod/fast/pod-complete ]; then
    sed "s/^    matchExpressions:\$/    matchExpressions:\n    - key: '.metadata.namespace'\n      operator: 'NotIn'\n      values:\n      - '$USERS_NS'/" "$kwok_mod/$f.yaml"
  else
    cat "$kwok_mod/$f.yaml"
  fi
done >"$DIR/kwok.yaml"
grep -q "'$USERS_NS'" "$DIR/kwok.yaml" || { echo "up.sh: could not narrow kwok's pod-complete stage" >&2; exit 1; }
# kwok's Logs objects (its CRD, from the same module): StandInKubelet names each stand-in
# process's output file in one, so `kubectl logs` (and the hub's copy of a Job pod's log)
# reads, through the API server and kwok's kubelet port, what the pod's command wrote.
k apply --server-side --force-conflicts -f "$CACHE/gopath/pkg/mod/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/crd/bases/kwok.x-k8s.io_logs.yaml" >/dev/null
start kwok "$BIN_KWOK/kwok" --kubeconfig="$KUBECONFIG" --manage-all-nodes=true \
  --node-ip=127.0.0.1 --node-port="$KWOK_PORT" --server-address="127.0.0.1:$KWOK_PORT" \
  --node-lease-duration-seconds=40 --config="$DIR/kwok.yaml" --enable-crds=Logs

# -- Kueue: CRDs, namespace, webhooks, visibility API, then the controller -------------------
python3 "$here/kueue_manifests.py" "$KUEUE_MOD" "$WEBHOOK_PORT" "$VIS_PORT" "$PKI/ca.crt" "$SCHEMAS" >"$DIR/kueue-install.yaml"
k apply --server-side --force-conflicts -f "$DIR/kueue-install.yaml" >/dev/null
# RayCluster, RayJob, RayService: KubeRay's operator sets up a controller for each.
k apply --server-side --force-conflicts -f "$KUBERAY_MOD/config/crd/bases/" >/dev/null
log "KubeRay $KUBERAY_VERSION CRDs applied"
wait_for "Kueue CRDs established" 90 k wait --for=condition=Established crd --all --timeout=20s
# Kueue's configuration lives where an operator finds it: the ConfigMap kueue-manager-config
# (kueue-system), made as Kueue's release manifests make it, from the module's
# config/components/manager/controller_manager_config.yaml, when it is absent (an edit made
# as docs/install-kubernetes.md says survives a restart; `down.sh --purge` drops it). The
# process gets that configuration plus what a process on this machine needs (ports,
# certificates, no leader election): restarting Kueue here is what `kubectl rollout restart
# deploy kueue-controller-manager` is in a cluster.
if ! k -n kueue-system get configmap kueue-manager-config >/dev/null 2>&1; then
  k -n kueue-system create configmap kueue-manager-config \
    --from-file=controller_manager_config.yaml="$KUEUE_MOD/config/components/manager/controller_manager_config.yaml" >/dev/null
fi
k -n kueue-system get configmap kueue-manager-config -o jsonpath='{.data.controller_manager_config\.yaml}' >"$DIR/kueue-manager-config.yaml"
python3 - "$DIR/kueue-manager-config.yaml" "$DIR/kueue-config.yaml" "$WEBHOOK_PORT" "$KUEUE_HEALTH" "$VIS_PORT" "$DIR/kueue-certs/webhook" "$KUEUE_METRICS" <<'PY'
import sys, yaml
src, out, wh, health, vis, certs, metrics = sys.argv[1:]
cfg = yaml.safe_load(open(src))
print(f"[up] Kueue integrations from kueue-manager-config: {cfg['integrations']['frameworks']}")
cfg["namespace"] = "kueue-system"
cfg["health"] = {"healthProbeBindAddress": f"127.0.0.1:{health}"}
# Kueue's secure metrics endpoint (its certificate from /etc/kueue/metrics/certs, a bearer token
# checked by TokenReview/SubjectAccessReview) on this machine's loopback; the rest of the
# ConfigMap's metrics block (enableClusterQueueResources, the guide's step 4) is kept.
cfg["metrics"] = {**(cfg.get("metrics") or {}), "bindAddress": f"127.0.0.1:{metrics}"}
cfg["webhook"] = {"port": int(wh), "host": "127.0.0.1", "certDir": certs}
cfg["leaderElection"] = {"leaderElect": False}
cfg["internalCertManagement"] = {"enable": False}
cfg["visibilityServer"] = {"bindAddress": "127.0.0.1", "bindPort": int(vis)}
yaml.safe_dump(cfg, open(out, "w"), sort_keys=False)
PY
# Kueue reads its visibility and metrics certificates from fixed paths (/visibility,
# /etc/kueue/metrics/certs: the Secret mounts of its Deployment); a private mount namespace
# puts ours there without touching the host's files (the two mount points are created empty).
mkdir -p /visibility /etc/kueue/metrics/certs
start kueue unshare --mount --propagation private sh -c "
  mount --bind '$DIR/kueue-certs/visibility' /visibility &&
  mount --bind '$DIR/kueue-certs/metrics' /etc/kueue/metrics/certs &&
  exec '$BIN_KUEUE/kueue' --config='$DIR/kueue-config.yaml' --kubeconfig='$KUBECONFIG' --zap-log-level=2"

# KubeRay's operator as its Deployment runs it (no webhooks: ENABLE_WEBHOOKS unset), watching
# every namespace; no leader election on one machine.
if [ -x "$BIN_KUBERAY/ray-operator" ]; then
  start kuberay "$BIN_KUBERAY/ray-operator" --kubeconfig="$KUBECONFIG" --enable-leader-election=false \
    --health-probe-bind-address="127.0.0.1:$KUBERAY_HEALTH" --metrics-addr="127.0.0.1:$KUBERAY_METRICS" --log-stdout-encoder=console
fi

# -- nodes ---------------------------------------------------------------------------------
# (The MIG nodes of nodes-mig.yaml are not applied here: harness.add_mig_nodes() puts them in
# for the tests that need them and remove_mig_nodes() takes them out.)
k apply --server-side --force-conflicts -f "$here/nodes.yaml" >/dev/null
wait_for "kwok nodes Ready" 90 k wait --for=condition=Ready node --all --timeout=20s
wait_for "default service account" 60 k -n default get serviceaccount default
wait_for "Kueue health" 90 curl -sf "http://127.0.0.1:$KUEUE_HEALTH/readyz"
wait_for "Kueue webhook" 60 k create --dry-run=server -f - <<'RF'
apiVersion: kueue.x-k8s.io/v1beta2
kind: ResourceFlavor
metadata: {name: gpuhub-cluster-probe}
RF
wait_for "Kueue visibility API" 60 sh -c "'$KUBECTL' --kubeconfig '$KUBECONFIG' get apiservice v1beta2.visibility.kueue.x-k8s.io -o jsonpath='{.status.conditions[?(@.type==\"Available\")].status}' | grep -qx True"
if [ -x "$BIN_KUBERAY/ray-operator" ]; then
  wait_for "KubeRay operator health" 60 curl -sf "http://127.0.0.1:$KUBERAY_HEALTH/readyz"
fi
elapsed=$(echo "$(date +%s.%N) - $t_start" | bc)
printf '%s\n' "$elapsed" >"$DIR/last-start-seconds"
log "control plane up in ${elapsed}s: export KUBECONFIG=$KUBECONFIG"
