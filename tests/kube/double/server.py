"""A test double of the Kubernetes API server, Kueue and a kubelet, on 127.0.0.1.

Only what KubeSpawner and KueueSpawner use, behaving like the real thing where it
matters: list/watch with resourceVersion (replay, synthetic ADDED for rv 0, 410 for
compacted history, timeoutSeconds), 404/409, strict validation of every object
written (``schemas.py``), Kueue's pod webhook (scheduling gate, Workload), a small
admission loop over the rendered ClusterQueues that applies their ``spec.preemption`` as
Kueue's classical preemption does (docs/kubernetes-testing.md says what it leaves out),
the visibility API, and a kubelet that runs an admitted pod's own container command and
env as a local process.

It runs in its own thread and event loop, like a separate server. Test code calls
the public methods from any thread; they hop onto the double's loop.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import aiohttp
from aiohttp import web

from gpuhub_spawner.kube import kueue as K
from gpuhub_spawner.kube.kueue import (
    ADMISSION_GATE,
    API_VERSION,
    JOB_UID_LABEL,
    MANAGED_LABEL,
    POD_FINALIZER,
    PRIORITY_LABEL,
    QUEUE_LABEL,
    owner_pod_name,
)
from gpuhub_spawner.policy.quantities import parse_cpu_millis, parse_memory_bytes

from .jobs import JobsMixin, owner_job_name  # batch/v1 Jobs + Kueue's job integration (gpuhub batch jobs)
from .ray import RayMixin, owner_ray_name  # ray.io/v1 RayClusters: KubeRay + Kueue's raycluster integration (issue 24)
from .schemas import InvalidObject, validate, validate_core

TOKEN = "double-token"
HISTORY_KEEP = 5000
KUEUE_KINDS = {
    "workloads": "Workload",
    "localqueues": "LocalQueue",
    "clusterqueues": "ClusterQueue",
    "resourceflavors": "ResourceFlavor",
    "workloadpriorityclasses": "WorkloadPriorityClass",
}
CORE_KINDS = {
    "pods": "Pod",
    "events": "Event",
    "nodes": "Node",
    "configmaps": "ConfigMap",
    "services": "Service",
}  # configmaps: the policy (kube/policy_configmap.py); services: a several-worker job's headless Service
CLUSTER_SCOPED = {"clusterqueues", "resourceflavors", "workloadpriorityclasses"}


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> web.Response:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    return web.json_response(body, status=code)


def _match_labels(obj: dict, selector: str) -> bool:
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, (selector or "").split(",")):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.split("=", 1)
            if labels.get(k.rstrip("=")) != v:
                return False
        elif labels.get(term) is None:
            return False
    return True


def _match_fields(obj: dict, selector: str) -> bool:
    for term in filter(None, (selector or "").split(",")):
        k, v = term.split("=", 1)
        value = obj
        for part in k.rstrip("=").split("."):
            value = (value or {}).get(part) if isinstance(value, dict) else None
        if str(value) != v:
            return False
    return True


@dataclass
class Fault:
    method: str
    path: re.Pattern
    status: int
    times: int


class Watcher:
    def __init__(self, plural, namespace, labels, fields):
        self.plural, self.namespace, self.labels, self.fields = plural, namespace, labels, fields
        self.queue: asyncio.Queue = asyncio.Queue()

    def wants(self, plural, obj) -> bool:
        return (
            plural == self.plural
            and (self.namespace is None or obj["metadata"].get("namespace") == self.namespace)
            and _match_labels(obj, self.labels)
            and _match_fields(obj, self.fields)
        )


class KubeDouble(JobsMixin, RayMixin):
    def __init__(self, workdir: Path, node_env: dict[str, str] | None = None, webhook_namespaces: set[str] | None = None):
        self.workdir = Path(workdir)
        self.node_env = node_env or {}
        self._webhook_default = set(webhook_namespaces) if webhook_namespaces is not None else None
        self.loop = asyncio.new_event_loop()
        self.port = None
        self._thread = threading.Thread(target=self._serve, name="kube-double", daemon=True)
        self._ready = threading.Event()
        self._reset_state()

    # -- lifecycle ------------------------------------------------------------------
    def _reset_state(self):
        self.objects: dict[tuple[str, str | None, str], dict] = {}
        self.rv = itertools.count(1000)
        self.last_rv = 999
        self.history: list[tuple[int, str, str, dict]] = []
        self.watchers: list[Watcher] = []
        self.watch_responses: list[web.StreamResponse] = []
        self.calls: Counter = Counter()
        self.faults: list[Fault] = []
        self.invalid: list[str] = []
        self.errors: list[str] = []
        self.processes: dict[str, subprocess.Popen] = {}
        self.ready_at: dict[str, float] = {}
        self.auto_admit = True
        self._validated_conditions: set[tuple[str, str]] = set()
        # Reads without credentials, as an API server with anonymous auth and a read-only
        # RBAC grant serves them: kubectl sends no bearer token over plain HTTP.
        self.anonymous_reads = False
        # Kueue's controller and webhook: up, or down (webhook calls fail, finalizers stay).
        self.kueue_up = True
        # Namespaces Kueue's pod webhooks are called for. None: Kueue's own manifests.yaml
        # (every namespace but kube-system and kueue-system); install-kubernetes.md narrows it.
        self.webhook_namespaces: set[str] | None = (
            set(self._webhook_default) if getattr(self, "_webhook_default", None) is not None else None
        )
        # Namespaces Kueue manages pods in (managedJobsNamespaceSelector); None = all.
        self.managed_namespaces: set[str] | None = None
        # Kueue's Configuration, the parts the double models (``gpuhub render kueue-config``'s
        # fragment): ``fairSharing`` (the tournament between a cohort's ClusterQueues) and
        # ``admissionFairSharing`` (a ClusterQueue's queue ordered by its LocalQueues' usage).
        self.kueue_config: dict = {}
        # Admission Fair Sharing: per (namespace, LocalQueue) the decayed admitted usage and when
        # it was brought forward (Kueue: LocalQueue status consumedResources, lastUpdate).
        self.afs_usage: dict[tuple[str, str], tuple[dict[str, float], float]] = {}

    def start(self) -> "KubeDouble":
        self._thread.start()
        self._ready.wait(10)
        return self

    def _serve(self):
        asyncio.set_event_loop(self.loop)
        app = web.Application(middlewares=[self._middleware])
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self.runner = web.AppRunner(app, handle_signals=False)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._tick_task = self.loop.create_task(self._ticker())
        self._ready.set()
        self.loop.run_forever()

    def call(self, fn, *args, **kwargs):
        """Run ``fn`` (sync or async) on the double's loop and return its result."""

        async def run():
            result = fn(*args, **kwargs)
            if asyncio.iscoroutine(result):
                result = await result
            return result

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def reset(self):
        """Kill pod processes, drop watches and forget every object."""

        def do():
            for proc in self.processes.values():
                self._kill(proc)
            self._close_watches()
            self._reset_state()

        self.call(do)

    def close(self):
        self.reset()
        self.loop.call_soon_threadsafe(self._tick_task.cancel)
        self.call(self.runner.cleanup)
        self.loop.call_soon_threadsafe(self.loop.stop)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self) -> str:
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "double",
                "clusters": [{"name": "double", "cluster": {"server": self.url}}],
                "users": [{"name": "hub", "user": {"token": TOKEN}}],
                "contexts": [{"name": "double", "context": {"cluster": "double", "user": "hub", "namespace": "gpuhub"}}],
            }
        )

    # -- test controls (any thread) ------------------------------------------------------
    def apply(self, objs: list[dict]):
        def do():
            for obj in objs:
                obj = copy.deepcopy(obj)
                validate(obj)
                plural = next(p for p, k in KUEUE_KINDS.items() if k == obj["kind"])
                self._write(plural, obj["metadata"].get("namespace"), obj, "ADDED")
            self._reconcile()

        self.call(do)

    def put_node(self, node: dict):
        """Create or replace a Node (validated against Kubernetes' schema) as a kubelet or an
        operator (cordon, taint, the device plugin's allocatable) would write it."""

        def do():
            obj = copy.deepcopy(node)
            validate(obj)
            old = self.objects.get(("nodes", None, obj["metadata"]["name"]))
            if old:
                for k in ("uid", "creationTimestamp"):
                    obj["metadata"][k] = old["metadata"][k]
            self._write("nodes", None, obj, "MODIFIED" if old else "ADDED")

        self.call(do)

    def taint_node(self, node: dict) -> list[str]:
        """``put_node``, and then what Kubernetes' taint manager does at once for the node's
        NoExecute taints (tolerationSeconds not modelled): every pod bound to the node that
        does not tolerate one gets ``DisruptionTarget`` (reason ``DeletionByTaintManager``),
        its container is killed (exit 137) and it ends ``Failed``; a Job's pod stays for the
        Job controller to account (its tracking finalizer), any other pod is deleted. One step
        on the double's loop: no client sees the taint before the eviction. Returns the
        evicted pods ("ns/name")."""

        def do():
            obj = copy.deepcopy(node)
            validate(obj)
            name = obj["metadata"]["name"]
            old = self.objects.get(("nodes", None, name))
            if old:
                for k in ("uid", "creationTimestamp"):
                    obj["metadata"][k] = old["metadata"][k]
            self._write("nodes", None, obj, "MODIFIED" if old else "ADDED")
            taints = [t for t in obj.get("spec", {}).get("taints") or [] if t.get("effect") == "NoExecute"]
            evicted = []
            for (p, ns, pname), pod in list(self.objects.items()):
                if p != "pods" or pod["spec"].get("nodeName") != name or (pod.get("status") or {}).get("phase") != "Running":
                    continue
                if all(any(_tolerates(tol, t) for tol in pod["spec"].get("tolerations") or []) for t in taints):
                    continue
                proc = self.processes.pop(f"{ns}/{pname}", None)
                if proc:
                    self._kill(proc)
                pod = copy.deepcopy(pod)
                ts = now_iso()
                status = pod["status"]
                status["phase"] = "Failed"
                status["conditions"] = [c for c in status.get("conditions") or [] if c["type"] != "DisruptionTarget"] + [
                    {
                        "type": "DisruptionTarget",
                        "status": "True",
                        "reason": "DeletionByTaintManager",
                        "message": "Taint manager: deleting due to NoExecute taint",
                        "lastTransitionTime": ts,
                    }
                ]
                for c in status.get("containerStatuses") or []:
                    c.update(
                        ready=False, started=False, state={"terminated": {"exitCode": 137, "reason": "Error", "finishedAt": ts}}
                    )
                validate(pod)
                self._write("pods", ns, pod, "MODIFIED")
                if not owner_job_name(pod):
                    self._remove_pod(ns, pname)
                evicted.append(f"{ns}/{pname}")
            return evicted

        return self.call(do)

    def fail(self, method: str, path_regex: str, status: int = 500, times: int = 1):
        self.call(lambda: self.faults.append(Fault(method.upper(), re.compile(path_regex), status, times)))

    def drop_watches(self):
        self.call(self._close_watches)

    def get(self, plural, namespace, name) -> dict | None:
        return self.call(lambda: copy.deepcopy(self.objects.get((plural, namespace, name))))

    def list(self, plural, namespace=None) -> list[dict]:
        return self.call(
            lambda: [
                copy.deepcopy(o)
                for (p, ns, _), o in sorted(self.objects.items(), key=lambda kv: str(kv[0]))
                if p == plural and (namespace is None or ns == namespace)
            ]
        )

    def last_written(self, plural, namespace, name) -> dict | None:
        """The object as last written, even if deleted since (a preempted pod's Workload goes with it)."""

        def find():
            for _, _, p, obj in reversed(self.history):
                if p == plural and obj["metadata"].get("namespace") == namespace and obj["metadata"]["name"] == name:
                    return copy.deepcopy(obj)
            return None

        return self.call(find)

    def workload_for(self, namespace, pod_name) -> dict | None:
        return next((w for w in self.list("workloads", namespace) if owner_pod_name(w) == pod_name), None)

    def preempt(self, namespace: str, pod_name: str, preempted_reason: str = "InClusterQueue"):
        """What Kueue does to a preempted plain pod: Workload conditions, pod condition, delete."""
        self.call(self._preempt, namespace, pod_name, preempted_reason)

    def set_kueue(self, up: bool):
        """Kueue's controller and webhook go down or come back (finalizers are then released)."""

        def do():
            self.kueue_up = up
            if up:
                self._release_finalizers()

        self.call(do)

    def create(self, plural: str, namespace: str, obj: dict) -> tuple[int, dict]:
        """POST an object as a client would (status code, body): for tests of admission paths."""

        async def do():
            body = copy.deepcopy(obj)
            if plural == "pods":
                resp = self._create_pod(namespace, body)
            else:
                resp = web.json_response(self._write(plural, namespace, body, "ADDED"), status=201)
            return resp.status, json.loads(resp.body)

        return self.call(do)

    def delete(self, plural: str, namespace: str, name: str, grace: int = 0) -> dict:
        return self.call(lambda: copy.deepcopy(self._delete(plural, namespace, name, grace)))

    def watching(self, plural: str) -> bool:
        """True once a client holds a watch on ``plural`` (events from now on reach it)."""
        return self.call(lambda: any(w.plural == plural for w in self.watchers))

    def count(self, method: str | None = None, what: str | None = None) -> int:
        return self.call(
            lambda: sum(n for (m, w), n in self.calls.items() if (method is None or m == method) and (what is None or w == what))
        )

    # -- storage and watch fan-out -----------------------------------------------------
    def _write(self, plural, namespace, obj, event_type):
        rv = next(self.rv)
        self.last_rv = rv
        meta = obj["metadata"]
        meta["resourceVersion"] = str(rv)
        if event_type == "ADDED":
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", now_iso())
            meta.setdefault("generation", 1)
        key = (plural, namespace, meta["name"])
        if event_type == "DELETED":
            self.objects.pop(key, None)
            if plural in ("jobs", "rayclusters"):
                self._collect_owned(obj)
        else:
            self.objects[key] = obj
        snapshot = copy.deepcopy(obj)
        self.history.append((rv, event_type, plural, snapshot))
        if len(self.history) > HISTORY_KEEP:
            del self.history[: len(self.history) - HISTORY_KEEP]
        for w in self.watchers:
            if w.wants(plural, snapshot):
                w.queue.put_nowait((event_type, snapshot))
        if plural != "events":
            self._schedule_reconcile()
        return obj

    def _close_watches(self):
        for w in self.watchers:
            w.queue.put_nowait(None)
        self.watchers = []

    # -- HTTP ------------------------------------------------------------------------
    @web.middleware
    async def _middleware(self, request, handler):
        if request.path.startswith("/hub/api"):
            # Stand-in for the hub's API root: jupyterhub-singleuser checks it at startup.
            from jupyterhub import __version__ as hub_version

            return web.json_response({"version": hub_version}, headers={"X-JupyterHub-Version": hub_version})
        anonymous_read = self.anonymous_reads and request.method == "GET" and "Authorization" not in request.headers
        if request.headers.get("Authorization") != f"Bearer {TOKEN}" and not anonymous_read:
            return _status(401, "Unauthorized", "Unauthorized")
        for fault in self.faults:
            if fault.times > 0 and fault.method in (request.method, "*") and fault.path.search(request.path_qs):
                fault.times -= 1
                self.calls[(request.method, "fault")] += 1
                return _status(fault.status, "InternalError", f"injected fault {fault.status}")
        return await handler(request)

    async def _dispatch(self, request: web.Request):
        parts = [p for p in request.path.split("/") if p]
        try:
            if parts[:2] == ["api", "v1"] and len(parts) >= 4 and parts[2] == "namespaces":
                ns, plural, name = parts[3], parts[4], (parts[5] if len(parts) > 5 else None)
                if plural == "pods" and parts[6:] == ["log"]:
                    return self._pod_log(ns, name, request.query)  # jobs.py
                if plural not in CORE_KINDS or plural == "nodes":
                    return _status(404, "NotFound", f"the server could not find the requested resource ({plural})")
                return await self._resource(request, plural, ns, name)
            if parts[:3] == ["api", "v1", "nodes"] and (len(parts) <= 4 or parts[4:] == ["status"]):
                # Nodes (cluster-scoped; .../status patched like the object: the double keeps one copy).
                # The double's admission never looks at them, as Kueue does not: what reads them
                # is the hub's capacity keeper (kube/capacity.py).
                return await self._resource(request, "nodes", None, parts[3] if len(parts) > 3 else None)
            if parts[:3] == ["apis", "kueue.x-k8s.io", "v1beta2"]:
                rest = parts[3:]
                if rest and rest[0] == "namespaces":
                    ns, plural, name = rest[1], rest[2], (rest[3] if len(rest) > 3 else None)
                else:
                    ns, plural, name = None, rest[0], (rest[1] if len(rest) > 1 else None)
                if plural not in KUEUE_KINDS:
                    return _status(404, "NotFound", f"the server could not find the requested resource ({plural})")
                return await self._resource(request, plural, ns, name)
            if parts[:3] == ["apis", "batch", "v1"]:
                return await self._jobs_route(request, parts[3:])  # jobs.py
            if parts[:3] == ["apis", "ray.io", "v1"]:
                return await self._ray_route(request, parts[3:])  # ray.py
            if (
                parts[:3] == ["apis", "networking.k8s.io", "v1"]
                and parts[3:4] == ["namespaces"]
                and parts[5:6] == ["networkpolicies"]
            ):
                return await self._netpol_route(request, parts[4], parts[6] if len(parts) > 6 else None)
            if parts[:3] == ["apis", "visibility.kueue.x-k8s.io", "v1beta2"]:
                self.calls[("GET", "pendingworkloads")] += 1
                rest = parts[3:]
                if rest[0] == "namespaces" and rest[2] == "localqueues" and rest[4] == "pendingworkloads":
                    return self._pending(lq=(rest[1], rest[3]))
                if rest[0] == "clusterqueues" and rest[2] == "pendingworkloads":
                    return self._pending(cq=rest[1])
        except InvalidObject as e:
            self.invalid.append(str(e))
            return _status(422, "Invalid", str(e))
        return _status(404, "NotFound", f"the server could not find the requested resource ({request.path})")

    async def _netpol_route(self, request, ns, name):
        """NetworkPolicies (issue 39's walls): create (validated strictly), get, list by label,
        delete; the garbage collector's part is ``_collect_owned``. Stored, never enforced."""
        self.calls[(request.method, "networkpolicies")] += 1
        if request.method == "POST" and name is None:
            body = await request.json()
            body.setdefault("apiVersion", "networking.k8s.io/v1")
            body.setdefault("kind", "NetworkPolicy")
            body["metadata"]["namespace"] = ns
            validate_core(body)
            if ("networkpolicies", ns, body["metadata"]["name"]) in self.objects:
                return _status(
                    409, "AlreadyExists", f'networkpolicies.networking.k8s.io "{body["metadata"]["name"]}" already exists'
                )
            return web.json_response(self._write("networkpolicies", ns, body, "ADDED"), status=201)
        if request.method == "GET" and name is None:
            items = [
                copy.deepcopy(o)
                for (p, n, _), o in self.objects.items()
                if p == "networkpolicies" and n == ns and _match_labels(o, request.query.get("labelSelector", ""))
            ]
            return web.json_response(
                {
                    "apiVersion": "networking.k8s.io/v1",
                    "kind": "NetworkPolicyList",
                    "metadata": {"resourceVersion": str(self.last_rv)},
                    "items": items,
                }
            )
        obj = self.objects.get(("networkpolicies", ns, name))
        if obj is None:
            return _status(404, "NotFound", f'networkpolicies.networking.k8s.io "{name}" not found')
        if request.method == "GET":
            return web.json_response(obj)
        if request.method == "DELETE":
            self._write("networkpolicies", ns, obj, "DELETED")
            return web.json_response(obj)
        return _status(405, "MethodNotAllowed", "method not allowed")

    def _collect_owned(self, owner: dict) -> None:
        """The garbage collector: objects whose ownerReferences name ``owner``'s UID go with it
        (here only what the double does not remove itself: NetworkPolicies, Services)."""
        uid = owner["metadata"].get("uid")
        for (p, n, _), o in list(self.objects.items()):
            if p in ("networkpolicies", "services") and any(
                r.get("uid") == uid for r in o["metadata"].get("ownerReferences") or []
            ):
                self._write(p, n, o, "DELETED")

    async def _resource(self, request, plural, ns, name):
        method = request.method
        q = request.query
        if method == "GET" and name is None:
            if q.get("watch") in ("true", "1", "True"):
                self.calls[("WATCH", plural)] += 1
                return await self._watch(request, plural, ns)
            self.calls[("LIST", plural)] += 1
            items = [
                copy.deepcopy(o)
                for (p, n, _), o in self.objects.items()
                if p == plural
                and (ns is None or n == ns)
                and _match_labels(o, q.get("labelSelector", ""))
                and _match_fields(o, q.get("fieldSelector", ""))
            ]
            kind = (CORE_KINDS.get(plural) or KUEUE_KINDS[plural]) + "List"
            api = "v1" if plural in CORE_KINDS else API_VERSION
            return web.json_response(
                {"apiVersion": api, "kind": kind, "metadata": {"resourceVersion": str(self.last_rv)}, "items": items}
            )
        self.calls[(method, plural)] += 1
        key = (plural, ns, name)
        if method == "GET":
            obj = self.objects.get(key)
            return web.json_response(obj) if obj else _status(404, "NotFound", f'{plural} "{name}" not found')
        if method == "POST" and name is None:
            body = await request.json()
            if plural != "pods":
                validate(body)
                if (plural, ns, body["metadata"]["name"]) in self.objects:
                    return _status(409, "AlreadyExists", f'{plural} "{body["metadata"]["name"]}" already exists')
                body["metadata"]["namespace"] = ns
                return web.json_response(self._write(plural, ns, body, "ADDED"), status=201)
            return self._create_pod(ns, body)
        if method == "DELETE":
            obj = self.objects.get(key)
            if obj is None:
                return _status(404, "NotFound", f'{plural} "{name}" not found')
            grace = q.get("gracePeriodSeconds")
            try:
                body = await request.json()
            except Exception:
                body = {}
            if grace is None and body:
                grace = body.get("gracePeriodSeconds")
            return web.json_response(self._delete(plural, ns, name, int(grace) if grace is not None else 30))
        if method == "PATCH":
            obj = self.objects.get(key)
            if obj is None:
                return _status(404, "NotFound", f'{plural} "{name}" not found')
            patch = await request.json()
            expected = (patch.get("metadata") or {}).get("resourceVersion")
            if expected and expected != obj["metadata"]["resourceVersion"]:
                return _status(
                    409, "Conflict", f'Operation cannot be fulfilled on {plural} "{name}": the object has been modified'
                )
            ctype = (request.headers.get("Content-Type") or "").split(";")[0].strip()
            if ctype not in ("application/merge-patch+json", "application/strategic-merge-patch+json") or (
                ctype.startswith("application/strategic") and plural not in CORE_KINDS
            ):
                # The real API server: a JSON patch must be a list; no strategic merge for custom resources.
                return _status(
                    415,
                    "UnsupportedMediaType",
                    "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml",
                )
            merged = _merge(copy.deepcopy(obj), patch)
            validate(merged)
            written = self._write(plural, ns, merged, "MODIFIED")
            if plural == "workloads":
                self._workload_active_changed(obj, merged)
            return web.json_response(written)
        return _status(405, "MethodNotAllowed", "method not allowed")

    async def _watch(self, request, plural, ns):
        q = request.query
        rv = q.get("resourceVersion")
        timeout = float(q.get("timeoutSeconds") or 1800)
        w = Watcher(plural, ns, q.get("labelSelector", ""), q.get("fieldSelector", ""))
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        initial: list[tuple[str, dict]] = []
        if rv in (None, "", "0"):
            initial = [("ADDED", copy.deepcopy(o)) for (p, _, _), o in self.objects.items() if w.wants(p, o)]
        else:
            rv = int(rv)
            oldest = self.history[0][0] if self.history else self.last_rv + 1
            if rv < oldest - 1:
                gone = {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "status": "Failure",
                    "reason": "Expired",
                    "code": 410,
                    "message": f"too old resource version: {rv} ({oldest - 1})",
                    "metadata": {},
                }
                await resp.write((json.dumps({"type": "ERROR", "object": gone}) + "\n").encode())
                return resp
            initial = [(t, o) for r, t, p, o in self.history if r > rv and w.wants(p, o)]
        self.watchers.append(w)
        deadline = time.monotonic() + timeout
        try:
            for event in initial:
                await resp.write((json.dumps({"type": event[0], "object": event[1]}) + "\n").encode())
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    item = await asyncio.wait_for(w.queue.get(), remaining)
                except asyncio.TimeoutError:
                    break
                if item is None:  # dropped by the test: cut the connection mid-stream
                    request.transport.close() if request.transport else None
                    return resp
                await resp.write((json.dumps({"type": item[0], "object": item[1]}) + "\n").encode())
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            if w in self.watchers:
                self.watchers.remove(w)
        return resp

    # -- pods: Kueue's webhook, deletion, kubelet ---------------------------------------------
    def _webhook_applies(self, ns) -> bool:
        if self.webhook_namespaces is None:
            return ns not in ("kube-system", K.WEBHOOK_NAMESPACE)
        return ns in self.webhook_namespaces

    def _create_pod(self, ns, pod):
        pod.setdefault("apiVersion", "v1")
        pod.setdefault("kind", "Pod")
        pod["metadata"]["namespace"] = ns
        validate(pod)  # what the client sent, before any mutation
        name = pod["metadata"]["name"]
        if self._webhook_applies(ns) and not self.kueue_up:
            # The API server's words when a failurePolicy: Fail webhook has no endpoints.
            return _status(
                500,
                "InternalError",
                (
                    f'Internal error occurred: failed calling webhook "{K.POD_MUTATING_WEBHOOK}": failed to call webhook: '
                    f'Post "https://{K.WEBHOOK_SERVICE}.{K.WEBHOOK_NAMESPACE}.svc:443/mutate--v1-pod?timeout=10s": '
                    f'no endpoints available for service "{K.WEBHOOK_SERVICE}"'
                ),
            )
        if ("pods", ns, name) in self.objects:
            return _status(409, "AlreadyExists", f'pods "{name}" already exists')
        _canonical_resources(pod["spec"])  # the API server stores quantities as canonical strings
        labels = pod["metadata"].setdefault("labels", {})
        queued = (
            QUEUE_LABEL in labels
            and self._webhook_applies(ns)
            and (self.managed_namespaces is None or ns in self.managed_namespaces)
        )
        if queued:  # Kueue's pod webhook (pod_webhook.go Default)
            labels[MANAGED_LABEL] = K.MANAGED_VALUE
            pod["metadata"].setdefault("finalizers", []).append(POD_FINALIZER)
            pod["spec"].setdefault("schedulingGates", []).append({"name": ADMISSION_GATE})
        pod["status"] = {"phase": "Pending", "qosClass": "Guaranteed"}
        validate(pod)
        self._write("pods", ns, pod, "ADDED")
        if queued:
            self._create_workload(pod)
        else:
            self.loop.call_soon(self._run_pod, ns, name)
        return web.json_response(pod, status=201)

    def _create_workload(self, pod):
        meta = pod["metadata"]
        digest = hashlib.sha256(meta["uid"].encode()).hexdigest()[:5]
        pclass = meta["labels"].get(PRIORITY_LABEL)
        wpc = self.objects.get(("workloadpriorityclasses", None, pclass)) if pclass else None
        spec_template = {k: v for k, v in pod["spec"].items() if k != "schedulingGates"}
        wl = {
            "apiVersion": API_VERSION,
            "kind": "Workload",
            "metadata": {
                "name": f"pod-{meta['name']}-{digest}",
                "namespace": meta["namespace"],
                "labels": {JOB_UID_LABEL: meta["uid"]},
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": {
                "queueName": meta["labels"][QUEUE_LABEL],
                "podSets": [
                    {
                        "name": "main",
                        "count": 1,
                        "template": {"metadata": {"labels": dict(meta["labels"])}, "spec": spec_template},
                    }
                ],
                "priority": wpc["value"] if wpc else 0,
                "active": True,
            },
        }
        if wpc:
            wl["spec"]["priorityClassRef"] = {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": pclass}
        validate(wl)
        self._write("workloads", meta["namespace"], wl, "ADDED")
        # Events are recorded asynchronously, as Kueue's recorder does: after the pod's answer.
        self.loop.call_soon(
            lambda: self._event(
                pod,
                K.EVENT_CREATED_WORKLOAD,
                K.msg_created_workload(meta["namespace"], wl["metadata"]["name"]),
                component=K.EVENT_REPORTING_CONTROLLER,
                action=K.EVENT_CREATED_WORKLOAD,
            )
        )

    def _delete(self, plural, ns, name, grace):
        obj = self.objects[(plural, ns, name)]
        if plural != "pods":
            self._write(plural, ns, obj, "DELETED")
            return obj
        proc = self.processes.get(f"{ns}/{name}")
        if proc and proc.poll() is None and grace > 0:
            obj["metadata"]["deletionTimestamp"] = now_iso()
            obj["metadata"]["deletionGracePeriodSeconds"] = grace
            self._write("pods", ns, obj, "MODIFIED")
            proc.send_signal(signal.SIGTERM)
            self.loop.create_task(self._finish_delete(ns, name, grace))
            return obj
        self._remove_pod(ns, name)
        return self.objects.get(("pods", ns, name), obj)

    async def _finish_delete(self, ns, name, grace):
        proc = self.processes.get(f"{ns}/{name}")
        deadline = time.monotonic() + min(grace, 5)
        while proc and proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if ("pods", ns, name) in self.objects:
            self._remove_pod(ns, name)

    def _remove_pod(self, ns, name):
        proc = self.processes.pop(f"{ns}/{name}", None)
        if proc:
            self._kill(proc)
        pod = self.objects.get(("pods", ns, name))
        if pod is None:
            return
        if POD_FINALIZER in (pod["metadata"].get("finalizers") or []) and not self.kueue_up:
            # The kubelet has stopped the containers; the object stays until Kueue removes
            # its finalizer (pod_controller.go removePodFinalizers), which needs Kueue running.
            pod = copy.deepcopy(pod)
            pod["metadata"].setdefault("deletionTimestamp", now_iso())
            pod["metadata"].setdefault("deletionGracePeriodSeconds", 0)
            status = pod.setdefault("status", {})
            status["phase"] = "Failed" if status.get("phase") == "Running" else status.get("phase", "Pending")
            for c in status.get("containerStatuses") or []:
                c.update(ready=False, started=False, state={"terminated": {"exitCode": 143, "reason": "Error"}})
            self._write("pods", ns, pod, "MODIFIED")
            return
        self._write("pods", ns, pod, "DELETED")
        for wl in [w for (p, n, _), w in list(self.objects.items()) if p == "workloads" and n == ns]:
            if owner_pod_name(wl) != name:
                continue
            if _cond(wl, "QuotaReserved") == "True":  # Kueue finishes it with the pod: its quota is free now
                self._write("workloads", ns, wl, "DELETED")
            else:  # garbage collection through the owner reference, which takes a moment on a real
                # cluster: a preempted pod's Workload, with its Evicted/Preempted record, is still
                # readable just after the pod has gone (seen on Kueue v0.19.2, N5)
                self.loop.call_later(GC_DELAY, self._collect, ns, wl["metadata"]["name"], wl["metadata"]["uid"])

    def _collect(self, ns, name, uid):
        wl = self.objects.get(("workloads", ns, name))
        if wl is not None and wl["metadata"]["uid"] == uid:
            self._write("workloads", ns, wl, "DELETED")

    def _release_finalizers(self):
        for (p, ns, name), pod in list(self.objects.items()):
            if (
                p == "pods"
                and pod["metadata"].get("deletionTimestamp")
                and POD_FINALIZER in (pod["metadata"].get("finalizers") or [])
            ):
                self._remove_pod(ns, name)

    @staticmethod
    def _kill(proc):
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(5)

    def _event(self, pod, reason, message, etype="Normal", component="kubelet", action=None):
        ts = now_iso()
        ev = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{pod['metadata']['name']}.{uuid.uuid4().hex[:16]}", "namespace": pod["metadata"]["namespace"]},
            "involvedObject": {
                "kind": "Pod",
                "name": pod["metadata"]["name"],
                "namespace": pod["metadata"]["namespace"],
                "uid": pod["metadata"]["uid"],
                "apiVersion": "v1",
            },
            "reason": reason,
            "message": message,
            "type": etype,
            "count": 1,
            "firstTimestamp": ts,
            "lastTimestamp": ts,
        }
        if component == "kubelet":
            ev["source"] = {"component": "kubelet", "host": "double-node-1"}
        else:  # events.k8s.io/v1 events (Kueue's recorder) as the core API shows them
            ev.update(
                reportingComponent=component,
                reportingInstance=f"{component}-double",
                action=action or reason,
                eventTime=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
                source={},
            )
        validate(ev)
        self._write("events", pod["metadata"]["namespace"], ev, "ADDED")

    def _run_pod(self, ns, name):
        """The scheduler and kubelet: bind, then run the container's command+env as a process."""
        try:
            self._start_container(ns, name)
        except Exception as e:  # surfaced to tests through ``errors``
            import traceback

            self.errors.append(f"{ns}/{name}: {e!r}\n{traceback.format_exc()}")

    def _start_container(self, ns, name):
        pod = self.objects.get(("pods", ns, name))
        if pod is None or pod["spec"].get("schedulingGates") or f"{ns}/{name}" in self.processes:
            return
        pod = copy.deepcopy(pod)
        pod["spec"]["nodeName"] = "double-node-1"
        self._write("pods", ns, pod, "MODIFIED")
        self._event(pod, "Scheduled", f"Successfully assigned {ns}/{name} to double-node-1")
        container = pod["spec"]["containers"][0]
        self._event(pod, "Pulling", f'Pulling image "{container["image"]}"')
        self._event(pod, "Pulled", f'Successfully pulled image "{container["image"]}"')
        argv = list(container.get("command") or []) + list(container.get("args") or [])
        env = dict(self.node_env)
        for item in container.get("env") or []:
            path = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            if path == "metadata.name":
                env[item["name"]] = name  # the downward API, as the kubelet resolves it
                continue
            m = re.fullmatch(r"metadata\.(annotations|labels)\['([^']+)'\]", path or "")
            if m:  # an Indexed Job's completion index (RANK), as the kubelet resolves it
                env[item["name"]] = (pod["metadata"].get(m.group(1)) or {}).get(m.group(2), "")
                continue
            if "value" not in item:
                raise InvalidObject(f"env {item['name']}: valueFrom is not supported by the double's kubelet")
            # $(VAR) expands from variables defined earlier in the list (the kubelet's rule).
            env[item["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), item["value"]
            )
        home = self.workdir / f"{ns}-{name}"
        home.mkdir(parents=True, exist_ok=True)
        env.setdefault("HOME", str(home))
        cwd = container.get("workingDir") if container.get("workingDir") and Path(container["workingDir"]).is_dir() else str(home)
        log = open(home / "container.log", "ab")
        # runAsUser is not applied: the tests' Python may not be readable by another uid.
        try:
            proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            self._event(pod, "Failed", f"Error: {e}", "Warning")
            return
        finally:
            log.close()
        self.processes[f"{ns}/{name}"] = proc
        self._event(pod, "Created", "Created container notebook")
        self._event(pod, "Started", "Started container notebook")
        probe = container.get("startupProbe") or container.get("readinessProbe")
        self._set_running(ns, name, container, ready=probe is None)
        if probe is not None:
            self.loop.create_task(self._probe(ns, name, container, probe))

    def _set_running(self, ns, name, container, ready: bool):
        """Running with an IP; ready (and started) as the kubelet says: at once without a
        probe, after the first successful startup/readiness probe with one."""
        ts = now_iso()
        pod = copy.deepcopy(self.objects[("pods", ns, name)])
        flag = "True" if ready else "False"
        pod["status"] = {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "hostIP": "127.0.0.1",
            "startTime": ts,
            "qosClass": "Guaranteed",
            "conditions": [
                {"type": t, "status": "True" if t in ("PodScheduled", "Initialized") else flag, "lastTransitionTime": ts}
                for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
            ],
            "containerStatuses": [
                {
                    "name": container["name"],
                    "ready": ready,
                    "started": ready,
                    "restartCount": 0,
                    "image": container["image"],
                    "imageID": "",
                    "state": {"running": {"startedAt": ts}},
                }
            ],
        }
        validate(pod)
        self._write("pods", ns, pod, "MODIFIED")
        if ready:
            self.ready_at[f"{ns}/{name}"] = time.monotonic()  # tests compare it with when a spawn ended

    async def _probe(self, ns, name, container, probe):
        """The kubelet's prober for an httpGet probe on the pod's IP (127.0.0.1 here): every
        periodSeconds after initialDelaySeconds, until it answers 200-399 once."""
        get = probe.get("httpGet") or {}
        url = f"http://127.0.0.1:{get.get('port')}{get.get('path') or '/'}"
        period = probe.get("periodSeconds", 10)
        await asyncio.sleep(probe.get("initialDelaySeconds", 0))
        async with aiohttp.ClientSession() as session:
            while f"{ns}/{name}" in self.processes and self.processes[f"{ns}/{name}"].poll() is None:
                try:
                    async with session.get(
                        url, timeout=aiohttp.ClientTimeout(total=probe.get("timeoutSeconds", 1)), allow_redirects=False
                    ) as r:
                        if 200 <= r.status < 400:
                            if ("pods", ns, name) in self.objects:
                                self._set_running(ns, name, container, ready=True)
                            return
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                await asyncio.sleep(period)

    def _check_processes(self):
        for key, proc in list(self.processes.items()):
            code = proc.poll()
            if code is None:
                continue
            ns, name = key.split("/", 1)
            pod = self.objects.get(("pods", ns, name))
            if pod is None or pod["status"].get("phase") != "Running":
                continue
            pod = copy.deepcopy(pod)
            c = pod["status"]["containerStatuses"][0]
            c.update(
                ready=False,
                started=False,
                state={"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}},
            )
            pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
            self._write("pods", ns, pod, "MODIFIED")
            wl = next(
                (w for (p, n, _), w in self.objects.items() if p == "workloads" and n == ns and owner_pod_name(w) == name), None
            )
            if wl:
                wl = copy.deepcopy(wl)
                _set_condition(wl, "Finished", "True", "Succeeded" if code == 0 else "Failed", f"exit code {code}")
                self._write("workloads", ns, wl, "MODIFIED")

    # -- Kueue: admission loop and visibility ---------------------------------------------
    async def _ticker(self):
        while True:
            await asyncio.sleep(0.2)
            try:
                self._check_processes()
                self._jobs_tick()  # jobs.py
                self._reconcile()
            except Exception as e:  # keep the double alive; the test sees the symptom
                print("kube double tick failed:", repr(e), file=sys.stderr)

    def _schedule_reconcile(self):
        if not getattr(self, "_reconcile_pending", False):
            self._reconcile_pending = True
            self.loop.call_soon(self._reconcile)

    def _cq_for(self, wl):
        """(ClusterQueue, None) or (None, (reason, message)) as Kueue's queue blockers say it."""
        lq = self.objects.get(("localqueues", wl["metadata"]["namespace"], wl["spec"]["queueName"]))
        if lq is None:
            return None, (K.REASON_INADMISSIBLE, K.MSG_LQ_MISSING.format(name=wl["spec"]["queueName"]))
        cq = self.objects.get(("clusterqueues", None, lq["spec"]["clusterQueue"]))
        if cq is None:
            return None, (K.REASON_INADMISSIBLE, K.MSG_CQ_MISSING.format(name=lq["spec"]["clusterQueue"]))
        flavors = [fl["name"] for rg in cq["spec"]["resourceGroups"] for fl in rg["flavors"]]
        if any(("resourceflavors", None, f) not in self.objects for f in flavors):
            # A ClusterQueue naming a missing flavor is inactive; the scheduler says so with "Pending".
            return None, (K.REASON_PENDING, K.MSG_CQ_INACTIVE.format(name=cq["metadata"]["name"]))
        return cq, None

    def _workload_active_changed(self, before: dict, wl: dict) -> None:
        """workload_controller.go: ``spec.active: false`` evicts an admitted Workload (reason
        Deactivated; a Job is suspended) and keeps it out of the queue; ``true`` requeues it."""
        was, now = before["spec"].get("active", True), wl["spec"].get("active", True)
        if was == now:
            return
        ns = wl["metadata"]["namespace"]
        wl = copy.deepcopy(wl)
        if not now:
            if _cond(wl, K.QUOTA_RESERVED) == "True":
                _set_condition(wl, K.EVICTED, "True", K.EVICTED_DEACTIVATED, K.MSG_DEACTIVATED)
                _set_condition(wl, K.QUOTA_RESERVED, "False", K.REASON_PENDING, K.MSG_DEACTIVATED)
                _set_condition(wl, K.ADMITTED, "False", K.ADMITTED_REASON_NO_RESERVATION, K.MSG_NO_RESERVATION)
                wl["status"].pop("admission", None)
                _count_eviction(wl, K.EVICTED_DEACTIVATED, "")
            _set_condition(wl, K.REQUEUED, "False", K.EVICTED_DEACTIVATED, K.MSG_DEACTIVATED)
            validate(wl)
            self._write("workloads", ns, wl, "MODIFIED")
            job_name = owner_job_name(wl)
            if job_name and ("jobs", ns, job_name) in self.objects:
                self._suspend_job(ns, job_name)
        else:
            _set_condition(wl, K.REQUEUED, "True", K.REASON_REACTIVATED, K.MSG_REACTIVATED)
            validate(wl)
            self._write("workloads", ns, wl, "MODIFIED")
        self._schedule_reconcile()

    def _pending_workloads(self):
        out = []
        for (p, _, _), wl in self.objects.items():
            if p != "workloads" or _cond(wl, "QuotaReserved") == "True" or _cond(wl, "Finished") == "True":
                continue
            if wl["spec"].get("active") is False:  # deactivated: not in the queue until reactivated
                continue
            if _cond(wl, "Requeued") == "False":  # evicted and not requeued (a preempted pod's): out of the queue
                continue
            out.append(wl)
        # Kueue orders by priority, then by creation (the order the pods were created here);
        # with Admission Fair Sharing, a ClusterQueue's queue by its LocalQueues' usage first.
        afs = self._afs_queues()
        return sorted(out, key=lambda w: (self._afs_key(w, afs), -(w["spec"].get("priority") or 0), _creation_rank(w)))

    # -- Admission Fair Sharing (pkg/util/admissionfairsharing, localqueue_controller.go) ------------
    def _afs_queues(self) -> dict[tuple[str, str], str]:
        """(namespace, LocalQueue) -> ClusterQueue, for the ClusterQueues that use Admission Fair
        Sharing (``admissionScope.admissionMode: UsageBasedAdmissionFairSharing``, and the
        Configuration's ``admissionFairSharing`` block)."""
        if not self.kueue_config.get("admissionFairSharing"):
            return {}
        on = {
            name
            for (p, _, name), cq in self.objects.items()
            if p == "clusterqueues"
            and ((cq["spec"].get("admissionScope") or {}).get("admissionMode")) == "UsageBasedAdmissionFairSharing"
        }
        return {
            (ns, name): lq["spec"]["clusterQueue"]
            for (p, ns, name), lq in self.objects.items()
            if p == "localqueues" and lq["spec"]["clusterQueue"] in on
        }

    def _afs_advance(self) -> None:
        """Each such LocalQueue's consumed resources brought forward to now: an exponentially
        weighted average of its admitted usage with the configured half-life, as Kueue's
        sampling computes it (CalculateDecayedConsumed), here at every scheduling pass instead
        of every usageSamplingInterval; written to the LocalQueue's status as Kueue writes it."""
        queues = self._afs_queues()
        if not queues:
            return
        afs = self.kueue_config["admissionFairSharing"]
        half_life = _go_seconds(afs.get("usageHalfLifeTime", "168h"))
        now = time.time()
        admitted: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for (p, ns, _), wl in self.objects.items():
            if p == "workloads" and _cond(wl, "QuotaReserved") == "True" and _cond(wl, "Finished") != "True":
                for psa in wl["status"]["admission"]["podSetAssignments"]:
                    for res, qty in psa["resourceUsage"].items():
                        admitted[(ns, wl["spec"]["queueName"])][res] += _amount(res, qty) / (1000 if res == "cpu" else 1)
        for key in queues:
            old, at = self.afs_usage.get(key, ({}, now))
            alpha = 1.0 - 0.5 ** (max(0.0, now - at) / half_life) if half_life > 0 else 1.0
            new_usage = admitted.get(key, {})
            consumed = {r: old.get(r, 0.0) * (1 - alpha) + new_usage.get(r, 0.0) * alpha for r in set(old) | set(new_usage)}
            self.afs_usage[key] = (consumed, now)
            lq = self.objects.get(("localqueues", *key))
            if lq is None:
                continue
            shown = {r: f"{int(v * 1e9)}n" if v else "0" for r, v in sorted(consumed.items())}
            status = (lq.get("status") or {}).get("fairSharing", {}).get("admissionFairSharingStatus") or {}
            last = status.get("lastUpdate")
            if status.get("consumedResources") != shown and (last is None or now - _time(last) >= 1):
                lq = copy.deepcopy(lq)
                lq.setdefault("status", {}).setdefault("fairSharing", {"weightedShare": 0})["admissionFairSharingStatus"] = {
                    "consumedResources": shown,
                    "lastUpdate": datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                }
                validate(lq)
                self._write("localqueues", key[0], lq, "MODIFIED")

    def _afs_key(self, wl, afs_queues: dict) -> float:
        """CalculateUsage: the workload's LocalQueue's consumed resources, each times its
        ``resourceWeights`` entry (1 when absent), divided by the LocalQueue's fairSharing
        weight; 0 where Admission Fair Sharing is off (then only priority and arrival count)."""
        key = (wl["metadata"]["namespace"], wl["spec"]["queueName"])
        if key not in afs_queues:
            return 0.0
        weights = self.kueue_config["admissionFairSharing"].get("resourceWeights") or {}
        consumed, _ = self.afs_usage.get(key, ({}, 0.0))
        usage = sum(float(weights.get(r, 1.0)) * v for r, v in consumed.items())
        lq = self.objects.get(("localqueues", *key)) or {}
        weight = float(str(((lq.get("spec") or {}).get("fairSharing") or {}).get("weight", "1")))
        return usage / weight if weight > 0 else float("inf")

    def _snapshot(self):
        """The scheduler's view at the start of a pass: quota in use per (ClusterQueue, flavor,
        resource), and the workloads holding it per ClusterQueue (preemption candidates)."""
        used = defaultdict(int)  # (cq, flavor, resource) -> amount
        holders: dict[str, list[_Holder]] = defaultdict(list)
        for (p, _, _), wl in self.objects.items():
            if p == "workloads" and _cond(wl, "QuotaReserved") == "True" and _cond(wl, "Finished") != "True":
                adm = wl["status"]["admission"]
                usage: dict[tuple[str, str], int] = defaultdict(int)
                for psa in adm["podSetAssignments"]:
                    for res, qty in psa["resourceUsage"].items():
                        usage[(psa["flavors"][res], res)] += _amount(res, qty)
                for (flavor, res), amount in usage.items():
                    used[(adm["clusterQueue"], flavor, res)] += amount
                holders[adm["clusterQueue"]].append(_Holder(wl, adm["clusterQueue"], dict(usage)))
        return used, holders

    def _assign(self, cq, pod_spec, request, used, quotas):
        """Kueue's flavor assigner (pkg/scheduler/flavorassigner, fitsResourceQuota) for one pod set.

        Per resource group the first flavor that fits; failing that, the first flavor in
        "Preempt" mode (the request is within the maximum capacity and preemption may free
        it: within the nominal quota, or reclaimable in the cohort, or borrowWithinCohort is
        allowed). Returns (assignment {resource: flavor} or None for NoFit, the (flavor,
        resource)s that need preemption, the reasons for the message)."""
        name = cq["metadata"]["name"]
        bwc = (quotas.preemption[name].get("borrowWithinCohort") or {}).get("policy", K.BORROW_WITHIN_COHORT_NEVER)
        can_preempt_while_borrowing = bwc != K.BORROW_WITHIN_COHORT_NEVER
        reasons = [
            K.MSG_RESOURCE_UNAVAILABLE.format(resource=res)
            for res in request
            if not any(res in rg["coveredResources"] for rg in cq["spec"]["resourceGroups"])
        ]
        if reasons:
            return None, set(), reasons
        assignment, need, no_fit = {}, set(), False
        for rg in cq["spec"]["resourceGroups"]:
            wanted = [r for r in rg["coveredResources"] if r in request]
            if not wanted:
                continue
            group_reasons, fallback = [], None
            for fl in rg["flavors"]:
                flavor = self.objects.get(("resourceflavors", None, fl["name"]))
                labels = (flavor or {}).get("spec", {}).get("nodeLabels") or {}
                selector = pod_spec.get("nodeSelector") or {}
                if any(k in selector and selector[k] != v for k, v in labels.items()):
                    group_reasons.append(K.MSG_NODE_AFFINITY.format(flavor=fl["name"]))
                    continue
                mode, frs = "Fit", set()
                for res in wanted:
                    fr = (fl["name"], res)
                    val, cap, free = request[res], quotas.potential(name, fr), quotas.available(name, fr, used)
                    if val > cap:  # one pod set: nothing previously considered
                        group_reasons.append(
                            K.MSG_MAX_CAPACITY.format(
                                resource=res,
                                flavor=fl["name"],
                                previous=_fmt(res, 0),
                                request=_fmt(res, val),
                                capacity=_fmt(res, cap),
                            )
                        )
                        mode = "NoFit"
                    elif val > free:
                        group_reasons.append(
                            K.MSG_UNUSED_QUOTA.format(resource=res, flavor=fl["name"], more=_fmt(res, val - free))
                        )
                        nominal = quotas.nominal(name, fr)
                        may_reclaim = bool(quotas.cohort.get(name)) and used[(name, *fr)] + val <= nominal
                        if nominal >= val or may_reclaim or can_preempt_while_borrowing:
                            frs.add(fr)
                            mode = "NoFit" if mode == "NoFit" else "Preempt"
                        else:
                            mode = "NoFit"
                if mode == "Fit":
                    assignment.update({res: fl["name"] for res in wanted})
                    break
                if mode == "Preempt" and fallback is None:
                    fallback = ({res: fl["name"] for res in wanted}, frs)
            else:
                reasons.extend(group_reasons)
                if fallback is None:
                    no_fit = True
                else:
                    assignment.update(fallback[0])
                    need |= fallback[1]
        return (None if no_fit else assignment), need, reasons

    def _reconcile(self):
        """One scheduling pass in Kueue's order: admit what fits; for a workload whose request
        only preemption can make room for, evict the targets (its admission follows in a later
        pass, once their quota is released), as pkg/scheduler/scheduler.go processEntry does."""
        self._reconcile_pending = False
        if not self.auto_admit or not self.kueue_up:
            return
        self._afs_advance()
        pending = self._pending_workloads()
        if not pending:
            return
        used, holders = self._snapshot()
        quotas = _Quotas(self.objects)
        blocked_cqs: set[str] = set()  # StrictFIFO: the head that does not fit blocks the rest
        preempted: set[tuple[str, str]] = set()  # targets issued in this pass (preemptedWorkloads)
        failed_shapes: set[tuple] = set()  # N3: one failed request of a shape stands for the rest
        order, fitted_at_start = self._cycle_order(pending, used, quotas)
        for wl in order:
            cq, problem = self._cq_for(wl)
            if cq is not None and cq["metadata"]["name"] in blocked_cqs:
                continue
            if cq is None:
                self._set_pending(wl, *problem)
                continue
            name = cq["metadata"]["name"]
            pod_spec, request = _workload_request(wl)
            shape = (name, tuple(sorted(request.items())))
            if shape in failed_shapes:
                # Kueue v0.19.2 does not evaluate a request of the same shape again in a cycle
                # once one failed: the second and later waiters keep no QuotaReserved message.
                continue
            assignment, need, reasons = self._assign(cq, pod_spec, request, used, quotas)
            if assignment is not None and not need:
                for res, flavor in assignment.items():
                    used[(name, flavor, res)] += request[res]
                self._admit(wl, cq, assignment, request)
                continue
            if cq["spec"].get("queueingStrategy") == "StrictFIFO":
                blocked_cqs.add(name)
            failed_shapes.add(shape)
            if wl["metadata"]["uid"] in fitted_at_start:  # nominated as Fit; another entry took it
                self._set_pending(wl, K.REASON_PENDING, K.MSG_NO_LONGER_FITS)
                continue
            message = K.MSG_ASSIGN_PREFIX.format(podset=_failing_pod_set(wl, reasons)) + ", ".join(sorted(reasons))
            if assignment is None:
                self._set_pending(wl, K.REASON_PENDING, message)
                continue
            usage = {(flavor, res): request[res] for res, flavor in assignment.items()}
            targets = _preemption_targets(wl, name, usage, need, used, holders, quotas)
            if not targets:
                if quotas.preemption[name].get("reclaimWithinCohort", K.PREEMPTION_NEVER) != K.PREEMPTION_ANY:
                    _reserve(name, usage, used, quotas)  # reserveCapacityForUnreclaimablePreempt
                self._set_pending(wl, K.REASON_PENDING, message)
                continue
            if any(t.key in preempted for t, _ in targets):
                self._set_pending(wl, K.REASON_PENDING, K.MSG_OVERLAPPING_TARGETS)
                continue
            for fr, amount in usage.items():  # cq.AddUsage: nobody else takes it in this pass
                used[(name, *fr)] += amount
            for target, reason in targets:
                preempted.add(target.key)
                self._evict_for(target, reason, wl, name, quotas)
            self._set_pending(wl, K.REASON_PENDING, message + K.MSG_PENDING_PREEMPTION.format(count=len(targets)))

    def _cycle_order(self, pending, used, quotas):
        """Kueue's order within a scheduling pass: each ClusterQueue's queue in priority, then
        FIFO order; among the ClusterQueues' heads, a request within its queue's nominal quota
        goes before one that would borrow, then priority, then FIFO (scheduler.go
        entryOrdering). N2 on the real controller: a lender's own-quota request is admitted
        before a higher-priority borrower that waited as long. Returns (the order, the uids of
        the heads that fitted when the pass began: Kueue's "no longer fits" candidates)."""
        queues: dict[str, list] = defaultdict(list)
        order: list = []
        fitted: set[str] = set()
        for wl in pending:  # already priority, then creation
            cq, _ = self._cq_for(wl)
            if cq is None:
                order.append(wl)
            else:
                queues[cq["metadata"]["name"]].append((wl, cq))

        def key(item, head_at_start=False):
            wl, cq = item
            name = cq["metadata"]["name"]
            pod_spec, request = _workload_request(wl)
            assignment, need, _ = self._assign(cq, pod_spec, request, used, quotas)
            if head_at_start and assignment is not None and not need:  # Kueue nominates one head per queue
                fitted.add(wl["metadata"]["uid"])
            borrows = any(
                used[(name, flavor, res)] + request[res] > quotas.nominal(name, (flavor, res))
                for res, flavor in (assignment or {}).items()
            )
            share = self._share_after(name, assignment or {}, request, used, quotas) if fair_sharing else 0.0
            return (borrows, share, -(wl["spec"].get("priority") or 0), _creation_rank(wl))

        fair_sharing = bool(self.kueue_config.get("fairSharing"))
        heads = {name: (key(items[0], head_at_start=True), 0) for name, items in queues.items()}
        while heads:
            name = min(heads, key=lambda n: heads[n][0])
            _, i = heads.pop(name)
            order.append(queues[name][i][0])
            if i + 1 < len(queues[name]):
                heads[name] = (key(queues[name][i + 1]), i + 1)
        return order, fitted

    def _share_after(self, cq: str, assignment: dict, request: dict, used, quotas: "_Quotas") -> float:
        """Fair Sharing's tournament key (fair_sharing_iterator.go, fair_sharing.go
        dominantResourceShare): the ClusterQueue's dominant resource share with the workload
        admitted: per resource, what it would borrow beyond its nominal quota, times 1000 over
        what the cohort can lend of it, the largest of those, divided by ``fairSharing.weight``
        (a weight of 0 that borrows: last). 0 when it borrows nothing or has no cohort. Computed
        at the pass's start (Kueue recomputes it at each pop; one admission per pass here)."""
        cohort = quotas.cohort.get(cq)
        if not cohort:
            return 0.0
        borrowed: dict[str, int] = defaultdict(int)
        for (name, flavor, res), (nominal, _, _) in quotas.quota.items():
            if name != cq:
                continue
            extra = request.get(res, 0) if assignment.get(res) == flavor else 0
            over = used[(cq, flavor, res)] + extra - nominal
            if over > 0:
                borrowed[res] += over
        if not borrowed:
            return 0.0
        lendable: dict[str, int] = defaultdict(int)
        for (name, flavor, res), (nominal, _, _) in quotas.quota.items():
            if quotas.cohort.get(name) == cohort:
                lendable[res] += nominal - quotas._local(name, (flavor, res))
        ratio = max((b * 1000.0 / lendable[r] for r, b in borrowed.items() if lendable[r] > 0), default=0.0)
        spec = (self.objects.get(("clusterqueues", None, cq)) or {}).get("spec") or {}
        weight = float(str((spec.get("fairSharing") or {}).get("weight", "1")))
        if weight == 0:
            return float("inf") if ratio else 0.0
        return ratio / weight

    def _evict_for(self, target: "_Holder", reason: str, preemptor: dict, preemptor_cq: str, quotas: "_Quotas"):
        """IssuePreemptions for one target: Kueue's message, then the job integration stops it."""

        def path(cq):
            return "/" + "/".join(filter(None, [quotas.cohort.get(cq), cq]))

        meta = preemptor["metadata"]
        message = K.MSG_PREEMPTED.format(
            uid=meta.get("uid") or K.UNKNOWN,
            job_uid=(meta.get("labels") or {}).get(JOB_UID_LABEL) or K.UNKNOWN,
            why=K.PREEMPTION_WHY.get(reason, ""),
            preemptor_path=path(preemptor_cq),
            preemptee_path=path(target.cq),
        )
        ns = target.wl["metadata"]["namespace"]
        pod_name = owner_pod_name(target.wl)
        if pod_name:
            self._preempt(ns, pod_name, reason, message)
            return
        job_name = owner_job_name(target.wl)
        if job_name and ("jobs", ns, job_name) in self.objects:
            self._preempt_job(ns, job_name, reason, message)
            return
        ray_name = owner_ray_name(target.wl)
        if ray_name and ("rayclusters", ns, ray_name) in self.objects:
            self._preempt_ray(ns, ray_name, reason, message)

    def _set_pending(self, wl, reason, message):
        cond = next((c for c in (wl.get("status") or {}).get("conditions") or [] if c["type"] == "QuotaReserved"), None)
        if cond and cond["reason"] == reason and cond["message"] == message:
            return
        wl = copy.deepcopy(wl)
        _set_condition(wl, "QuotaReserved", "False", reason, message)
        # The Workload was validated when created; a status change is validated once per
        # (reason, message): with 100 waiting pods, re-validating the same condition 100
        # times held the double's loop for seconds and starved the watches.
        if (reason, message) not in self._validated_conditions:
            validate(wl)
            self._validated_conditions.add((reason, message))
        self._write("workloads", wl["metadata"]["namespace"], wl, "MODIFIED")

    def _admit(self, wl, cq, assignment, request):
        wl = copy.deepcopy(wl)
        per_pod_set = _pod_set_requests(wl)
        if len(per_pod_set) == 1 and per_pod_set[0][0] == "main":
            psas = [
                {
                    "name": "main",
                    "count": per_pod_set[0][1],  # an Indexed Job's N workers: one pod set of N
                    "flavors": assignment,
                    "resourceUsage": {r: _fmt(r, request[r]) for r in assignment},
                }
            ]
        else:  # several pod sets (a RayCluster's head and worker groups): each its own assignment
            psas = [
                {
                    "name": ps,
                    "count": count,
                    "flavors": {r: assignment[r] for r in req if r in assignment},
                    "resourceUsage": {r: _fmt(r, count * req[r]) for r in req if r in assignment},
                }
                for ps, count, req in per_pod_set
            ]
        wl.setdefault("status", {})["admission"] = {"clusterQueue": cq["metadata"]["name"], "podSetAssignments": psas}
        _set_condition(wl, K.QUOTA_RESERVED, "True", "QuotaReserved", K.MSG_QUOTA_RESERVED.format(name=cq["metadata"]["name"]))
        for ctype in (K.EVICTED, K.PREEMPTED):  # SetQuotaReservation: resetActiveCondition
            old = K.condition(wl, ctype)
            if old and old["status"] == "True":
                _set_condition(wl, ctype, "False", K.REASON_QUOTA_RESERVED, K.MSG_PREVIOUSLY.format(message=old["message"]))
        _set_condition(wl, K.ADMITTED, "True", "Admitted", K.MSG_ADMITTED)
        validate(wl)
        ns = wl["metadata"]["namespace"]
        self._write("workloads", ns, wl, "MODIFIED")
        pod_name = owner_pod_name(wl)
        pod = copy.deepcopy(self.objects.get(("pods", ns, pod_name)))
        if not pod:
            if self._ray_admitted(wl, {p["name"]: p["flavors"] for p in psas}):  # ray.py
                return
            self._job_admitted(wl, assignment)  # jobs.py: a Job's Workload has no pod of its own
            return
        pod["spec"]["schedulingGates"] = [g for g in pod["spec"].get("schedulingGates", []) if g["name"] != ADMISSION_GATE]
        if not pod["spec"]["schedulingGates"]:
            del pod["spec"]["schedulingGates"]
        for flavor_name in sorted(set(assignment.values())):  # Kueue injects the flavor's node labels
            flavor = self.objects.get(("resourceflavors", None, flavor_name)) or {}
            pod["spec"].setdefault("nodeSelector", {}).update(flavor.get("spec", {}).get("nodeLabels") or {})
        validate(pod)
        self._write("pods", ns, pod, "MODIFIED")
        self._event(pod, K.EVENT_STARTED, K.msg_started(cq["metadata"]["name"]), component=K.EVENT_REPORTING_CONTROLLER)
        self.loop.call_soon(self._run_pod, ns, pod_name)

    def _default_preemption_message(self, wl, preempted_reason):
        """The message of a preemption a test asks for: no preemptor, so Kueue's "UNKNOWN"s."""
        cq = ((wl or {}).get("status") or {}).get("admission", {}).get("clusterQueue")
        cq_obj = self.objects.get(("clusterqueues", None, cq)) if cq else None
        path = "/" + "/".join(filter(None, [(cq_obj or {}).get("spec", {}).get("cohortName"), cq])) if cq else K.UNKNOWN
        return K.MSG_PREEMPTED.format(
            uid=K.UNKNOWN,
            job_uid=K.UNKNOWN,
            why=K.PREEMPTION_WHY.get(preempted_reason, ""),
            preemptor_path=K.UNKNOWN,
            preemptee_path=path,
        )

    def _preempt(self, ns, pod_name, preempted_reason, message=None):
        """Kueue evicts a plain pod's Workload; the pod integration stops the pod (condition, delete)."""
        wl = next(
            (w for (p, n, _), w in self.objects.items() if p == "workloads" and n == ns and owner_pod_name(w) == pod_name), None
        )
        message = message or self._default_preemption_message(wl, preempted_reason)
        if wl:
            wl = copy.deepcopy(wl)
            # SkipReassignmentForPodOwnedWorkloads (on in v0.19): a pod's Workload is not requeued.
            _evicted_by_preemption(wl, preempted_reason, message, requeued=False)
            validate(wl)
            self._write("workloads", ns, wl, "MODIFIED")
        pod = copy.deepcopy(self.objects.get(("pods", ns, pod_name)))
        if pod:
            pod["status"].setdefault("conditions", []).append(
                {
                    "type": K.POD_TERMINATION_TARGET,
                    "status": "True",
                    "reason": K.stop_reason_for_eviction(K.EVICTED_BY_PREEMPTION),
                    "message": message,
                    "lastTransitionTime": now_iso(),
                }
            )
            validate(pod)
            self._write("pods", ns, pod, "MODIFIED")
            self._event(pod, K.EVENT_STOPPED, message, component=K.EVENT_REPORTING_CONTROLLER)
            self._remove_pod(ns, pod_name)

    def _pending(self, lq=None, cq=None):
        by_cq = defaultdict(list)
        for wl in self._pending_workloads():
            target, _ = self._cq_for(wl)
            if target is not None:
                by_cq[target["metadata"]["name"]].append(wl)
        items = []
        for cq_name, wls in by_cq.items():
            per_lq = Counter()
            for pos, wl in enumerate(wls):
                key = (wl["metadata"]["namespace"], wl["spec"]["queueName"])
                items.append(
                    {
                        "metadata": {
                            "name": wl["metadata"]["name"],
                            "namespace": wl["metadata"]["namespace"],
                            "creationTimestamp": wl["metadata"]["creationTimestamp"],
                            "ownerReferences": wl["metadata"]["ownerReferences"],
                        },
                        "priority": wl["spec"].get("priority", 0),
                        "localQueueName": wl["spec"]["queueName"],
                        "positionInClusterQueue": pos,
                        "positionInLocalQueue": per_lq[key],
                        "_cq": cq_name,
                    }
                )
                per_lq[key] += 1
        if lq:
            items = [i for i in items if (i["metadata"]["namespace"], i["localQueueName"]) == lq]
        if cq:
            items = [i for i in items if i["_cq"] == cq]
        for i in items:
            del i["_cq"]
        return web.json_response(
            {
                "apiVersion": "visibility.kueue.x-k8s.io/v1beta2",
                "kind": "PendingWorkloadsSummary",
                "metadata": {"creationTimestamp": None},
                "items": items,
            }
        )


GC_DELAY = 1.0  # seconds from an owner's deletion to its dependents' (the garbage collector's lag)
_CREATION = itertools.count()
_RANKS: dict[str, int] = {}


def _creation_rank(wl):
    uid = wl["metadata"]["uid"]
    if uid not in _RANKS:
        _RANKS[uid] = next(_CREATION)
    return _RANKS[uid]


def _tolerates(tol: dict, taint: dict) -> bool:
    """A pod's toleration matches a node's taint (key, effect, Exists or Equal value)."""
    if tol.get("key") and tol["key"] != taint.get("key"):
        return False
    if tol.get("effect") and tol["effect"] != taint.get("effect"):
        return False
    if tol.get("operator", "Equal") == "Exists":
        return True
    return bool(tol.get("key")) and tol.get("value", "") == taint.get("value", "")


def _cond(obj, ctype):
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return c["status"]
    return None


def _set_condition(obj, ctype, status, reason, message):
    conds = obj.setdefault("status", {}).setdefault("conditions", [])
    for c in conds:
        if c["type"] == ctype:
            if c["status"] != status:
                c["lastTransitionTime"] = now_iso()
            c.update(status=status, reason=reason, message=message)
            return
    conds.append({"type": ctype, "status": status, "reason": reason, "message": message, "lastTransitionTime": now_iso()})


def _count_eviction(wl, reason: str, cause: str) -> None:
    """pkg/workload: every eviction is counted by reason and underlying cause (kept across re-admission)."""
    stats = wl.setdefault("status", {}).setdefault("schedulingStats", {}).setdefault("evictions", [])
    entry = next((e for e in stats if e["reason"] == reason and e["underlyingCause"] == cause), None)
    if entry is None:
        stats.append({"reason": reason, "underlyingCause": cause, "count": 1})
    else:
        entry["count"] += 1


def _evicted_by_preemption(wl, preempted_reason, message, requeued: bool):
    """A Workload's conditions once Kueue preempted it and its job stopped (Evict, then the job
    reconciler: Requeued, QuotaReserved=False "Pending" with the eviction message, no admission)."""
    _set_condition(wl, K.EVICTED, "True", K.EVICTED_BY_PREEMPTION, message)
    _set_condition(wl, K.PREEMPTED, "True", preempted_reason, message)
    _count_eviction(wl, K.EVICTED_BY_PREEMPTION, "")  # N5: Kueue v0.19.2 leaves the cause empty for a preemption
    _set_condition(wl, K.REQUEUED, "True" if requeued else "False", K.EVICTED_BY_PREEMPTION, message)
    _set_condition(wl, K.QUOTA_RESERVED, "False", K.REASON_PENDING, message)
    _set_condition(wl, K.ADMITTED, "False", K.ADMITTED_REASON_NO_RESERVATION, K.MSG_NO_RESERVATION)
    wl["status"].pop("admission", None)


def _go_seconds(duration: str) -> float:
    """A Go duration of the Configuration ("1m", "24h", "1h30m", "5s") in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration))


def _time(stamp: str | None) -> float:
    """An RFC 3339 timestamp as Kueue reads it back from the API (whole seconds)."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else time.time()


_NO_QUOTA = (0, None, None)


@dataclass
class _Holder:
    """An admitted Workload as a preemption candidate: its ClusterQueue and quota in use."""

    wl: dict
    cq: str
    usage: dict  # (flavor, resource) -> amount

    @property
    def key(self) -> tuple[str, str]:
        return self.wl["metadata"]["namespace"], self.wl["metadata"]["name"]

    @property
    def priority(self) -> int:
        return self.wl["spec"].get("priority") or 0


class _Quotas:
    """Kueue's quota tree (pkg/cache/scheduler/resource_node.go) for cohorts named by
    ``spec.cohortName`` (one level, no Cohort objects): per (ClusterQueue, flavor, resource)
    the nominal quota, borrowing and lending limits; a cohort holds what its members lend.
    Usage is passed in, so preemption can simulate taking workloads away."""

    def __init__(self, objects):
        self.quota: dict[tuple[str, str, str], tuple[int, int | None, int | None]] = {}
        self.cohort: dict[str, str | None] = {}
        self.members: dict[str, list[str]] = defaultdict(list)
        self.preemption: dict[str, dict] = {}
        for (p, _, name), cq in objects.items():
            if p != "clusterqueues":
                continue
            spec = cq["spec"]
            self.cohort[name] = spec.get("cohortName") or None
            if self.cohort[name]:
                self.members[self.cohort[name]].append(name)
            self.preemption[name] = spec.get("preemption") or {}
            for rg in spec.get("resourceGroups") or []:
                for fl in rg["flavors"]:
                    for r in fl["resources"]:
                        res = r["name"]
                        limit = [_amount(res, r[k]) if k in r else None for k in ("borrowingLimit", "lendingLimit")]
                        self.quota[(name, fl["name"], res)] = (_amount(res, r["nominalQuota"]), *limit)

    def nominal(self, cq, fr) -> int:
        return self.quota.get((cq, *fr), _NO_QUOTA)[0]

    def _local(self, cq, fr) -> int:
        """localQuota: the part of the nominal quota that a lending limit keeps out of the cohort."""
        nominal, _, lend = self.quota.get((cq, *fr), _NO_QUOTA)
        return max(0, nominal - lend) if lend is not None else 0

    def available(self, cq, fr, used) -> int:
        """Available(): what the ClusterQueue may take now, its own and borrowed (never < 0)."""
        nominal, borrow, _ = self.quota.get((cq, *fr), _NO_QUOTA)
        mine = used[(cq, *fr)]
        cohort = self.cohort.get(cq)
        if not cohort:
            return max(0, nominal - mine)
        local = self._local(cq, fr)
        parent = 0  # the cohort's lendable quota less what its members use of it
        for m in self.members[cohort]:
            m_local = self._local(m, fr)
            parent += self.nominal(m, fr) - m_local - max(0, used[(m, *fr)] - m_local)
        if borrow is not None:
            parent = min(parent, nominal - local - max(0, mine - local) + borrow)
        return max(0, max(0, local - mine) + parent)

    def potential(self, cq, fr) -> int:
        """PotentialAvailable(): the most the ClusterQueue could ever hold ("maximum capacity")."""
        nominal, borrow, _ = self.quota.get((cq, *fr), _NO_QUOTA)
        cohort = self.cohort.get(cq)
        if not cohort:
            return nominal
        total = self._local(cq, fr) + sum(self.nominal(m, fr) - self._local(m, fr) for m in self.members[cohort])
        return total if borrow is None else min(nominal + borrow, total)

    def within_nominal(self, cq, frs, used) -> bool:
        """IsWithinNominalInResources: not borrowing any of ``frs``."""
        return all(self.nominal(cq, fr) >= used[(cq, *fr)] for fr in frs)


def _satisfies(policy: str, preemptor: dict, candidate: _Holder) -> bool:
    """preemption/common SatisfiesPreemptionPolicy (queue order timestamp: creation)."""
    mine, theirs = preemptor["spec"].get("priority") or 0, candidate.priority
    if policy == K.PREEMPTION_LOWER_PRIORITY:
        return mine > theirs
    if policy == K.PREEMPTION_LOWER_OR_NEWER_EQUAL_PRIORITY:
        return mine > theirs or (
            mine == theirs
            and _time(preemptor["metadata"].get("creationTimestamp")) < _time(candidate.wl["metadata"].get("creationTimestamp"))
        )
    return policy == K.PREEMPTION_ANY


def _preemption_targets(wl, cq, requests, need, used, holders, quotas: _Quotas) -> list[tuple[_Holder, str]]:
    """Kueue's classical preemption (pkg/scheduler/preemption: classicalPreemptions with
    classical/hierarchical_preemption.go and candidate_generator.go), for a one-level cohort.

    Candidates: workloads of the same ClusterQueue allowed by ``withinClusterQueue``, and
    workloads of cohort members that borrow a needed (flavor, resource), allowed by
    ``reclaimWithinCohort``: all of them when the request fits the preemptor's nominal quota
    (hierarchical advantage, "InCohortReclamation"); otherwise, with ``borrowWithinCohort``,
    those below the preemptor's priority and at or below ``maxPriorityThreshold`` may go even
    while the preemptor borrows ("InCohortReclaimWhileBorrowing"), the others only if it then
    does not borrow. Order: other ClusterQueues first, lowest priority, most recently
    admitted (QuotaReserved time, whole seconds), UID. Taken one by one until the request
    fits; then every target it turns out not to need is put back, newest pick first.
    Returns [(workload, Preempted reason)], empty when no set of candidates makes room."""
    pre = quotas.preemption[cq]
    within = pre.get("withinClusterQueue", K.PREEMPTION_NEVER)
    reclaim = pre.get("reclaimWithinCohort", K.PREEMPTION_NEVER)
    bwc = pre.get("borrowWithinCohort") or {}
    bwc_forbidden = bwc.get("policy", K.BORROW_WITHIN_COHORT_NEVER) == K.BORROW_WITHIN_COHORT_NEVER
    threshold = None if bwc_forbidden else bwc.get("maxPriorityThreshold")
    priority = wl["spec"].get("priority") or 0

    def uses(h):
        return any(fr in need for fr in h.usage)

    same, hierarchy, by_priority = [], [], []  # (holder, reason, only without borrowing)
    if within != K.PREEMPTION_NEVER:
        same = [(h, K.PREEMPTED_IN_CLUSTER_QUEUE, False) for h in holders.get(cq, ()) if uses(h) and _satisfies(within, wl, h)]
    cohort = quotas.cohort.get(cq)
    if cohort and reclaim != K.PREEMPTION_NEVER:
        advantage = all(quotas.nominal(cq, fr) >= used[(cq, *fr)] + v for fr, v in requests.items())  # QuantitiesFitInQuota
        for member in quotas.members[cohort]:
            if member == cq or quotas.within_nominal(member, need, used):
                continue
            for h in holders.get(member, ()):
                if not uses(h) or not _satisfies(reclaim, wl, h):
                    continue
                if advantage:
                    hierarchy.append((h, K.PREEMPTED_IN_COHORT_RECLAMATION, False))
                elif bwc_forbidden or h.priority >= priority or (threshold is not None and h.priority > threshold):
                    by_priority.append((h, K.PREEMPTED_IN_COHORT_RECLAMATION, True))
                else:
                    by_priority.append((h, K.PREEMPTED_IN_COHORT_RECLAIM_WHILE_BORROWING, False))

    def order(c):  # common/ordering.go CandidatesOrdering (none is already evicted in the double)
        h = c[0]
        reserved = next(
            (x.get("lastTransitionTime") for x in h.wl["status"].get("conditions") or [] if x["type"] == K.QUOTA_RESERVED), None
        )
        return h.cq == cq, h.priority, -_time(reserved), h.wl["metadata"].get("uid", "")

    candidates = sorted(hierarchy, key=order) + sorted(by_priority, key=order) + sorted(same, key=order)
    if not candidates:
        return []
    under_nominal = all(quotas.nominal(cq, fr) > used[(cq, *fr)] for fr in need)
    if not (hierarchy or by_priority) or (bwc_forbidden and not under_nominal):
        attempts = [True]
    elif bwc_forbidden and not hierarchy:
        attempts = [False, True]
    else:
        attempts = [True, False]

    sim = defaultdict(int, used)

    def move(h, sign):
        for fr, amount in h.usage.items():
            sim[(h.cq, *fr)] += sign * amount

    def fits(borrowing):
        for fr, v in requests.items():
            if not borrowing and quotas.nominal(cq, fr) < sim[(cq, *fr)] + v:
                return False
            if v > quotas.available(cq, fr, sim):
                return False
        return True

    for borrowing in attempts:
        targets = []
        for h, reason, only_without_borrowing in candidates:
            if h.cq != cq:
                if borrowing and only_without_borrowing:
                    continue
                if quotas.within_nominal(h.cq, need, sim):  # no longer borrowing after earlier picks
                    continue
            move(h, -1)
            targets.append((h, reason))
            if fits(borrowing):
                for i in range(len(targets) - 2, -1, -1):  # fillBackWorkloads
                    move(targets[i][0], +1)
                    if fits(borrowing):
                        targets[i] = targets[-1]
                        targets.pop()
                    else:
                        move(targets[i][0], -1)
                return targets
        for h, _ in targets:
            move(h, +1)
    return []


def _reserve(cq, requests, used, quotas: _Quotas) -> None:
    """reserveCapacityForUnreclaimablePreempt: a workload that needs preemption but found no
    target keeps what it could use in this pass, so lower ones in the cohort do not take it."""
    borrowing = bool(quotas.cohort.get(cq)) and any(quotas.nominal(cq, fr) < used[(cq, *fr)] + v for fr, v in requests.items())
    for fr, v in requests.items():
        nominal, borrow, _ = quotas.quota.get((cq, *fr), _NO_QUOTA)
        mine = used[(cq, *fr)]
        if borrowing:
            keep = v if borrow is None else min(v, nominal + borrow - mine)
        else:
            keep = min(v, nominal - mine)
        used[(cq, *fr)] += max(0, keep)


def _bytes_like(res) -> bool:
    return res in ("memory", "ephemeral-storage") or res.startswith("hugepages-")


def _amount(res, qty) -> int:
    if res == "cpu":
        try:
            return parse_cpu_millis(qty)
        except ValueError:  # a quantity with a decimal suffix: the renderer's "100k" cores
            return parse_memory_bytes(qty) * 1000
    if _bytes_like(res):
        return parse_memory_bytes(qty)
    return int(str(qty))


def _fmt(res, amount: int) -> str:
    """Kueue's ResourceFormatter (pkg/resources/resource_formatter.go): milli-CPU in
    DecimalSI, memory and ephemeral-storage canonical BinarySI, the rest plain integers."""
    if res == "cpu":
        return str(amount // 1000) if amount % 1000 == 0 else f"{amount}m"
    if _bytes_like(res) and amount:
        for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
            unit = 1024 ** ("KMGTPE".index(suffix[0]) + 1)
            if amount % unit == 0:
                return f"{amount // unit}{suffix}"
    return str(amount)


def _canonical_resources(spec: dict) -> None:
    """What the API server does to a pod's quantities: ``0.5`` CPU is stored as ``"500m"``,
    ``2`` as ``"2"`` (Kueue copies the stored pod into the Workload, whose CRD wants strings)."""
    for container in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        for kind in ("limits", "requests"):
            values = (container.get("resources") or {}).get(kind) or {}
            for res, qty in list(values.items()):
                if res == "cpu":
                    values[res] = _fmt("cpu", parse_cpu_millis(qty))
                elif isinstance(qty, (int, float)):
                    values[res] = str(int(qty)) if float(qty).is_integer() else str(qty)


def _pod_set_requests(wl) -> list[tuple[str, int, dict[str, int]]]:
    """(name, count, per-pod request) of each pod set of ``wl``."""
    return [(ps["name"], int(ps.get("count", 1)), _requests(ps["template"]["spec"])) for ps in wl["spec"]["podSets"]]


def _workload_request(wl) -> tuple[dict, dict[str, int]]:
    """The pod spec whose node selector the flavors must match, and the whole request: one pod
    set as before; for several (a RayCluster), every pod set's count x request summed and their
    node selectors together (the double assigns one flavor per resource for the Workload, where
    Kueue assigns per pod set: the same for gpuhub's RayClusters, whose only GPU pod sets share
    one flavor and whose head asks for no GPU)."""
    pod_sets = wl["spec"]["podSets"]
    if len(pod_sets) == 1:
        spec = pod_sets[0]["template"]["spec"]
        count = int(pod_sets[0].get("count", 1))  # an Indexed Job's N workers: N x the pod's request
        return spec, {res: count * amount for res, amount in _requests(spec).items()}
    total: dict[str, int] = defaultdict(int)
    selector: dict[str, str] = {}
    for ps in pod_sets:
        spec = ps["template"]["spec"]
        selector.update(spec.get("nodeSelector") or {})
        for res, amount in _requests(spec).items():
            total[res] += int(ps.get("count", 1)) * amount
    return {"nodeSelector": selector}, dict(total)


def _failing_pod_set(wl, reasons: list[str]) -> str:
    """The pod set Kueue names in "couldn't assign flavors to pod set X": the first asking for a
    resource its reasons name (a one-pod-set Workload: that one, "main")."""
    pod_sets = _pod_set_requests(wl)
    for name, _, req in pod_sets:
        if any(f" {res} " in f" {r} " or f"for {res}" in r for r in reasons for res in req):
            return name
    return pod_sets[0][0]


def _requests(pod_spec) -> dict[str, int]:
    total = defaultdict(int)
    for c in pod_spec.get("containers", []):
        res = c.get("resources") or {}
        merged = dict(res.get("limits") or {})
        merged.update(res.get("requests") or {})  # requests default to limits
        for name, qty in merged.items():
            total[name] += _amount(name, qty)
    return dict(total)


def _merge(target, patch):
    """JSON merge patch (RFC 7386), which is what KubeSpawner's patches need."""
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, dict) and isinstance(target.get(k), dict):
            _merge(target[k], v)
        else:
            target[k] = v
    return target
