"""ray.io/v1 RayClusters in the double (issue 24): KubeRay's operator and Kueue's
``ray.io/raycluster`` integration, kept apart from the pod path in ``server.py`` as Jobs are
in ``jobs.py``.

What it models, after KubeRay v1.5.0 and Kueue v0.19.2's ``pkg/controller/jobs/raycluster``:

- ``POST/GET/DELETE/PATCH`` (merge patch) ``/apis/ray.io/v1/namespaces/<ns>/rayclusters[/<name>]``
  (list with a label selector); every RayCluster written is validated against KubeRay's CRD (strict) when its
  module is in the cache (``schemas.kuberay_crds``), and its pod templates with
  kubernetes-validate in any case.
- Kueue's RayCluster webhook (``mraycluster.kb.io`` / ``vraycluster.kb.io``, ``failurePolicy:
  Fail``) for a RayCluster with ``kueue.x-k8s.io/queue-name``: ``spec.suspend: true``; the
  elastic-job annotation adds the ``kueue.x-k8s.io/elastic-job`` scheduling gate to every
  template; refused: autoscaling without that annotation, more than 18 pod sets, a worker
  group named ``head`` (Kueue's words, ``kube.ray_manifest``).
- The Workload (``raycluster-<name>-<5>``, owner the RayCluster) with a ``head`` pod set and
  one per worker group (count: replicas x numOfHosts), admitted by the double's scheduler over
  all its pod sets at once (``server._reconcile``); admission un-suspends the RayCluster and
  puts each flavor's node labels on the templates that use it.
- KubeRay: an un-suspended RayCluster gets its head pod and worker pods (``ray.io/cluster``,
  ``ray.io/node-type``, ``ray.io/group`` labels; ``status.state: ready``); the container's
  ``ray start`` is replaced by ``sleep`` for the double's kubelet. Suspended (preemption):
  its pods are deleted, ``status.state: suspended``, the Workload waits again. Deleted: its
  pods and Workload go with it.
"""

from __future__ import annotations

import copy
import hashlib
import secrets

from aiohttp import web

from gpuhub_spawner.kube import kueue as K
from gpuhub_spawner.kube import ray_manifest as R
from gpuhub_spawner.kube.kueue import API_VERSION, JOB_UID_LABEL, PRIORITY_LABEL, QUEUE_LABEL

from .schemas import InvalidObject, validate

CLUSTER_LABEL = "ray.io/cluster"
NODE_TYPE_LABEL = "ray.io/node-type"
GROUP_LABEL = "ray.io/group"
STAND_IN = ["sleep", "86400"]  # what the double's kubelet runs instead of `ray start`


def owner_ray_name(obj: dict) -> str | None:
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("kind") == R.KIND and ref.get("controller"):
            return ref["name"]
    return None


def _validate_ray(obj: dict) -> None:
    try:
        validate(obj)
    except FileNotFoundError:  # KubeRay's CRD not in the cache: the pod templates still are checked
        from .schemas import validate_core

        for group, tmpl in R.pod_templates(obj):
            validate_core(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {**(tmpl.get("metadata") or {}), "name": f"{obj['metadata']['name']}-{group}"},
                    "spec": tmpl["spec"],
                }
            )


