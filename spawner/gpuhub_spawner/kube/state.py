"""Kueue's state as the hub sees it: shared, so API calls do not grow with waiting users.

* Workloads come from one watch per namespace (a KubeSpawner ``ResourceReflector``,
  so list+watch, resourceVersion resumption and back-off are KubeSpawner's own code).
* Queue positions come from the visibility API, polled by one task per LocalQueue
  that runs only while at least one spawner of that queue waits.
* Pods and Workloads that disappear are remembered for a while: Kueue deletes a
  preempted plain pod, and the user must still be told why their server stopped.
* A spawner can wait for the watch's next change of its pod (``changed``) instead of
  polling the reflector with a growing back-off: the moment the kubelet reports the
  server ready is the moment the spawn ends.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kubespawner.clients import shared_client
from kubespawner.reflector import NamespacedResourceReflector
from kubespawner.spawner import PodReflector
from traitlets import validate

from .kueue import GROUP, VERSION, VISIBILITY_GROUP, VISIBILITY_VERSION, owner_pod_name, owner_pod_uid

GONE_KEEP = 2000
_MISSING = object()  # deleted objects remembered per reflector (a few KiB each)


class _TrackingDict(dict):
    """The reflector's ``resources`` dict, reporting changes and removals to its owner."""

    def __init__(self, data, on_gone, on_change):
        super().__init__(data)
        self._on_gone = on_gone
        self._on_change = on_change

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._on_change(key)

    def pop(self, key, default=_MISSING):
        if key in self:
            value = super().pop(key)
            self._on_gone(key, value)
            self._on_change(key)
            return value
        if default is _MISSING:
            raise KeyError(key)
        return default


class _RemembersGone:
    """Mixin for reflectors: ``gone[key]`` is the last state of a deleted object.

    Hooks the ``resources`` trait, which the reflector replaces on every re-list and
    mutates on every watch event, so no KubeSpawner code is copied.
    """

    def _remember(self, key, value):
        gone = self.__dict__.setdefault("_gone", OrderedDict())
        gone[key] = (time.monotonic(), value)
        gone.move_to_end(key)
        while len(gone) > GONE_KEEP:
            gone.popitem(last=False)

    @property
    def gone(self) -> "OrderedDict[str, tuple[float, dict]]":
        return self.__dict__.setdefault("_gone", OrderedDict())

    def _notify(self, key=None):
        """Wake whoever waits for ``key`` (everyone when the whole list was re-read)."""
        waiting = self.__dict__.setdefault("_waiting", {})
        for k in [key] if key is not None else list(waiting):
            for future in waiting.pop(k, ()):
                if not future.done():
                    future.set_result(None)

    async def changed(self, key: str, timeout: float) -> None:
        """Return when the watch next changes or removes ``key``, or after ``timeout`` s."""
        future = asyncio.get_running_loop().create_future()
        waiting = self.__dict__.setdefault("_waiting", {})
        waiting.setdefault(key, []).append(future)
        try:
            async with asyncio.timeout(timeout):  # not wait_for: 3.11's loses a cancel that finds it done
                await future
        except TimeoutError:
            pass
        finally:
            if future in waiting.get(key, ()):
                waiting[key].remove(future)

    @validate("resources")
    def _track(self, proposal):
        new = proposal["value"]
        old = self._trait_values.get("resources") or {}
        for key, value in old.items():
            if key not in new:  # vanished between a watch drop and the re-list
                self._remember(key, value)
        for key in new:
            self.gone.pop(key, None)
        self._notify()
        return _TrackingDict(new, self._remember, self._notify)


class GoneAwarePodReflector(_RemembersGone, PodReflector):
    """KubeSpawner's pod reflector, plus the last state of deleted pods."""


class _WorkloadsApi:
    """Adapts CustomObjectsApi to the ``list_<kind>(namespace, ...)`` shape reflectors call."""

    def __init__(self, custom):
        self.custom = custom

    async def list_workloads(self, namespace, **kwargs):
        return await self.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "workloads", **kwargs)


