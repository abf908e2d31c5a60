"""The policy on Kubernetes is its ConfigMap: apply and roll back through it (issue 26).

The chart mounts the ConfigMap ``gpuhub-policy`` (key ``profiles.yaml``) into the hub pod, but
the kubelet swaps a mounted ConfigMap file only a while after the object changes (its sync
period plus cache TTL: up to about two minutes). An admin who applies or rolls back a policy
must see it in force at once, and a ``kubectl edit`` or ``helm upgrade`` must not wait for the
kubelet either. So the hub follows the ConfigMap itself:

* **A mirror.** ``PolicyMirror`` keeps a copy of the ConfigMap's text in the hub's volume
  (``<data>/policy-live/profiles.yaml``); the ``PolicyStore`` reads that file, exactly as it
  reads a file on one machine. At start the copy is seeded from the mounted file; then a
  list-and-watch of that one ConfigMap (field selector on its name) writes every new text
  atomically, in the order the API server assigned (resourceVersion), never an older one
  over a newer one.
* **An apply** (``ConfigMapPolicy.writer``) re-reads the ConfigMap, refuses if it does not
  hold the policy the hub has in force (someone changed it and the hub has not seen it yet),
  replaces ``data[key]`` with a merge patch carrying the ConfigMap's ``resourceVersion`` (a
  concurrent writer gets 409 Conflict instead of one write silently losing), and writes the
  mirror at once, so the store's next read has it. Nothing is written when the patch fails.

The ConfigMap stays the one source of truth: a restarted hub reads it, ``helm upgrade`` and
``kubectl edit`` keep working and are recorded as "edited on disk" (the mirror is the disk).

RBAC: ``get``, ``list``, ``watch`` and ``patch`` of that one ConfigMap in the hub's namespace,
by name (``resourceNames``), nothing else: ``gpuhub render policy-rbac``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
from pathlib import Path
from ..policy.files import write_atomically

log = logging.getLogger("JupyterHub.gpuhub.policy")

NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
DEFAULT_NAME, DEFAULT_KEY = "gpuhub-policy", "profiles.yaml"


class ConfigMapConflict(RuntimeError):
    """The ConfigMap is not what the apply expected, or changed under it; nothing was written."""


def hub_namespace() -> str:
    """The hub pod's namespace: z2jh sets ``POD_NAMESPACE``; else the service account's."""
    ns = os.environ.get("POD_NAMESPACE")
    if ns:
        return ns
    try:
        with open(NAMESPACE_FILE) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]  # as usage.policy_versions.text_hash


def _rv(value) -> int:
    """resourceVersion as a number, for ordering a watch against our own writes (etcd's
    revisions; an opaque one counts as 0, i.e. "not newer")."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def write_file(path: Path, text: str) -> None:
    """Atomically (a temporary file beside it, fsync, rename), mode 0644 like the mount."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, text, 0o644)


class ConfigMapPolicy:
    """The policy's ConfigMap, read, watched and written through the API server."""

    def __init__(self, name: str = DEFAULT_NAME, namespace: str | None = None, key: str = DEFAULT_KEY, core_api=None):
        self.name, self.key = name, key
        self.namespace = namespace or hub_namespace()
        self.core_api = core_api

    def where(self) -> str:
        return f"ConfigMap {self.namespace}/{self.name} (key {self.key})"

    def _core(self):
        if self.core_api is None:
            from kubespawner.clients import shared_client  # lazy: heavy optional dependency

            self.core_api = shared_client("CoreV1Api")
        return self.core_api

    async def read(self) -> tuple[str | None, str]:
        """The policy's text (None when the key is missing) and the ConfigMap's resourceVersion."""
        cm = await self._core().read_namespaced_config_map(self.name, self.namespace)
        return (cm.data or {}).get(self.key), cm.metadata.resource_version

    async def write(self, text: str, expected_hash: str | None = None) -> tuple[str | None, str]:
        """Replace the policy's text; returns (the previous text, the new resourceVersion).
        ``expected_hash``: the hash of the text the caller has in force; another text there
        means someone else changed it, and nothing is written."""
        previous, version = await self.read()
        if expected_hash is not None and previous is not None and _hash(previous) != expected_hash:
            raise ConfigMapConflict(
                f"{self.where()} holds policy {_hash(previous)}, not {expected_hash}, the one in force here (it was "
                "changed by helm or kubectl and the hub has not loaded it yet): nothing was written; preview again"
            )
        body = {"metadata": {"resourceVersion": version}, "data": {self.key: text}}
        try:
            cm = await self._core().patch_namespaced_config_map(
                self.name, self.namespace, body, _content_type="application/merge-patch+json"
            )
        except Exception as e:  # kubernetes_asyncio's ApiException; 409 when another writer won
            if getattr(e, "status", None) == 409:
                raise ConfigMapConflict(
                    f"{self.where()} changed while it was written: nothing was written; preview again"
                ) from None
            raise
        return previous, cm.metadata.resource_version