class RayMixin:
    # -- test controls ----------------------------------------------------------------------
    def preempt_ray(self, namespace: str, name: str, preempted_reason: str = K.PREEMPTED_IN_CLUSTER_QUEUE) -> None:
        self.call(self._preempt_ray, namespace, name, preempted_reason)

    def pods_of_ray(self, namespace: str, name: str) -> list[dict]:
        return [p for p in self.list("pods", namespace) if (p["metadata"].get("labels") or {}).get(CLUSTER_LABEL) == name]

    # -- HTTP -----------------------------------------------------------------------------------
    async def _ray_route(self, request, rest: list[str]):
        from .server import _match_labels, _status

        if len(rest) < 3 or rest[0] != "namespaces" or rest[2] != R.PLURAL:
            return _status(404, "NotFound", f"the server could not find the requested resource ({request.path})")
        ns, name = rest[1], (rest[3] if len(rest) > 3 else None)
        self.calls[(request.method, R.PLURAL)] += 1
        if request.method == "GET" and name is None:
            sel = request.query.get("labelSelector", "")
            items = [
                copy.deepcopy(o) for (p, n, _), o in self.objects.items() if p == R.PLURAL and n == ns and _match_labels(o, sel)
            ]
            return web.json_response(
                {
                    "apiVersion": R.API_VERSION,
                    "kind": "RayClusterList",
                    "metadata": {"resourceVersion": str(self.last_rv)},
                    "items": items,
                }
            )
        if request.method == "GET":
            obj = self.objects.get((R.PLURAL, ns, name))
            return web.json_response(obj) if obj else _status(404, "NotFound", f'rayclusters.ray.io "{name}" not found')
        if request.method == "POST" and name is None:
            return self._create_ray(ns, await request.json())
        if request.method == "DELETE" and name is not None:
            obj = self.objects.get((R.PLURAL, ns, name))
            if obj is None:
                return _status(404, "NotFound", f'rayclusters.ray.io "{name}" not found')
            self._delete_ray(ns, name)
            return web.json_response(obj)
        if request.method == "PATCH" and name is not None:
            from .server import _merge

            obj = self.objects.get((R.PLURAL, ns, name))
            if obj is None:
                return _status(404, "NotFound", f'rayclusters.ray.io "{name}" not found')
            if (request.headers.get("Content-Type") or "").split(";")[0].strip() != "application/merge-patch+json":
                return _status(
                    415,
                    "UnsupportedMediaType",
                    "the body of the request was in an unknown format - accepted "
                    "media types include: application/json-patch+json, application/merge-patch+json, "
                    "application/apply-patch+yaml",
                )
            merged = _merge(copy.deepcopy(obj), await request.json())
            _validate_ray(merged)
            return web.json_response(self._write(R.PLURAL, ns, merged, "MODIFIED"))
        return _status(405, "MethodNotAllowed", "method not allowed")

    # -- the API server and Kueue's RayCluster webhook + reconciler ---------------------------
    def _create_ray(self, ns: str, rc: dict):
        from .server import _status

        rc.setdefault("apiVersion", R.API_VERSION)
        rc.setdefault("kind", R.KIND)
        rc["metadata"]["namespace"] = ns
        _validate_ray(rc)  # what the client sent
        name = rc["metadata"]["name"]
        labels = rc["metadata"].get("labels") or {}
        managed = QUEUE_LABEL in labels and self._webhook_applies(ns)
        if managed and not self.kueue_up:
            return _status(
                500,
                "InternalError",
                (
                    f'Internal error occurred: failed calling webhook "{R.MUTATING_WEBHOOK}": failed to call webhook: '
                    f'Post "https://{K.WEBHOOK_SERVICE}.{K.WEBHOOK_NAMESPACE}.svc:443/mutate-ray-io-v1-raycluster?timeout=10s": '
                    f'no endpoints available for service "{K.WEBHOOK_SERVICE}"'
                ),
            )
        if managed:
            denied = R.kueue_refusal(rc)
            if denied:
                return _status(403, "Forbidden", f'admission webhook "{R.VALIDATING_WEBHOOK}" denied the request: {denied}')
            rc["spec"]["suspend"] = True  # Kueue's webhook (ApplyDefaultForSuspend)
            if (rc["metadata"].get("annotations") or {}).get(R.ELASTIC_ANNOTATION) == "true":
                for _, tmpl in R.pod_templates(rc):
                    gates = tmpl["spec"].setdefault("schedulingGates", [])
                    if {"name": R.ELASTIC_GATE} not in gates:
                        gates.append({"name": R.ELASTIC_GATE})
        if (R.PLURAL, ns, name) in self.objects:
            return _status(409, "AlreadyExists", f'rayclusters.ray.io "{name}" already exists')
        rc["status"] = {}
        _validate_ray(rc)
        self._write(R.PLURAL, ns, rc, "ADDED")
        if managed:
            self._create_ray_workload(rc)
        elif not rc["spec"].get("suspend"):
            self._start_ray_pods(ns, name)
        return web.json_response(rc, status=201)

    def _create_ray_workload(self, rc: dict) -> None:
        meta = rc["metadata"]
        digest = hashlib.sha256(meta["uid"].encode()).hexdigest()[:5]
        pclass = meta["labels"].get(PRIORITY_LABEL)
        wpc = self.objects.get(("workloadpriorityclasses", None, pclass)) if pclass else None
        wl = R.workload_for(rc, wpc["value"] if wpc else 0)
        wl["metadata"].update(
            {
                "name": f"raycluster-{meta['name']}-{digest}",
                "labels": {JOB_UID_LABEL: meta["uid"]},
                "ownerReferences": [
                    {
                        "apiVersion": R.API_VERSION,
                        "kind": R.KIND,
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            }
        )
        wl["apiVersion"] = API_VERSION
        wl["spec"]["active"] = True
        if not wpc:
            wl["spec"].pop("priorityClassRef", None)
            wl["spec"]["priority"] = 0
        validate(wl)
        self._write("workloads", meta["namespace"], wl, "ADDED")

    def _ray_admitted(self, wl: dict, assignments: dict[str, dict]) -> bool:
        """Kueue started the RayCluster: un-suspended, each pod set's flavors' node labels on
        its template (RunWithPodSetsInfo); KubeRay then makes the pods. False when ``wl`` is
        not a RayCluster's."""
        name = owner_ray_name(wl)
        ns = wl["metadata"]["namespace"]
        rc = copy.deepcopy(self.objects.get((R.PLURAL, ns, name))) if name else None
        if rc is None:
            return False
        rc["spec"]["suspend"] = False
        for podset, tmpl in R.pod_templates(rc):
            for flavor_name in sorted(set((assignments.get(podset) or {}).values())):
                flavor = self.objects.get(("resourceflavors", None, flavor_name)) or {}
                labels = flavor.get("spec", {}).get("nodeLabels") or {}
                if labels:
                    tmpl["spec"].setdefault("nodeSelector", {}).update(labels)
        _validate_ray(rc)
        self._write(R.PLURAL, ns, rc, "MODIFIED")
        self._start_ray_pods(ns, name)
        return True

    # -- KubeRay's operator -----------------------------------------------------------------------
    def _start_ray_pods(self, ns: str, name: str) -> None:
        rc = self.objects[(R.PLURAL, ns, name)]
        counts = R.pod_set_counts(rc)
        for podset, tmpl in R.pod_templates(rc):
            kind = "head" if podset == R.HEAD_POD_SET else "worker"
            for _i in range(counts[podset]):
                tmpl_c = copy.deepcopy(tmpl)
                labels = dict((tmpl_c.get("metadata") or {}).get("labels") or {})
                labels.update(
                    {CLUSTER_LABEL: name, NODE_TYPE_LABEL: kind, GROUP_LABEL: "headgroup" if kind == "head" else podset}
                )
                spec = tmpl_c["spec"]
                spec.pop("schedulingGates", None)  # the elastic gate: Kueue lifts it on admission
                spec["containers"][0]["command"] = list(STAND_IN)
                suffix = "head" if kind == "head" else f"{podset}-worker"
                pod = {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        "name": f"{name}-{suffix}-{secrets.token_hex(3)[:5]}",
                        "namespace": ns,
                        "labels": labels,
                        "annotations": dict((tmpl_c.get("metadata") or {}).get("annotations") or {}),
                        "ownerReferences": [
                            {
                                "apiVersion": R.API_VERSION,
                                "kind": R.KIND,
                                "name": name,
                                "uid": rc["metadata"]["uid"],
                                "controller": True,
                                "blockOwnerDeletion": True,
                            }
                        ],
                    },
                    "spec": spec,
                }
                self._create_pod(ns, pod)
        rc = copy.deepcopy(self.objects[(R.PLURAL, ns, name)])
        workers = sum(n for p, n in counts.items() if p != R.HEAD_POD_SET)
        rc["status"] = {
            "state": "ready",
            "desiredWorkerReplicas": workers,
            "availableWorkerReplicas": workers,
            "readyWorkerReplicas": workers,
        }
        self._write(R.PLURAL, ns, rc, "MODIFIED")

    def _ray_workloads(self, ns: str, name: str) -> list[dict]:
        return [w for (p, n, _), w in self.objects.items() if p == "workloads" and n == ns and owner_ray_name(w) == name]

    def _preempt_ray(
        self, ns: str, name: str, preempted_reason: str = K.PREEMPTED_IN_CLUSTER_QUEUE, message: str | None = None
    ) -> None:
        """Kueue evicts the Workload (requeued) and its RayCluster integration suspends the
        RayCluster; KubeRay deletes the pods of a suspended cluster."""
        from .server import _evicted_by_preemption

        for wl in self._ray_workloads(ns, name):
            wl = copy.deepcopy(wl)
            _evicted_by_preemption(
                wl, preempted_reason, message or self._default_preemption_message(wl, preempted_reason), requeued=True
            )
            validate(wl)
            self._write("workloads", ns, wl, "MODIFIED")
        rc = copy.deepcopy(self.objects[(R.PLURAL, ns, name)])
        rc["spec"]["suspend"] = True
        rc["status"] = {"state": "suspended"}
        _validate_ray(rc)
        self._write(R.PLURAL, ns, rc, "MODIFIED")
        for pod in self.pods_of_ray_now(ns, name):
            self._remove_pod(ns, pod["metadata"]["name"])

    def pods_of_ray_now(self, ns: str, name: str) -> list[dict]:
        return [
            o
            for (p, n, _), o in list(self.objects.items())
            if p == "pods" and n == ns and (o["metadata"].get("labels") or {}).get(CLUSTER_LABEL) == name
        ]

    def _delete_ray(self, ns: str, name: str) -> None:
        for pod in self.pods_of_ray_now(ns, name):
            self._remove_pod(ns, pod["metadata"]["name"])
        for wl in self._ray_workloads(ns, name):
            self._write("workloads", ns, wl, "DELETED")
        self._write(R.PLURAL, ns, self.objects[(R.PLURAL, ns, name)], "DELETED")


__all__ = ["RayMixin", "owner_ray_name", "InvalidObject"]
