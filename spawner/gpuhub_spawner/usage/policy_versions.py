"""Every version of the policy that took effect: applied, rolled back to, or edited on disk (issue 26).

Kept in the hub's data directory (``policy-versions/``, 0700): ``index.jsonl`` (append-only, one
line per version: number, hash, who, when, how, one-line summary) and each version's text
(``<n>-<hash>.yaml``, 0600). Versions are addressed by their number or a prefix of their hash,
always looked up in the index: no name a user sends reaches the file system.

An apply writes the policy file atomically (a temporary file beside it, fsync, rename; the
previous text kept as ``<file>.previous``), records the version *before* the store re-reads the
file, and the store's reload (``PolicyStore.on_change``) finds that version already there. A
reload that finds a text no apply wrote (an admin edited the file, a ConfigMap changed) is
recorded as ``edited on disk``. The audit trail gets ``policy_applied``, ``policy_rolled_back`` and
``policy_edited_on_disk`` with who, the version and the diff (profile environment values masked,
as in ``policy_reloaded``).

Uses only the store's public API (``policy_file``, ``on_change``); reading and hashing the file
after a reload runs in a thread, never on the hub's loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import pwd
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import recorder

# The masked text and the diff live in policy_text.py (a child process imports it to diff a large
# policy); importable from here as before.
from .policy_text import BESIDE_FROM, MASK, diff_beside, masked_text, policy_diff
from ..policy.files import write_atomically as write_file

__all__ = ["MASK", "masked_text", "policy_diff", "text_hash", "write_atomically", "PolicyVersions", "VersionNotFound"]

log = logging.getLogger("JupyterHub.gpuhub.policy")

APPLIED, ROLLBACK, ON_DISK, AT_START = "applied", "rollback", "edited on disk", "loaded at start"


def text_hash(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()[:12]


def write_atomically(path: str | os.PathLike, text: str) -> None:
    """Replace the file at ``path`` (its real target, if a link) in one rename: a temporary file
    in the same directory, fsynced, then renamed over it, and the directory fsynced. The previous
    text is kept beside it as ``<name>.previous``. Raises ``OSError`` (read-only: a ConfigMap)."""
    target = Path(os.path.realpath(path))
    mode = 0o644
    try:
        st = os.stat(target)
        mode = stat.S_IMODE(st.st_mode)
        previous = target.read_bytes()
    except FileNotFoundError:
        previous = None
    if previous is not None:
        _replace(target.with_name(target.name + ".previous"), previous, mode)
    _replace(target, text.encode(), mode)


def _replace(target: Path, data: bytes, mode: int) -> None:
    write_file(target, data, mode)
    dfd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _what_changed(before: str, after: str, policies: tuple | None = None) -> str:
    """One line for an edit on disk: its quota and profile changes (as a preview would say).
    ``policies``: the (before, after) models the store already built at the reload; parsing
    the texts again would hold the interpreter lock in libyaml for the whole document (0.2-0.5 s
    for a large policy), stalling the hub's loop even from a thread."""
    from ..admission.impact import impact
    from ..policy.loader import PolicyError, parse_policy

    try:
        old, new = policies if policies else (parse_policy(before), parse_policy(after))
        return f"{ON_DISK}: " + impact(old, new).one_line()
    except (PolicyError, ValueError):
        return ON_DISK


_SUMMARY_CHILD = (
    "import json, os, sys; os.nice(10); "
    "from gpuhub_spawner.usage.policy_versions import _what_changed, policy_diff; "
    "before, after = json.load(sys.stdin); "
    "sys.stdout.write(json.dumps([_what_changed(before, after), policy_diff(before, after)]))"
)


def _summary_and_diff(before: str, after: str, policies: tuple | None = None) -> tuple[str, str]:
    """``_what_changed`` and ``policy_diff`` of an edit on disk. For a large policy both are made in
    a child process: the impact of the 500-team policy is ~1 s of Python and the diff parses and
    dumps both texts in libyaml (holding the interpreter lock): in a thread of the hub the loop
    would wait for the lock all that time. Here when no child can run. Call from a thread."""
    if len(before) + len(after) >= BESIDE_FROM:
        try:
            done = subprocess.run(
                [sys.executable, "-c", _SUMMARY_CHILD],
                input=json.dumps([before, after]).encode(),
                capture_output=True,
                timeout=600,
            )
            if done.returncode == 0:
                summary, diff = json.loads(done.stdout)
                return summary, diff
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    return _what_changed(before, after, policies), policy_diff(before, after)


class VersionNotFound(LookupError):
    pass


