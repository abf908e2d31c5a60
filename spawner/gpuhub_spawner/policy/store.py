"""The live policy: re-read on change, never replaced by a broken edit.

Both backends read the policy through one ``PolicyStore``. A change to the file is
picked up on the next check (a cheap ``stat``, done before every spawn and every few
seconds by the hub); an invalid edit is logged with its located errors and reported
as ``stale`` while the last good policy keeps serving.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from traitlets import Float, Unicode
from traitlets.config import SingletonConfigurable

from .loader import PolicyError, load_policy
from .model import Policy


@dataclass
class PolicyStatus:
    path: str
    loaded_at: float | None = None
    loaded_mtime: float | None = None
    stale: bool = False
    errors: list[str] = field(default_factory=list)
    failed_at: float | None = None

    def as_dict(self) -> dict:
        return {
            "path": self.path,
            "loaded_at": self.loaded_at,
            "stale": self.stale,
            "errors": self.errors,
            "failed_at": self.failed_at,
        }


def _signature(path: Path) -> tuple[float, int, int] | None:
    # mtime alone misses two writes within one tick; ConfigMap updates swap a symlink,
    # so stat() follows it and the inode changes.
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime, st.st_size, st.st_ino)


class PolicyStore(SingletonConfigurable):
    policy_file = Unicode(
        os.environ.get("GPUHUB_POLICY", "profiles.yaml"),
        help="Path of the policy YAML (teams, flavors, quotas, profiles, idle rules).",
    ).tag(config=True)

    check_interval = Float(
        2.0, help="Seconds between background checks of the policy file for changes."
    ).tag(config=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.log = logging.getLogger("JupyterHub.gpuhub.policy")
        self._policy: Policy | None = None
        self._signature = None
        self.status = PolicyStatus(path=self.policy_file)
        self._listeners: list[Callable[[Policy], None]] = []
        self.refresh()
        if self._policy is None:
            # Without one good policy the hub cannot decide anything safely: refuse to start.
            raise RuntimeError(
                "gpuhub cannot start: no valid policy\n" + "\n".join(self.status.errors)
            )

    @property
    def policy(self) -> Policy:
        self.refresh()
        assert self._policy is not None
        return self._policy

    @property
    def current(self) -> Policy:
        """The policy in force, without checking the file (safe inside callbacks)."""
        assert self._policy is not None
        return self._policy

    def on_change(self, callback: Callable[[Policy], None]) -> None:
        """Call ``callback(policy)`` after every successful reload (queue re-evaluation)."""
        self._listeners.append(callback)

    def refresh(self) -> bool:
        """Reload if the file changed; return True when a new policy took effect."""
        path = Path(self.policy_file)
        sig = _signature(path)
        if sig == self._signature and self._policy is not None:
            return False
        self._signature = sig
        try:
            policy = load_policy(path)
        except PolicyError as e:
            self.status.stale = self._policy is not None
            self.status.errors = [i.format(e.filename) for i in e.issues]
            self.status.failed_at = time.time()
            self.log.error(
                "Policy %s is invalid; %s:\n  %s",
                path,
                "keeping the last good policy" if self._policy else "no policy loaded",
                "\n  ".join(self.status.errors),
            )
            return False
        self._policy = policy
        self.status = PolicyStatus(
            path=str(path), loaded_at=time.time(), loaded_mtime=sig[0] if sig else None
        )
        self.log.info("Loaded policy %s: %d teams, %d profiles", path, len(policy.teams), len(policy.profiles))
        for callback in self._listeners:
            try:
                callback(policy)
            except Exception:  # a listener must not block a reload
                self.log.exception("policy listener failed")
        return True
