"""batch/v1 Jobs in the double: the Job controller and Kueue's job integration (added for
gpuhub's batch jobs, kept apart from the pod path in ``server.py``).

What it models, after Kubernetes' Job controller and Kueue v0.19's ``jobframework``:

- ``POST/GET/DELETE /apis/batch/v1/namespaces/<ns>/jobs[/<name>]``; every Job written
  is validated with kubernetes-validate (strict), as the API server would reject it.
- Kueue's job webhook: a Job with ``kueue.x-k8s.io/queue-name`` is made ``suspend: true``;
  the job reconciler creates its Workload (owner: the Job; pod set ``main`` from the
  template; priority from the WorkloadPriorityClass; ``maximumExecutionTimeSeconds`` from
  ``kueue.x-k8s.io/max-exec-time-seconds``), validated against the Kueue CRD.
- Admission (``server._admit``) un-suspends the Job and injects the flavors' node labels;
  the Job controller then creates a pod (``<job>-<5 chars>``, no queue label, run by the
  double's kubelet).
- Preemption (``preempt_job``, or the double's scheduler applying the ClusterQueue's
  ``spec.preemption``): the Workload gets ``Evicted``/``Preempted``/``Requeued``, the Job is
  suspended again and its pods are deleted — not counted as failures; the Workload waits
  for quota again.
- A finished pod: success completes the Job (``SuccessCriteriaMet``, ``Complete``; the
  Workload ``Finished``); a failure goes through ``podFailurePolicy`` (``Ignore`` /
  ``Count`` / ``FailJob``, first matching rule) and ``backoffLimit``; a counted failure
  below the limit gets a new pod.
- An Indexed Job (``completionMode: Indexed``, a several-worker job): ``parallelism`` pods at
  admission, each with its completion index (annotation and label
  ``batch.kubernetes.io/job-completion-index``, name ``<job>-<index>-<5 chars>``, hostname
  ``<job>-<index>``); complete when ``completions`` pods succeeded; a ``FailJob`` failure stops
  the other pods; a retried failure restarts that index only.
"""

from __future__ import annotations

import copy
import hashlib
import secrets

from aiohttp import web

from gpuhub_spawner.kube import kueue as K
from gpuhub_spawner.kube.kueue import API_VERSION, JOB_UID_LABEL, PRIORITY_LABEL, QUEUE_LABEL

from .schemas import validate

JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # an Indexed Job's pods: annotation and label
MAX_EXEC_LABEL = "kueue.x-k8s.io/max-exec-time-seconds"
ACCOUNTED = "double.test/accounted"  # the Job controller counted this pod's end


def owner_job_name(obj: dict) -> str | None:
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("kind") == "Job" and ref.get("controller"):
            return ref["name"]
    return None


