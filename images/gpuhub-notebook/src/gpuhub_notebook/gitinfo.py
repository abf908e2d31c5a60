"""Which code produced a run: the git commit of the notebook's repository, and whether
the working tree had uncommitted changes."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class GitState:
    commit: str
    dirty: bool
    branch: str
    root: str


def _git(args: list[str], cwd: str) -> str | None:
    try:
        r = subprocess.run(
            ["git", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=5,
            env={**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"},
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def notebook_dir(environ=None) -> str:
    """Where the running notebook lives: ``JPY_SESSION_NAME`` (set by jupyter-server for
    kernels it starts) when it names an existing file, else the kernel's working dir."""
    env = os.environ if environ is None else environ
    session = env.get("JPY_SESSION_NAME", "")
    if session:
        path = session if os.path.isabs(session) else os.path.join(os.getcwd(), session)
        if os.path.exists(path):
            return os.path.dirname(os.path.abspath(path))
    return os.getcwd()


def state(path: str | None = None) -> GitState | None:
    """Git state of the repository containing ``path`` (default: the notebook's dir)."""
    cwd = path or notebook_dir()
    if not os.path.isdir(cwd):
        return None
    commit = _git(["rev-parse", "HEAD"], cwd)
    if not commit:
        return None
    porcelain = _git(["status", "--porcelain", "--untracked-files=no"], cwd)
    branch = _git(["rev-parse", "--abbrev-ref", "HEAD"], cwd) or ""
    root = _git(["rev-parse", "--show-toplevel"], cwd) or cwd
    return GitState(commit=commit, dirty=bool(porcelain), branch=branch, root=root)