class WorkloadReflector(_RemembersGone, NamespacedResourceReflector):
    """All Kueue Workloads of one namespace, shared by every spawner there."""

    kind = "workloads"
    list_method_name = "list_workloads"
    api_group_name = "CustomObjectsApi"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.api = _WorkloadsApi(self.api)

    def for_pod(self, namespace: str, pod_name: str, uid: str | None = None) -> dict | None:
        """The Workload Kueue made for this pod: matched by the owner reference's UID when
        known (a pod deleted and recreated under the same name has a new UID), else by name."""
        found = [
            wl
            for wl in list(self.resources.values())
            if wl["metadata"].get("namespace") == namespace
            and owner_pod_name(wl) == pod_name
            and (uid is None or owner_pod_uid(wl) == uid)
        ]
        found.sort(key=lambda wl: wl["metadata"].get("creationTimestamp") or "", reverse=True)
        return found[0] if found else None

    def gone_for_pod(self, namespace: str, pod_name: str, since: float = 0.0, uid: str | None = None) -> dict | None:
        for when, wl in reversed(list(self.gone.values())):
            if (
                when >= since
                and wl["metadata"].get("namespace") == namespace
                and owner_pod_name(wl) == pod_name
                and (uid is None or owner_pod_uid(wl) == uid)
            ):
                return wl
        return None


@dataclass
class PendingSnapshot:
    """One answer of the visibility API for a LocalQueue."""

    items: list[dict] = field(default_factory=list)
    fetched_at: float | None = None
    error: str | None = None

    def position(self, workload_name: str) -> dict | None:
        return next((i for i in self.items if i.get("metadata", {}).get("name") == workload_name), None)


class PendingPoller:
    """Polls ``.../localqueues/<lq>/pendingworkloads`` while anyone is waiting on it."""

    def __init__(self, namespace: str, local_queue: str, interval: float, request_timeout: float, log):
        self.namespace = namespace
        self.local_queue = local_queue
        self.interval = interval
        self.request_timeout = request_timeout
        self.log = log
        self.snapshot = PendingSnapshot()
        self.subscribers = 0
        self.calls = 0
        self._task: asyncio.Task | None = None
        self._changed = asyncio.Event()

    def subscribe(self) -> None:
        self.subscribers += 1
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    def unsubscribe(self) -> None:
        self.subscribers = max(0, self.subscribers - 1)
        if self.subscribers == 0 and self._task and not self._task.done():
            self._task.cancel()

    async def fetch(self) -> PendingSnapshot:
        api = shared_client("CustomObjectsApi").api_client
        self.calls += 1
        async with asyncio.timeout(self.request_timeout):  # not wait_for: 3.11's loses a cancel that finds it done
            data = await api.call_api(
                "/apis/{group}/{version}/namespaces/{namespace}/localqueues/{name}/pendingworkloads",
                "GET",
                path_params={
                    "group": VISIBILITY_GROUP,
                    "version": VISIBILITY_VERSION,
                    "namespace": self.namespace,
                    "name": self.local_queue,
                },
                query_params=[],
                header_params={"Accept": "application/json"},
                response_types_map={200: "object"},
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
            )
        return PendingSnapshot(items=list((data or {}).get("items") or []), fetched_at=time.monotonic())

    async def _run(self) -> None:
        delay = self.interval
        while self.subscribers > 0:
            try:
                self.snapshot = await self.fetch()
                delay = self.interval
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep polling; the spawn page says positions are unavailable
                status = getattr(e, "status", None)
                reason = f"HTTP {status}" if status else type(e).__name__
                self.log.warning("Kueue visibility API for %s/%s failed: %s", self.namespace, self.local_queue, reason)
                self.snapshot = PendingSnapshot(items=self.snapshot.items, fetched_at=self.snapshot.fetched_at, error=reason)
                delay = min(delay * 2, max(self.interval, 30.0))
            await asyncio.sleep(delay)


class PendingPollers:
    """One ``PendingPoller`` per (event loop, namespace, LocalQueue), process-wide."""

    _pollers: dict = {}

    @classmethod
    def get(cls, namespace: str, local_queue: str, interval: float, request_timeout: float, log) -> PendingPoller:
        key = (asyncio.get_running_loop(), namespace, local_queue)
        poller = cls._pollers.get(key)
        if poller is None:
            poller = cls._pollers[key] = PendingPoller(namespace, local_queue, interval, request_timeout, log)
        poller.interval = interval
        return poller

    @classmethod
    def all(cls) -> list[PendingPoller]:
        return list(cls._pollers.values())

    @classmethod
    def reset(cls) -> None:
        """Forget every poller (tests: each event loop starts clean)."""
        for poller in cls._pollers.values():
            if poller._task and not poller._task.done():
                poller._task.cancel()
        cls._pollers.clear()