class PolicyVersions:
    """The versions of one hub's policy file."""

    def __init__(self, directory: str | os.PathLike, policy_file: str, writer=None):
        """``writer``: where an apply writes, when not the policy file itself (Kubernetes: the
        ConfigMap, ``kube.policy_configmap``): ``writer(text, expected_hash) -> previous text``,
        called in a worker thread, raising ``OSError`` or ``RuntimeError`` when nothing was
        written; its ``where`` names it in messages and the audit trail."""
        self.dir = Path(directory)
        self.policy_file = policy_file
        self.writer = writer
        self.where = getattr(writer, "where", None) or policy_file
        self._lock = threading.Lock()
        self._file_lock = threading.RLock()  # an apply's write and record, or a reload's look, at a time
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.index = self.dir / "index.jsonl"
        self._versions: list[dict] = self._read_index()

    def _read_index(self) -> list[dict]:
        out = []
        try:
            with open(self.index, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        try:
                            out.append(json.loads(line))
                        except ValueError:
                            log.warning("Skipping an unreadable line of %s", self.index)
        except FileNotFoundError:
            pass
        return out

    # -- reading -----------------------------------------------------------------------------
    def versions(self) -> list[dict]:
        with self._lock:
            return [dict(v) for v in self._versions]

    def latest(self) -> dict | None:
        with self._lock:
            return dict(self._versions[-1]) if self._versions else None

    def find(self, ref: str | int) -> dict:
        """A version by number (``3``, ``v3``) or hash prefix (at least 4 hex digits)."""
        ref = str(ref).strip().lower()
        with self._lock:
            versions = list(self._versions)
        number = ref[1:] if ref.startswith("v") else ref
        if number.isdigit():
            for v in versions:
                if v["n"] == int(number):
                    return dict(v)
        if len(ref) >= 4 and all(c in "0123456789abcdef" for c in ref):
            found = [v for v in versions if v["hash"].startswith(ref)]
            if found:
                return dict(found[-1])
        raise VersionNotFound(f"no policy version {ref[:40]!r}: see `gpuhub policy history`")

    def text_of(self, version: dict) -> str:
        return (self.dir / f"{int(version['n'])}-{version['hash']}.yaml").read_text()

    # -- writing -----------------------------------------------------------------------------
    def record(self, text: str, by: str, source: str, summary: str, **extra) -> dict:
        with self._lock:
            n = (self._versions[-1]["n"] + 1) if self._versions else 1
            entry = {
                "n": n,
                "hash": text_hash(text),
                "at": round(time.time(), 3),
                "by": by,
                "source": source,
                "summary": summary,
                **extra,
            }
            path = self.dir / f"{n}-{entry['hash']}.yaml"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            fd = os.open(self.index, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "a") as f:
                f.write(json.dumps(entry) + "\n")
            self._versions.append(entry)
        return dict(entry)

    def apply(
        self, text: str, by: str, summary: str, rollback_to: dict | None = None, expected_hash: str | None = None, **extra
    ) -> dict:
        """Write ``text`` as the policy (the file, or the writer's place) and record it (validated
        by the caller); audited. ``expected_hash``: the hash of the policy the caller checked
        against (a writer refuses when its place holds another). ``extra``: more fields of the
        version (``teams``: the teams it touches, ``every_team``)."""
        source = ROLLBACK if rollback_to else APPLIED
        if rollback_to:
            extra["rollback_to"] = rollback_to["n"]
        with self._file_lock:
            # An edit on disk whose reload has not been recorded yet (its record waits for this
            # lock) goes into the history first: after this write it would find the new text and
            # the version it put in force would be missing.
            if self.writer is None:
                self._notice_file("")
                before = self._file_text()
                write_atomically(self.policy_file, text)
            else:
                before = self.writer(text, expected_hash)
            version = self.record(text, by, source, summary, **extra)
        diff = diff_beside(before or "", text)
        event = "policy_rolled_back" if rollback_to else "policy_applied"
        recorder.audit(
            event,
            by=by,
            version=version["n"],
            hash=version["hash"],
            summary=summary,
            path=self.where,
            diff=diff,
            **({"to_version": rollback_to["n"]} if rollback_to else {}),
        )
        log.info("Policy version %d (%s) %s by %s: %s", version["n"], version["hash"], source, by, summary)
        return version

    def _file_text(self) -> str | None:
        try:
            return Path(self.policy_file).read_text()
        except OSError:
            return None

    # -- the store's reloads -----------------------------------------------------------------
    def notice_file(self, summary: str = "", policies: tuple | None = None) -> dict | None:
        """Record the file's text if no version has it (edited on disk); in any thread.
        ``policies``: (before, after) as the store built them, for the summary."""
        with self._file_lock:
            return self._notice_file(summary, policies)

    def _notice_file(self, summary: str, policies: tuple | None = None) -> dict | None:
        text = self._file_text()
        if text is None:
            return None
        latest = self.latest()
        if latest is not None and latest["hash"] == text_hash(text):
            return None
        who = None
        try:
            who = pwd.getpwuid(os.stat(self.policy_file).st_uid).pw_name
        except (OSError, KeyError):
            pass
        source = ON_DISK if latest is not None else AT_START
        by = f"file owner {who}" if who else "unknown"
        diff = None
        if latest is not None:
            if summary:
                diff = diff_beside(self.text_of(latest), text)
            else:
                summary, diff = _summary_and_diff(self.text_of(latest), text, policies)
        version = self.record(text, by, source, summary or source)
        if latest is not None:
            recorder.audit(
                "policy_edited_on_disk", by=by, version=version["n"], hash=version["hash"], path=self.policy_file, diff=diff
            )
        return version

    def follow(self, store) -> None:
        """Record the file now if new, and after every reload that finds a text no apply wrote."""
        self.notice_file()
        last = [store.current]

        def reloaded(policy) -> None:  # on the loop: hand the read and hash to a thread
            policies = (last[0], policy)
            last[0] = policy
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.notice_file("", policies)
                return
            loop.run_in_executor(None, self.notice_file, "", policies)

        store.on_change(reloaded)
