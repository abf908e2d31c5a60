"""First code of every job attempt, already running as the user inside the server sandbox.

``python -I -m gpuhub_spawner.jobs.entry -- COMMAND...`` (exec'd by ``local.sandbox``):
enter the working directory, create the checkpoint directory, report the working
directory's git state to the hub on the pipe named by ``GPUHUB_EVIDENCE_FD``, close it,
then ``exec`` the job's command. git runs here, as the user, never as the hub: a
repository's own config (hooks, fsmonitor) must never run with the hub's privileges.
Likewise ``workingDir`` and ``checkpointDir`` (paths the user chose) are entered and made
only here, as the user; this is also the first process that has the job's environment
(the sandbox applies it with its final ``execve``, never while it is root).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def git_state(path: str) -> dict | None:
    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", path, *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status), "branch": git("rev-parse", "--abbrev-ref", "HEAD") or ""}


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--" or len(argv) < 2:
        print("usage: python -I -m gpuhub_spawner.jobs.entry -- COMMAND...", file=sys.stderr)
        return 2
    cmd = argv[1:]
    workdir = os.environ.get("GPUHUB_WORKDIR") or os.getcwd()
    fd = os.environ.pop("GPUHUB_EVIDENCE_FD", "")
    evidence: dict = {"workdir": workdir}
    try:
        os.chdir(workdir)
    except OSError as e:
        print(f"[gpuhub] cannot enter the working directory {workdir}: {e.strerror}", file=sys.stderr, flush=True)
        return 2
    ckpt = os.environ.get("GPUHUB_CHECKPOINT_DIR")
    if ckpt:
        try:
            os.makedirs(ckpt, mode=0o700, exist_ok=True)
        except OSError as e:
            print(f"[gpuhub] cannot create the checkpoint directory {ckpt}: {e.strerror}", file=sys.stderr, flush=True)
            return 2
    evidence["git"] = git_state(workdir)
    if fd.isdigit():
        try:
            os.write(int(fd), (json.dumps(evidence) + "\n").encode())
        except OSError:
            pass
        try:
            os.close(int(fd))
        except OSError:
            pass
    sys.stdout.flush()
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        print(f"[gpuhub] cannot run {cmd[0]!r}: {e.strerror}", file=sys.stderr, flush=True)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
