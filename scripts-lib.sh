# Shared by run-hub.sh and run-tests.sh: install what gpuhub needs, idempotently.

# uv installs the locked set (requirements.lock, relock.sh) in ~40 s where pip takes ~110 s
# (2 cores): it downloads and unpacks in parallel, and with every version pinned there is no
# resolver search. Both take the same pins; pip is the fallback wherever uv cannot be had.
UV_VERSION="0.13.9"

ensure_venv() {
  local extras="$1"
  local py="${PYTHON:-python3}"
  if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv
  fi
  # Re-install only when the project definition changed since the last install.
  local stamp=".venv/.gpuhub-installed"
  local want
  # (the notebook package's lab extension and server config are copied at install time, so they count too)
  want="$( (sha256sum pyproject.toml images/gpuhub-notebook/pyproject.toml; \
            [ -f requirements.lock ] && sha256sum requirements.lock; \
            find images/gpuhub-notebook/src/gpuhub_notebook/labextension images/gpuhub-notebook/jupyter-config \
                 -type f -exec sha256sum {} + 2>/dev/null | sort) \
          | sha256sum | cut -c1-16) $extras"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    local notebook=()
    [ -f images/gpuhub-notebook/pyproject.toml ] && notebook=(-e images/gpuhub-notebook)
    # (the venv's own pip, no self-upgrade first: the bundled one installs all of this)
    local pip=(env PIP_DISABLE_PIP_VERSION_CHECK=1 .venv/bin/python -m pip install --quiet)
    if [ -f requirements.lock ]; then
      # The pins CI last passed with; bytecode compiled now, as pip does (the servers run as
      # other accounts and could not write it into .venv at their first import).
      if ! { "${pip[@]}" "uv==$UV_VERSION" \
          && .venv/bin/uv pip install --quiet --python .venv/bin/python --compile-bytecode \
               -c requirements.lock -e "$extras" "${notebook[@]}"; }; then
        echo "uv could not install the locked set; pip installs it..." >&2
        if ! "${pip[@]}" -c requirements.lock -e "$extras" "${notebook[@]}"; then
          echo "requirements.lock does not install here (another Python?); pip resolves without it (./relock.sh writes a new one)" >&2
          "${pip[@]}" -e "$extras" "${notebook[@]}"
        fi
      fi
    else
      "${pip[@]}" -e "$extras" "${notebook[@]}"  # one resolver run for both packages
    fi
    echo "$want" > "$stamp"
  fi
  # gpuhub's own code is installed editable, so no installer compiles it; where the environment
  # sets PYTHONDONTWRITEBYTECODE (CI's does) every hub, culler, launcher and CLI process then
  # compiles the package again at import (0.2 CPU-s of a hub's start). Compile it once here
  # (only what changed since the last run; a stale file is recompiled in memory as before).
  .venv/bin/python -m compileall -q -j 0 spawner/gpuhub_spawner images/gpuhub-notebook/src > /dev/null || true
}