class JobsMixin:
    # -- test controls ----------------------------------------------------------------------
    def preempt_job(self, namespace: str, name: str, preempted_reason: str = K.PREEMPTED_IN_CLUSTER_QUEUE) -> None:
        """What Kueue does to a preempted Job: Workload evicted, Job suspended, pods deleted."""
        self.call(self._preempt_job, namespace, name, preempted_reason)

    def pods_of_job(self, namespace: str, name: str) -> list[dict]:
        return [p for p in self.list("pods", namespace) if owner_job_name(p) == name]

    # -- HTTP: a pod's log (what the container wrote), /apis/batch/v1/... -----------------------
    def _pod_log(self, ns: str, name: str, query=None):
        """The kubelet's answer: ``tailLines`` (the last N lines), then ``limitBytes`` (the
        first N bytes of what is left), as the API server documents them."""
        from .server import _status

        self.calls[("GET", "log")] += 1
        if ("pods", ns, name) not in self.objects:
            return _status(404, "NotFound", f'pods "{name}" not found')
        path = self.workdir / f"{ns}-{name}" / "container.log"
        data = path.read_bytes() if path.exists() else b""
        query = query or {}
        if query.get("tailLines"):
            data = b"".join(data.splitlines(keepends=True)[-int(query["tailLines"]) :])
        if query.get("limitBytes"):
            data = data[: int(query["limitBytes"])]
        return web.Response(text=data.decode(errors="replace"), content_type="text/plain")

    # -- HTTP: /apis/batch/v1/... --------------------------------------------------------------
    async def _jobs_route(self, request, rest: list[str]):
        if len(rest) < 2 or rest[0] != "namespaces" or len(rest) < 3 or rest[2] != "jobs":
            from .server import _status

            return _status(404, "NotFound", f"the server could not find the requested resource ({request.path})")
        ns, name = rest[1], (rest[3] if len(rest) > 3 else None)
        from .server import _status

        self.calls[(request.method, "jobs")] += 1
        if request.method == "GET" and name is None:
            items = [copy.deepcopy(o) for (p, n, _), o in self.objects.items() if p == "jobs" and n == ns]
            return web.json_response(
                {"apiVersion": "batch/v1", "kind": "JobList", "metadata": {"resourceVersion": str(self.last_rv)}, "items": items}
            )
        if request.method == "GET":
            obj = self.objects.get(("jobs", ns, name))
            return web.json_response(obj) if obj else _status(404, "NotFound", f'jobs.batch "{name}" not found')
        if request.method == "POST" and name is None:
            return self._create_job(ns, await request.json())
        if request.method == "DELETE" and name is not None:
            obj = self.objects.get(("jobs", ns, name))
            if obj is None:
                return _status(404, "NotFound", f'jobs.batch "{name}" not found')
            self._delete_job(ns, name)
            return web.json_response(obj)
        return _status(405, "MethodNotAllowed", "method not allowed")

    # -- the API server and Kueue's job webhook + reconciler ------------------------------------
    def _create_job(self, ns: str, job: dict):
        from .server import _status

        job.setdefault("apiVersion", "batch/v1")
        job.setdefault("kind", "Job")
        job["metadata"]["namespace"] = ns
        validate(job)  # what the client sent
        name = job["metadata"]["name"]
        if ("jobs", ns, name) in self.objects:
            return _status(409, "AlreadyExists", f'jobs.batch "{name}" already exists')
        labels = job["metadata"].get("labels") or {}
        managed = QUEUE_LABEL in labels and self._webhook_applies(ns)
        if managed:
            job["spec"]["suspend"] = True  # Kueue's job webhook (Default)
        job["status"] = {}
        validate(job)
        self._write("jobs", ns, job, "ADDED")
        if managed:
            self._create_job_workload(job)
        elif not job["spec"].get("suspend"):
            self._start_job_pod(ns, name)
        return web.json_response(job, status=201)

    def _create_job_workload(self, job: dict) -> None:
        meta = job["metadata"]
        digest = hashlib.sha256(meta["uid"].encode()).hexdigest()[:5]
        pclass = meta["labels"].get(PRIORITY_LABEL)
        wpc = self.objects.get(("workloadpriorityclasses", None, pclass)) if pclass else None
        tmpl = job["spec"]["template"]
        wl = {
            "apiVersion": API_VERSION,
            "kind": "Workload",
            "metadata": {
                "name": f"job-{meta['name']}-{digest}",
                "namespace": meta["namespace"],
                "labels": {JOB_UID_LABEL: meta["uid"]},
                "ownerReferences": [
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
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
                        "count": job["spec"].get("parallelism", 1),
                        "template": {
                            "metadata": {"labels": dict((tmpl.get("metadata") or {}).get("labels") or {})},
                            "spec": copy.deepcopy(tmpl["spec"]),
                        },
                    }
                ],
                "priority": wpc["value"] if wpc else 0,
                "active": True,
            },
        }
        if wpc:
            wl["spec"]["priorityClassRef"] = {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": pclass}
        if MAX_EXEC_LABEL in meta["labels"]:
            wl["spec"]["maximumExecutionTimeSeconds"] = int(meta["labels"][MAX_EXEC_LABEL])
        validate(wl)
        self._write("workloads", meta["namespace"], wl, "ADDED")

    def _job_admitted(self, wl: dict, assignment: dict) -> None:
        """Kueue started the Job: un-suspend it with the flavors' node labels; its pod follows."""
        name = owner_job_name(wl)
        ns = wl["metadata"]["namespace"]
        job = copy.deepcopy(self.objects.get(("jobs", ns, name))) if name else None
        if job is None:
            return
        job["spec"]["suspend"] = False
        for flavor_name in sorted(set(assignment.values())):
            flavor = self.objects.get(("resourceflavors", None, flavor_name)) or {}
            job["spec"]["template"]["spec"].setdefault("nodeSelector", {}).update(flavor.get("spec", {}).get("nodeLabels") or {})
        job["status"].setdefault("startTime", _now())
        _set_job_condition(job, "Suspended", "False", "JobResumed", "Job resumed")
        validate(job)
        self._write("jobs", ns, job, "MODIFIED")
        if _indexed(job):
            for index in range(int(job["spec"].get("parallelism", 1))):
                self._start_job_pod(ns, name, index)
        else:
            self._start_job_pod(ns, name)

    # -- the Job controller ---------------------------------------------------------------------
    def _start_job_pod(self, ns: str, name: str, index: int | None = None) -> None:
        """A pod of the Job; of an Indexed Job, the pod of completion ``index``: named
        ``<job>-<index>-<5 chars>``, hostname ``<job>-<index>``, the index as annotation and
        label (the Job controller's own names)."""
        job = self.objects[("jobs", ns, name)]
        tmpl = copy.deepcopy(job["spec"]["template"])
        labels = dict((tmpl.get("metadata") or {}).get("labels") or {})
        labels.update({JOB_NAME_LABEL: name, "batch.kubernetes.io/controller-uid": job["metadata"]["uid"]})
        annotations = dict((tmpl.get("metadata") or {}).get("annotations") or {})
        if index is not None:
            labels[COMPLETION_INDEX] = annotations[COMPLETION_INDEX] = str(index)
            tmpl["spec"]["hostname"] = f"{name}-{index}"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{name}-{index}-{secrets.token_hex(3)[:5]}"
                if index is not None
                else f"{name}-{secrets.token_hex(3)[:5]}",
                "namespace": ns,
                "labels": labels,
                "annotations": annotations,
                "ownerReferences": [
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "name": name,
                        "uid": job["metadata"]["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": tmpl["spec"],
        }
        self._create_pod(ns, pod)
        job = copy.deepcopy(self.objects[("jobs", ns, name)])
        job["status"]["active"] = len(self._active_pods(ns, name))
        self._write("jobs", ns, job, "MODIFIED")

    def _active_pods(self, ns: str, name: str) -> list[dict]:
        return [
            o
            for (p, n, _), o in self.objects.items()
            if p == "pods"
            and n == ns
            and owner_job_name(o) == name
            and (o.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        ]

    def _jobs_tick(self) -> None:
        for (p, ns, pname), pod in list(self.objects.items()):
            if p != "pods" or pod["metadata"].get("annotations", {}).get(ACCOUNTED):
                continue
            phase = (pod.get("status") or {}).get("phase")
            name = owner_job_name(pod)
            if name is None or phase not in ("Succeeded", "Failed"):
                continue
            pod = copy.deepcopy(pod)
            pod["metadata"].setdefault("annotations", {})[ACCOUNTED] = "true"
            self._write("pods", ns, pod, "MODIFIED")
            job = self.objects.get(("jobs", ns, name))
            if job is None or _job_finished(job):
                continue
            job = copy.deepcopy(job)
            job["status"]["active"] = len(self._active_pods(ns, name))
            state = pod["status"]["containerStatuses"][0]["state"].get("terminated") or {}
            code = state.get("exitCode", 1)
            index = pod["metadata"].get("annotations", {}).get(COMPLETION_INDEX) if _indexed(job) else None
            if phase == "Succeeded":
                job["status"]["succeeded"] = job["status"].get("succeeded", 0) + 1
                if job["status"]["succeeded"] < int(job["spec"].get("completions", 1)):
                    self._write("jobs", ns, job, "MODIFIED")  # an Indexed Job: the other indexes still run
                    continue
                job["status"]["completionTime"] = _now()
                _set_job_condition(
                    job, "SuccessCriteriaMet", "True", "CompletionsReached", "Reached expected number of succeeded pods"
                )
                _set_job_condition(job, "Complete", "True", "CompletionsReached", "Reached expected number of succeeded pods")
                self._finish_job(job, "Succeeded", "Job finished successfully")
                continue
            action = _failure_action(job, pod, code)
            restart = int(index) if index is not None else None
            if action == "Ignore":
                self._write("jobs", ns, job, "MODIFIED")
                self._start_job_pod(ns, name, restart)
                continue
            job["status"]["failed"] = job["status"].get("failed", 0) + 1
            if action == "FailJob":
                msg = f"Container {pod['spec']['containers'][0]['name']} for pod {ns}/{pname} failed with exit code {code} matching FailJob rule"
                _set_job_condition(job, "FailureTarget", "True", "PodFailurePolicy", msg)
                _set_job_condition(job, "Failed", "True", "PodFailurePolicy", msg)
                self._finish_job(job, "Failed", msg)
                for other in self._active_pods(ns, name):  # the Job controller stops the rest
                    self._remove_pod(ns, other["metadata"]["name"])
            elif job["status"]["failed"] > job["spec"].get("backoffLimit", 6):
                msg = "Job has reached the specified backoff limit"
                _set_job_condition(job, "FailureTarget", "True", "BackoffLimitExceeded", msg)
                _set_job_condition(job, "Failed", "True", "BackoffLimitExceeded", msg)
                self._finish_job(job, "Failed", msg)
            else:
                self._write("jobs", ns, job, "MODIFIED")
                self._start_job_pod(ns, name, restart)

    def _finish_job(self, job: dict, reason: str, message: str) -> None:
        ns = job["metadata"]["namespace"]
        validate(job)
        self._write("jobs", ns, job, "MODIFIED")
        from .server import _set_condition

        for wl in self._job_workloads(ns, job["metadata"]["name"]):
            wl = copy.deepcopy(wl)
            _set_condition(wl, "Finished", "True", reason, message)
            validate(wl)
            self._write("workloads", ns, wl, "MODIFIED")

    def _job_workloads(self, ns: str, name: str) -> list[dict]:
        return [w for (p, n, _), w in self.objects.items() if p == "workloads" and n == ns and owner_job_name(w) == name]

    def _preempt_job(
        self, ns: str, name: str, preempted_reason: str = K.PREEMPTED_IN_CLUSTER_QUEUE, message: str | None = None
    ) -> None:
        """Kueue evicts the Job's Workload (requeued: a Job's Workload waits for quota again) and
        the job integration stops the Job: suspended, its pods deleted."""
        from .server import _evicted_by_preemption

        for wl in self._job_workloads(ns, name):
            wl = copy.deepcopy(wl)
            _evicted_by_preemption(
                wl, preempted_reason, message or self._default_preemption_message(wl, preempted_reason), requeued=True
            )
            validate(wl)
            self._write("workloads", ns, wl, "MODIFIED")
        self._suspend_job(ns, name)

    def _suspend_job(self, ns: str, name: str) -> None:
        """The job integration stops an evicted Job: suspended, its pods deleted (not failures)."""
        job = copy.deepcopy(self.objects.get(("jobs", ns, name)))
        job["spec"]["suspend"] = True
        job["status"]["active"] = 0
        _set_job_condition(job, "Suspended", "True", "JobSuspended", "Job suspended")
        validate(job)
        self._write("jobs", ns, job, "MODIFIED")
        for pod in [o for (p, n, _), o in list(self.objects.items()) if p == "pods" and n == ns and owner_job_name(o) == name]:
            # Deleted because the Job was suspended: the Job controller does not count these.
            pod = copy.deepcopy(pod)
            pod["metadata"].setdefault("annotations", {})[ACCOUNTED] = "suspended"
            self._write("pods", ns, pod, "MODIFIED")
            self._remove_pod(ns, pod["metadata"]["name"])

    def _delete_job(self, ns: str, name: str) -> None:
        for pod in [o for (p, n, _), o in list(self.objects.items()) if p == "pods" and n == ns and owner_job_name(o) == name]:
            self._remove_pod(ns, pod["metadata"]["name"])
        for wl in self._job_workloads(ns, name):
            self._write("workloads", ns, wl, "DELETED")
        self._write("jobs", ns, self.objects[("jobs", ns, name)], "DELETED")


def _now() -> str:
    from .server import now_iso

    return now_iso()


def _indexed(job: dict) -> bool:
    return job["spec"].get("completionMode") == "Indexed"


def _job_finished(job: dict) -> bool:
    return any(c["type"] in ("Complete", "Failed") and c["status"] == "True" for c in job["status"].get("conditions") or [])


def _set_job_condition(job: dict, ctype: str, status: str, reason: str, message: str) -> None:
    ts = _now()
    conds = job["status"].setdefault("conditions", [])
    for c in conds:
        if c["type"] == ctype:
            c.update(status=status, reason=reason, message=message, lastProbeTime=ts, lastTransitionTime=ts)
            return
    conds.append(
        {"type": ctype, "status": status, "reason": reason, "message": message, "lastProbeTime": ts, "lastTransitionTime": ts}
    )


def _failure_action(job: dict, pod: dict, code: int) -> str:
    """The first matching podFailurePolicy rule's action; Count when none matches."""
    conditions = {(c["type"], c["status"]) for c in (pod.get("status") or {}).get("conditions") or []}
    for rule in (job["spec"].get("podFailurePolicy") or {}).get("rules") or []:
        if "onExitCodes" in rule:
            req = rule["onExitCodes"]
            hit = code in req["values"]
            if (req["operator"] == "In") == hit:
                return rule["action"]
        for pc in rule.get("onPodConditions") or []:
            if (pc["type"], pc.get("status", "True")) in conditions:
                return rule["action"]
    return "Count"
