#!/usr/bin/env bash
# Build the real control plane's binaries once, from the Go module proxy, into a cache
# outside the repository keyed by component and version. Idempotent: a component whose
# binaries are in the cache is skipped. Usage: build.sh [etcd|kube|kwok|kueue|kuberay ...]
# Builds run under `nice -n 19` with GOFLAGS=-p=2 (a shared 2-core machine); each logs to
# $CACHE/logs/<component>-<version>.log and records its wall time in $CACHE/build-times.txt.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
. "$here/versions.env"
CACHE="${GPUHUB_CLUSTER_CACHE:-$HOME/.cache/gpuhub-cluster}"
GO="${GPUHUB_GO:-$(command -v go || echo /usr/local/go/bin/go)}"
[ -x "$GO" ] || { echo "build.sh: no Go toolchain (set GPUHUB_GO)" >&2; exit 2; }
export GOPATH="$CACHE/gopath" GOMODCACHE="$CACHE/gopath/pkg/mod" GOCACHE="$CACHE/go-build"
export GOFLAGS="-p=${GPUHUB_BUILD_JOBS:-2} -mod=mod" CGO_ENABLED=0 GOTOOLCHAIN=local
export GONOSUMDB= GOFLAGS
mkdir -p "$CACHE/logs"
# One build at a time per cache (a second caller waits, then finds the binaries there).
exec 9>"$CACHE/build.lock"
flock 9

timed() { # name version command...
  local name=$1 ver=$2; shift 2
  local log="$CACHE/logs/$name-$ver.log" t0 t1
  t0=$(date +%s)
  echo "building $name $ver (log: $log)"
  if ! ( "$@" ) >"$log" 2>&1; then echo "build of $name $ver failed; see $log" >&2; tail -20 "$log" >&2; return 1; fi
  t1=$(date +%s)
  echo "$name $ver $((t1 - t0))s $(date -u +%FT%TZ)" >>"$CACHE/build-times.txt"
  echo "built $name $ver in $((t1 - t0))s"
}

build_etcd() {
  local out="$CACHE/etcd-$ETCD_VERSION"
  [ -x "$out/bin/etcd" ] && return 0
  # go.etcd.io/etcd/server/v3 has `replace` directives to sibling folders, so `go install
  # mod@ver` refuses it; a wrapper module that requires it builds the same package.
  local w="$out/wrapper"; rm -rf "$w"; mkdir -p "$w" "$out/bin"
  timed etcd "$ETCD_VERSION" bash -c "
    cd '$w' && '$GO' mod init gpuhub.local/etcd-wrapper >/dev/null 2>&1
    '$GO' get go.etcd.io/etcd/server/v3@$ETCD_VERSION
    nice -n 19 '$GO' build -trimpath -o '$out/bin/etcd.tmp' go.etcd.io/etcd/server/v3
    mv '$out/bin/etcd.tmp' '$out/bin/etcd'"
}

build_kube() {
  local out="$CACHE/kube-$KUBE_VERSION" c
  local cmds="kube-apiserver kube-controller-manager kube-scheduler"
  local missing=0; for c in $cmds; do [ -x "$out/bin/$c" ] || missing=1; done
  [ $missing = 0 ] && return 0
  # k8s.io/kubernetes replaces its k8s.io/* staging modules with ./staging/src/...; a module
  # that requires it must pin each of them to the published v0.x of the same release.
  local w="$out/wrapper"; rm -rf "$w"; mkdir -p "$w" "$out/bin"
  timed kube "$KUBE_VERSION" bash -c "
    set -e; cd '$w'
    '$GO' mod init gpuhub.local/kube-wrapper >/dev/null 2>&1
    modfile=\$('$GO' mod download -json k8s.io/kubernetes@$KUBE_VERSION | sed -n 's/.*\"GoMod\": \"\\(.*\\)\",/\\1/p')
    {
      echo 'require k8s.io/kubernetes $KUBE_VERSION'
      echo 'replace ('
      sed -n 's#^[[:space:]]*\\(k8s.io/[^ ]*\\) => ./staging/src/.*#\\t\\1 => \\1 $KUBE_STAGING_VERSION#p' \"\$modfile\"
      echo ')'
    } >> go.mod
    cat go.mod
    for c in $cmds; do
      nice -n 19 '$GO' build -trimpath -ldflags '-X k8s.io/component-base/version.gitVersion=$KUBE_VERSION -X k8s.io/client-go/pkg/version.gitVersion=$KUBE_VERSION' -o '$out/bin/'\$c.tmp k8s.io/kubernetes/cmd/\$c
      mv '$out/bin/'\$c.tmp '$out/bin/'\$c
      echo \"\$c done at \$(date +%T)\"
    done"
}

