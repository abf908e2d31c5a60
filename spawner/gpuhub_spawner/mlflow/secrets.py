"""The MLflow service's own secret, and the passwords derived from it.

One random key lives in ``<state_dir>/service.key`` (mode 0600, created on first
start). Every MLflow password the service uses is an HMAC of that key: the admin
password and one password per hub user. Nothing else stores or transmits them, so
no notebook, spawner, hub config or pod spec ever holds an MLflow credential; the
only process that can act as a user on MLflow is this service, and only after the
hub has vouched for that user.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from ..policy.files import write_atomically

KEY_FILE = "service.key"


def ensure_private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def load_or_create_key(state_dir: Path) -> bytes:
    """The service key, created atomically with mode 0600 on first use."""
    ensure_private_dir(state_dir)
    path = state_dir / KEY_FILE
    try:
        key = path.read_bytes().strip()
        if len(key) >= 32:
            return key
    except FileNotFoundError:
        pass
    key = secrets.token_hex(32).encode()
    write_atomically(path, key, 0o600)
    return key


class Passwords:
    """Derives stable passwords from the service key; never logs or returns the key."""

    def __init__(self, key: bytes):
        self._key = key

    def __repr__(self) -> str:  # keep the key out of tracebacks and logs
        return "Passwords(<hidden>)"

    def _derive(self, purpose: str) -> str:
        return hmac.new(self._key, purpose.encode(), hashlib.sha256).hexdigest()

    def user(self, username: str) -> str:
        return self._derive(f"mlflow-user:{username}")

    def admin(self) -> str:
        return self._derive("mlflow-admin")

    def flask_secret(self) -> str:
        return self._derive("mlflow-flask-secret")
