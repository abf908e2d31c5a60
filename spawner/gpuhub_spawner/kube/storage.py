"""Where a job's and a Ray cluster's files live on a multi-node cluster (issue 40 item 3).

A server pod mounts the user's home claim (z2jh's ``singleuser.storage``). A job's pods and a
Ray cluster's pods are built from that server pod, and may land on other nodes than the
server, at the same time as it. Which volume they get is the operator's choice,
``KueueSpawner.work_volume`` (``hub.config`` in helm-values/values.yaml):

* ``home`` (the default): the user's home claim, in the server, every job attempt and every
  Ray pod; a job's checkpoints are under the home (``.gpuhub/checkpoints/<job>``). This
  needs the home claims to be **ReadWriteMany** (``singleuser.storage.storageAccessModes:
  [ReadWriteMany]`` and a StorageClass that provides it: NFS, CephFS, Azure Files, EFS,
  Filestore...): a ReadWriteOnce volume is attached to one node at a time, so a job or Ray
  worker on another node than the server would wait in ``ContainerCreating`` (Multi-Attach
  error) for as long as the server runs.
* ``own``: each job and each Ray cluster gets a **ReadWriteOnce claim of its own**,
  ``<id>-work`` (``work_volume_size``, ``work_volume_storage_class``), owned by the Job or
  RayCluster (the garbage collector deletes it with its owner). A job's pod mounts it where
  the home was (so ``GPUHUB_CHECKPOINT_DIR`` is on it): every attempt, on whatever node it
  lands after a preemption, finds the previous attempt's checkpoint, since only one attempt
  runs at a time. A Ray cluster's head mounts it the same way; its workers get an
  ``emptyDir`` (a ReadWriteOnce claim cannot be on several nodes at once): Ray's own
  checkpoints go to the head or to object storage (``RunConfig(storage_path=...)``). The
  user's home is **not** mounted in a job or Ray pod: the code comes with the image or is
  fetched by the command (``git clone``, object storage), results go to MLflow or the claim.
"""

from __future__ import annotations

import copy

HOME = "home"
OWN = "own"
MODES = (HOME, OWN)
WORK_VOLUME = "gpuhub-work"
WORK_LABEL = "gpuhub/work-volume-of"


def claim_name(owner_name: str) -> str:
    return f"{owner_name}-work"


def home_path(container: dict) -> str:
    return next((e.get("value") for e in container.get("env", []) if e.get("name") == "HOME"), None) or "/home/jovyan"


def use_work_volume(pod_spec: dict, claim: str | None) -> dict:
    """``pod_spec`` (a job's or Ray pod's, built from the server pod) with the server's claims
    replaced by ``claim`` mounted at the home path (``None``: an ``emptyDir`` there, for Ray
    workers). Changed in place and returned."""
    claims = {v["name"] for v in pod_spec.get("volumes") or [] if v.get("persistentVolumeClaim")}
    main = pod_spec["containers"][0]
    # where the home claim was mounted (z2jh's singleuser.storage.homeMountPath), else $HOME
    path = next((m["mountPath"] for m in main.get("volumeMounts") or [] if m["name"] in claims), None) or home_path(main)
    pod_spec["volumes"] = [v for v in pod_spec.get("volumes") or [] if v["name"] not in claims]
    source = {"persistentVolumeClaim": {"claimName": claim}} if claim else {"emptyDir": {}}
    pod_spec["volumes"].append({"name": WORK_VOLUME, **source})
    for c in pod_spec.get("initContainers", []) + pod_spec["containers"]:
        mounts = [m for m in c.get("volumeMounts") or [] if m["name"] not in claims]
        c["volumeMounts"] = mounts + [{"name": WORK_VOLUME, "mountPath": path}]
    return pod_spec


def work_claim(owner: dict, namespace: str, size: str, storage_class: str | None, labels: dict[str, str]) -> dict:
    """The ReadWriteOnce claim of a Job or RayCluster (``owner``: its API object as created,
    with ``metadata.uid``), deleted with it by the garbage collector."""
    meta = owner["metadata"]
    spec = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}
    if storage_class:
        spec["storageClassName"] = storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": claim_name(meta["name"]),
            "namespace": namespace,
            "labels": {**copy.deepcopy(labels), WORK_LABEL: meta["name"]},
            "ownerReferences": [
                {
                    "apiVersion": owner["apiVersion"],
                    "kind": owner["kind"],
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "blockOwnerDeletion": False,
                }
            ],
        },
        "spec": spec,
    }


async def create_claim(api_client, claim: dict) -> None:
    from kubernetes_asyncio.client import CoreV1Api  # lazy: heavy optional dependency

    # kubernetes_asyncio types the body as V1PersistentVolumeClaim; it serializes a manifest dict
    # the same way (sanitize_for_serialization), as for every object gpuhub creates.
    await CoreV1Api(api_client).create_namespaced_persistent_volume_claim(
        claim["metadata"]["namespace"],
        claim,  # type: ignore[arg-type]
    )
