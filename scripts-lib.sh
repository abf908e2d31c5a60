# Shared by run-hub.sh and run-tests.sh: install what gpuhub needs, idempotently.

ensure_venv() {
  local extras="$1"
  local py="${PYTHON:-python3}"
  if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv
  fi
  # Re-install only when the project definition changed since the last install.
  local stamp=".venv/.gpuhub-installed"
  local want
  # (the notebook package's lab extension is copied at install time, so it counts too)
  want="$( (sha256sum pyproject.toml images/gpuhub-notebook/pyproject.toml; \
            find images/gpuhub-notebook/src/gpuhub_notebook/labextension -type f -exec sha256sum {} + 2>/dev/null | sort) \
          | sha256sum | cut -c1-16) $extras"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip >/dev/null
    .venv/bin/python -m pip install --quiet -e "$extras"
    if [ -f images/gpuhub-notebook/pyproject.toml ]; then
      .venv/bin/python -m pip install --quiet -e images/gpuhub-notebook
    fi
    echo "$want" > "$stamp"
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