class PolicyMirror:
    """The hub's copy of the policy ConfigMap, which the ``PolicyStore`` reads."""

    def __init__(self, configmap: ConfigMapPolicy, path: str | os.PathLike, retry_seconds: float = 2.0):
        self.cm = configmap
        self.path = Path(path)
        self.retry_seconds = retry_seconds
        self._rv = 0  # the newest resourceVersion written to the file
        self._task: asyncio.Task | None = None
        self._lock = threading.Lock()  # the watch's writes and an apply's, from worker threads

    def seed(self, mounted: str | os.PathLike) -> None:
        """Before the store first reads it (hub config time): the mounted file's text, unless a
        copy is already there (a restarted hub; the watch brings anything newer at once)."""
        if self.path.exists():
            return
        write_file(self.path, Path(mounted).read_text())

    def take(self, text: str | None, resource_version) -> bool:
        """Write ``text`` if it is newer than what the file holds and differs from it."""
        rv = _rv(resource_version)
        with self._lock:
            if text is None or (rv and rv <= self._rv):
                return False
            self._rv = max(self._rv, rv)
            try:
                if self.path.read_text() == text:
                    return False
            except OSError:
                pass
            write_file(self.path, text)
        log.info(
            "Policy: %s changed (resourceVersion %s): the hub's copy %s follows", self.cm.where(), resource_version, self.path
        )
        return True

    def writer(self, loop: asyncio.AbstractEventLoop, timeout: float = 30.0):
        """A ``PolicyVersions`` writer, called in a worker thread: the patch runs on the hub's
        loop; the mirror is written before it returns, so the store's next read has the text."""

        def write(text: str, expected_hash: str | None) -> str | None:
            async def both():
                previous, rv = await self.cm.write(text, expected_hash)
                await asyncio.to_thread(self.take, text, rv)
                return previous

            future = asyncio.run_coroutine_threadsafe(both(), loop)
            try:
                return future.result(timeout)
            except TimeoutError:  # an OSError: say what it is (the watch brings a late write in)
                future.cancel()
                raise ConfigMapConflict(
                    f"the API server did not answer within {timeout:.0f} s; the policy may or "
                    f"may not have been written to {self.cm.where()}: see the history in a "
                    "minute"
                ) from None

        write.where = self.cm.where()  # type: ignore[attr-defined]
        return write

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        from kubernetes_asyncio import watch  # lazy: heavy optional dependency

        core = self.cm._core()
        selector = f"metadata.name={self.cm.name}"
        while True:
            try:
                listed = await core.list_namespaced_config_map(self.cm.namespace, field_selector=selector)
                for cm in listed.items:
                    await asyncio.to_thread(self.take, (cm.data or {}).get(self.cm.key), cm.metadata.resource_version)
                since = listed.metadata.resource_version
                async with watch.Watch().stream(
                    core.list_namespaced_config_map,
                    self.cm.namespace,
                    field_selector=selector,
                    resource_version=since,
                    timeout_seconds=300,
                ) as stream:
                    async for event in stream:
                        obj = event["object"]
                        if event["type"] in ("ADDED", "MODIFIED") and not isinstance(obj, dict):
                            await asyncio.to_thread(self.take, (obj.data or {}).get(self.cm.key), obj.metadata.resource_version)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - list again after a pause (410 Gone, a dropped connection)
                log.warning(
                    "Policy: following %s failed (%s); retrying in %.0f s",
                    self.cm.where(),
                    getattr(e, "reason", None) or e,
                    self.retry_seconds,
                )
                await asyncio.sleep(self.retry_seconds)
