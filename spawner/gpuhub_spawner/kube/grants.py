"""The policy's secrets and team data in a pod (``secrets:``, ``data:``; docs/secrets-and-data.md).

A granted secret is a reference the kubelet resolves: a projected volume of the named Secrets'
keys at ``/run/gpuhub/secrets/<name>`` (or an env var with ``secretKeyRef`` where the policy
says ``env``). The pod manifest, the Job built from it and everything the hub logs or records
hold names only; the hub never reads a Secret, so its RBAC needs no ``secrets`` right (kubelet
reads them for the pod; rotation reaches every new pod, and mounted files of running ones).
A team dataset is its PersistentVolumeClaim (any CSI driver behind it) at
``/run/gpuhub/data/<name>``, read-only unless the policy says ``readOnly: false``.
"""

from __future__ import annotations

from kubernetes_asyncio.client import (
    V1EnvVar,
    V1EnvVarSource,
    V1KeyToPath,
    V1PersistentVolumeClaimVolumeSource,
    V1ProjectedVolumeSource,
    V1SecretKeySelector,
    V1SecretProjection,
    V1Volume,
    V1VolumeMount,
    V1VolumeProjection,
)

from ..policy.model import DATA_DIR, SECRETS_DIR, Policy

SECRETS_VOLUME = "gpuhub-secrets"


def missing_sources(policy: Policy, team: str, profile: str) -> list[str]:
    """Grants for ``team`` on ``profile`` that name no Kubernetes source (located, for a refusal)."""
    out = [f"secrets[{policy.secrets.index(s)}] ({s.name})" for s in policy.secrets_for(team, profile) if s.kubernetes is None]
    out += [f"data[{policy.data.index(d)}] ({d.name})" for d in policy.data_for(team, profile) if d.kubernetes is None]
    return out


def add_grants(pod, policy: Policy, team: str, profile: str, file_mode: int = 0o440) -> dict[str, list[str]]:
    """Add the grants of ``team`` on ``profile`` to ``pod`` (a V1Pod; its first container);
    returns what was added by name, for the audit trail: ``{"secrets": [...], "data": [...]}``."""
    secrets, data = policy.secrets_for(team, profile), policy.data_for(team, profile)
    if not secrets and not data:
        return {}  # the pod as KubeSpawner made it
    spec, container = pod.spec, pod.spec.containers[0]
    volumes, mounts, env = list(spec.volumes or []), list(container.volume_mounts or []), list(container.env or [])
    projections = []
    for s in secrets:
        if s.kubernetes is None:
            continue
        ref = s.kubernetes
        if s.env:
            env.append(
                V1EnvVar(name=s.env, value_from=V1EnvVarSource(secret_key_ref=V1SecretKeySelector(name=ref.secret, key=ref.key)))
            )
        else:
            projections.append(
                V1VolumeProjection(secret=V1SecretProjection(name=ref.secret, items=[V1KeyToPath(key=ref.key, path=s.name)]))
            )
    if projections:
        volumes.append(
            V1Volume(name=SECRETS_VOLUME, projected=V1ProjectedVolumeSource(default_mode=file_mode, sources=projections))
        )
        mounts.append(V1VolumeMount(name=SECRETS_VOLUME, mount_path=SECRETS_DIR, read_only=True))
        env.append(V1EnvVar(name="GPUHUB_SECRETS_DIR", value=SECRETS_DIR))
    used = []
    for i, d in enumerate(x for x in data if x.kubernetes is not None):
        assert d.kubernetes is not None
        name = f"gpuhub-data-{i}"
        volumes.append(
            V1Volume(
                name=name,
                persistent_volume_claim=V1PersistentVolumeClaimVolumeSource(claim_name=d.kubernetes.claim, read_only=d.read_only),
            )
        )
        mounts.append(
            V1VolumeMount(name=name, mount_path=f"{DATA_DIR}/{d.name}", read_only=d.read_only, sub_path=d.kubernetes.sub_path)
        )
        used.append(d.name)
    if used:
        env.append(V1EnvVar(name="GPUHUB_DATA_DIR", value=DATA_DIR))
    spec.volumes, container.volume_mounts, container.env = volumes, mounts, env
    return {"secrets": [s.name for s in secrets if s.kubernetes is not None], "data": used}
