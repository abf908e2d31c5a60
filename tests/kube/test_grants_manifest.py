"""Secrets per profile and team data in the pod (policy ``secrets:``, ``data:``; issue 42).

The real KubeSpawner code path builds the server pod (and the Job built from it), checked with
kubernetes-validate (strict): a granted secret is a reference (a projected Secret volume, or
``secretKeyRef`` for ``env``), a dataset its PVC; no value of a secret is anywhere in the pod or
the Job, and a profile/team without the grant gets none of it. The kubelet's mount itself is not
run here (no kubelet on the double).
"""

from __future__ import annotations

import json

import pytest
from kubernetes_asyncio.client import ApiClient

from double.schemas import validate
from gpuhub_spawner.jobs.spec import parse_job
from gpuhub_spawner.kube.job_manifest import job_manifest
from gpuhub_spawner.policy.access import resolve_choice

pytestmark = pytest.mark.asyncio(loop_scope="function")

GRANTS = """
secrets:
  - name: wandb
    kubernetes: {secret: team-wandb, key: api-key}
    local: {file: /etc/gpuhub/secrets.yaml, key: wandb}
    teams: [vision]
    profiles: [a100-1]
  - name: hf-token
    kubernetes: {secret: hf, key: token}
    teams: [vision]
    env: HF_TOKEN
data:
  - name: imagenet
    teams: [vision]
    kubernetes: {claim: imagenet-ro}
  - name: scratch
    teams: [vision]
    readOnly: false
    kubernetes: {claim: vision-scratch, subPath: shared}
  - name: corpora
    teams: [nlp]
    kubernetes: {claim: nlp-corpora}
"""


@pytest.fixture
def policy_file(policy_file):
    policy_file.write_text(policy_file.read_text() + GRANTS)
    return policy_file


async def server_pod(spawner) -> dict:
    await spawner.load_user_options()
    return ApiClient().sanitize_for_serialization(await spawner.get_pod_manifest())


async def test_a_granted_profile_mounts_its_secrets_and_team_data_by_reference(make_spawner, policy_store):
    spawner = make_spawner(user="alice", groups=("vision-lab",), profile="a100-1")
    pod = await server_pod(spawner)
    validate(pod)
    spec, c = pod["spec"], pod["spec"]["containers"][0]
    volumes = {v["name"]: v for v in spec["volumes"]}
    projected = volumes["gpuhub-secrets"]["projected"]
    assert projected["sources"] == [{"secret": {"name": "team-wandb", "items": [{"key": "api-key", "path": "wandb"}]}}]
    assert projected["defaultMode"] in (0o440, 0o444)
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/run/gpuhub/secrets"]["readOnly"] is True
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    assert env["GPUHUB_SECRETS_DIR"]["value"] == "/run/gpuhub/secrets"
    claims = {v["persistentVolumeClaim"]["claimName"]: v for v in volumes.values() if "persistentVolumeClaim" in v}
    assert set(claims) == {"imagenet-ro", "vision-scratch"}  # not nlp's corpora
    assert claims["imagenet-ro"]["persistentVolumeClaim"]["readOnly"] is True
    assert mounts["/run/gpuhub/data/imagenet"]["readOnly"] is True
    assert mounts["/run/gpuhub/data/scratch"]["readOnly"] is False and mounts["/run/gpuhub/data/scratch"]["subPath"] == "shared"
    assert spawner.granted == {"secrets": ["wandb", "hf-token"], "data": ["imagenet", "scratch"]}

    # The Job of the same profile carries the same references (and nothing else of them).
    choice = resolve_choice(policy_store.policy, ["vision-lab"], {"profile": "a100-1"})
    job = job_manifest(
        "job-0123456789", "alice", parse_job("profile: a100-1\ncommand: [python, t.py]\n"), policy_store.policy, choice, pod
    )
    validate(job)
    jc = job["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e for e in jc["env"]}["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert "gpuhub-secrets" in {v["name"] for v in job["spec"]["template"]["spec"]["volumes"]}
    # No literal value of a secret: every env var that names one is a reference.
    text = json.dumps(job)
    assert '"HF_TOKEN", "value"' not in text


async def test_another_team_or_profile_gets_none_of_them(make_spawner, policy_store):
    # nlp may use a100-1 too, but the secrets and vision's data are vision's.
    pod = await server_pod(make_spawner(user="carol", groups=("nlp-group",), profile="a100-1"))
    validate(pod)
    c = pod["spec"]["containers"][0]
    text = json.dumps(pod)
    assert "team-wandb" not in text and "HF_TOKEN" not in text and "imagenet" not in text and "vision-scratch" not in text
    assert "/run/gpuhub/data/corpora" in {m["mountPath"] for m in c["volumeMounts"]}
    # vision on another profile: hf-token (team-wide) but not wandb (a100-1 only)
    pod = await server_pod(make_spawner(user="bob", groups=("vision-lab",), profile="cpu"))
    validate(pod)
    text = json.dumps(pod)
    assert "HF_TOKEN" in text and "team-wandb" not in text


async def test_a_grant_without_a_cluster_source_refuses_the_start_and_says_where(make_spawner, policy_file, policy_store):
    entry = "secrets:\n  - name: local-only\n    local: {file: /etc/gpuhub/s.yaml, key: k}\n    teams: [students]\n"
    policy_file.write_text(policy_file.read_text().replace("secrets:\n", entry, 1))
    await policy_store.fresh()
    spawner = make_spawner(user="erin", groups=("students",), profile="cpu")
    await spawner.load_user_options()
    with pytest.raises(Exception) as e:
        await spawner.get_pod_manifest()
    assert "no source on this cluster" in str(e.value)