# kwok and Kueue: `go install mod/cmd@version` would build them with the k8s.io/* patch
# versions their go.mod names (v0.36.1, v0.36.2). A wrapper module that requires them and pins
# every k8s.io/* staging module to $KUBE_STAGING_VERSION builds the same commands against the
# exact libraries kube-apiserver was built from, so the Go build cache compiles those once
# (on 2 shared cores this saves more than a third of their build time). Same minor release.
staging_replaces() { # go.mod "replace" block pinning every k8s.io staging module
  local modfile
  modfile=$("$GO" mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/.*"GoMod": "\(.*\)",/\1/p')
  echo 'replace ('
  sed -n "s#^[[:space:]]*\(k8s.io/[^ ]*\) => ./staging/src/.*#\t\1 => \1 $KUBE_STAGING_VERSION#p" "$modfile"
  echo ')'
}

wrapper_build() { # name version module package binary
  local name=$1 ver=$2 mod=$3 pkg=$4 bin=$5
  local out="$CACHE/$name-$ver"
  [ -x "$out/bin/$bin" ] && return 0
  local w="$out/wrapper"; rm -rf "$w"; mkdir -p "$w" "$out/bin"
  timed "$name" "$ver" bash -c "
    set -e; cd '$w'
    '$GO' mod init gpuhub.local/$name-wrapper >/dev/null 2>&1
    $(declare -f staging_replaces); GO='$GO' KUBE_VERSION='$KUBE_VERSION' KUBE_STAGING_VERSION='$KUBE_STAGING_VERSION' staging_replaces >> go.mod
    '$GO' get '$mod@$ver'
    cat go.mod
    nice -n 19 '$GO' build -trimpath -o '$out/bin/$bin.tmp' '$pkg'
    mv '$out/bin/$bin.tmp' '$out/bin/$bin'"
}

build_kwok() { wrapper_build kwok "$KWOK_VERSION" sigs.k8s.io/kwok sigs.k8s.io/kwok/cmd/kwok kwok; }
build_kueue() { wrapper_build kueue "$KUEUE_VERSION" sigs.k8s.io/kueue sigs.k8s.io/kueue/cmd/kueue kueue; }

# KubeRay's operator (issue 24): its module has no replace directives, so `go install mod@ver`
# builds it with the k8s.io/* and controller-runtime versions its own go.mod names (v0.34.1,
# v0.22.1): pinning them to $KUBE_STAGING_VERSION would change the library it was released with.
# Only needed by the Ray tests; up.sh starts it when the binary is in the cache.
build_kuberay() {
  local out="$CACHE/kuberay-$KUBERAY_VERSION"
  [ -x "$out/bin/ray-operator" ] && return 0
  mkdir -p "$out/bin"
  timed kuberay "$KUBERAY_VERSION" bash -c "
    set -e; cd /tmp
    GOFLAGS='-p=${GPUHUB_BUILD_JOBS:-2}' GOBIN='$out/bin.tmp' nice -n 19 '$GO' install -trimpath github.com/ray-project/kuberay/ray-operator@$KUBERAY_VERSION
    mv '$out/bin.tmp/ray-operator' '$out/bin/ray-operator'; rmdir '$out/bin.tmp'"
}

components=("$@"); [ ${#components[@]} -gt 0 ] || components=(etcd kube kwok kueue kuberay)
for c in "${components[@]}"; do "build_$c"; done