# The Debian packages the ensure_* functions below would install, all in one apt-get (one
# index update, not one per tool), started in the background so that it runs while pip
# installs: neither needs the other. wait_system_packages waits for it; the ensure_*
# functions then find their tools there (or say what is missing, as before).
SYSTEM_PACKAGES_PID=""
SYSTEM_PACKAGES_LOG=""
start_system_packages() {
  [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null || return 0
  local plain=() full=()
  command -v npm >/dev/null || plain+=(nodejs npm)
  command -v ip >/dev/null || plain+=(iproute2)
  command -v nft >/dev/null || [ -x /usr/sbin/nft ] || plain+=(nftables)
  [ -x /usr/bin/chromium ] || full+=(chromium)  # with its recommends, as ensure_chromium
  [ -x /usr/bin/prometheus ] || plain+=(prometheus)
  command -v gcc >/dev/null || plain+=(gcc libc6-dev)
  command -v strace >/dev/null || plain+=(strace)
  [ "${#plain[@]}" -gt 0 ] || [ "${#full[@]}" -gt 0 ] || return 0
  echo "Installing Debian's ${full[*]} ${plain[*]} (beside pip)..." >&2
  SYSTEM_PACKAGES_LOG="$(mktemp)"
  (
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    if [ "${#full[@]}" -gt 0 ]; then apt-get install -y -qq "${full[@]}"; fi
    if [ "${#plain[@]}" -gt 0 ]; then apt-get install -y -qq --no-install-recommends "${plain[@]}"; fi
  ) >"$SYSTEM_PACKAGES_LOG" 2>&1 &
  SYSTEM_PACKAGES_PID=$!
}

wait_system_packages() {
  [ -n "$SYSTEM_PACKAGES_PID" ] || return 0
  if ! wait "$SYSTEM_PACKAGES_PID"; then
    echo "apt-get in the background failed (the ensure_* steps try again):" >&2
    tail -20 "$SYSTEM_PACKAGES_LOG" >&2
  fi
  rm -f "$SYSTEM_PACKAGES_LOG"
  SYSTEM_PACKAGES_PID=""
}

# The Node configurable-http-proxy, as z2jh ships it: it routes by host (per-user subdomains)
# and has no cap on concurrent streams. Installed from the npm registry into .venv/node.
CHP_VERSION="5.3.0"
ensure_node_proxy() {
  local bin=".venv/node/node_modules/.bin/configurable-http-proxy"
  if [ -x "$bin" ] && [ "$(cat .venv/node/.version 2>/dev/null)" = "$CHP_VERSION" ]; then
    return 0
  fi
  if ! command -v npm >/dev/null; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
      echo "Installing Debian's nodejs and npm for the proxy..." >&2
      apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
    else
      echo "No npm: falling back to the Python proxy WITHOUT per-user subdomains (see docs/security.md)" >&2
      return 0
    fi
  fi
  mkdir -p .venv/node
  npm install --silent --no-audit --no-fund --prefix .venv/node "configurable-http-proxy@$CHP_VERSION" >/dev/null
  echo "$CHP_VERSION" > .venv/node/.version
}

ensure_prometheus() {
  # Debian's Prometheus: the metrics test scrapes a real hub with it (skipped without it).
  if [ -x /usr/bin/prometheus ]; then return 0; fi
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    echo "Installing Debian's prometheus for the metrics test..." >&2
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  else
    echo "No /usr/bin/prometheus and not root: the Prometheus scrape test will be skipped" >&2
  fi
}

ensure_chromium() {
  if [ -x /usr/bin/chromium ]; then return 0; fi
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    echo "Installing Debian's chromium for the browser tests..." >&2
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "No /usr/bin/chromium and not root: browser tests will be skipped" >&2
  fi
}

ensure_attack_tools() {
  # gcc builds the attack library of the root-launcher test; strace watches the launcher's execve.
  local missing=()
  command -v gcc >/dev/null || missing+=(gcc libc6-dev)
  command -v strace >/dev/null || missing+=(strace)
  if [ "${#missing[@]}" -eq 0 ]; then return 0; fi
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    echo "Installing Debian's ${missing[*]} for the root-launcher attack test..." >&2
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "No ${missing[*]} and not root: parts of the root-launcher attack test will be skipped" >&2
  fi
}

ensure_wall_tools() {
  # As root every user's servers run behind a wall of their own (docs/install-one-machine.md):
  # iproute2's `ip` builds it, nftables' `nft` lets users reach the network beyond the machine.
  [ "$(id -u)" = "0" ] || return 0
  local missing=()
  command -v ip >/dev/null || missing+=(iproute2)
  command -v nft >/dev/null || [ -x /usr/sbin/nft ] || missing+=(nftables)
  if [ "${#missing[@]}" -eq 0 ]; then return 0; fi
  if command -v apt-get >/dev/null; then
    echo "Installing Debian's ${missing[*]} for the wall around each user..." >&2
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "No ${missing[*]}: the hub will say what of the wall around each user it cannot build" >&2
  fi
}
