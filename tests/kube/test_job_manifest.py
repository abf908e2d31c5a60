"""Batch jobs on Kubernetes: the suspended Job gpuhub hands to Kueue's job integration.

Built from the user's server pod exactly as KueueSpawner makes it (the real KubeSpawner
code path), then checked against the real contract: kubernetes-validate (strict) for the
Job, the Kueue v0.19.2 Workload CRD for the Workload Kueue derives from it. Kueue's job
controller itself (admission un-suspends, preemption suspends) did not run here.
"""

from __future__ import annotations

import pytest
from kubernetes_asyncio.client import ApiClient

from double.schemas import validate
from gpuhub_spawner.jobs.kube import job_manifest, workload_for
from gpuhub_spawner.jobs.spec import parse_job
from gpuhub_spawner.kube.kueue import PRIORITY_LABEL, QUEUE_LABEL
from gpuhub_spawner.policy.access import resolve_choice

pytestmark = pytest.mark.asyncio(loop_scope="function")

JOB = """\
name: mnist
profile: a100-1
command: [python, train.py, --epochs, 10]
workingDir: projects/mnist
env: {EPOCHS: 10}
retries: {limit: 3, reasons: [preempted, 75]}
experiment: mnist
timeLimit: 2h
"""


async def server_pod(spawner) -> dict:
    await spawner.load_user_options()
    return ApiClient().sanitize_for_serialization(await spawner.get_pod_manifest())


async def test_job_is_the_users_server_pod_with_the_jobs_command_suspended_in_the_teams_queue(make_spawner, policy_store):
    spawner = make_spawner(user="alice", groups=("vision-lab",), profile="a100-1")
    pod = await server_pod(spawner)
    policy = policy_store.policy
    spec = parse_job(JOB)
    choice = resolve_choice(policy, ["vision-lab"], {"profile": "a100-1"})
    job = job_manifest("job-0123456789", "alice", spec, policy, choice, pod, job_priority_class="batch", namespace=spawner.namespace)
    validate(job)  # kubernetes-validate, strict: unknown fields are errors
    meta, js = job["metadata"], job["spec"]
    assert meta["namespace"] == "gpuhub-users" and js["suspend"] is True and meta["labels"][QUEUE_LABEL] == choice.team.local_queue
    assert meta["labels"][PRIORITY_LABEL] == "batch"
    tmpl = js["template"]
    # Kueue manages the Job; its pods must not join the plain-pod integration too.
    assert QUEUE_LABEL not in tmpl["metadata"]["labels"] and PRIORITY_LABEL not in tmpl["metadata"]["labels"]
    c, sc = tmpl["spec"]["containers"][0], pod["spec"]["containers"][0]
    assert c["command"] == ["python", "train.py", "--epochs", "10"] and "args" not in c and "ports" not in c
    assert c["image"] == sc["image"] and c["resources"] == sc["resources"]  # same GPU request and limits
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert tmpl["spec"].get("nodeSelector") == pod["spec"].get("nodeSelector")
    assert tmpl["spec"].get("volumes") == pod["spec"].get("volumes") and c.get("volumeMounts") == sc.get("volumeMounts")
    assert tmpl["spec"]["restartPolicy"] == "Never"
    env = {e["name"]: e for e in c["env"]}
    assert "JUPYTERHUB_API_TOKEN" not in env and "JUPYTERHUB_CLIENT_ID" not in env  # no server credential
    assert env["GPUHUB_TEAM"]["value"] == "vision" and env["EPOCHS"]["value"] == "10"
    assert env["GPUHUB_JOB_ID"]["value"] == "job-0123456789" and env["MLFLOW_EXPERIMENT_NAME"]["value"] == "mnist"
    assert '"gpuhub.job.attempt": "$(GPUHUB_POD)"' in env["MLFLOW_RUN_CONTEXT"]["value"]
    names = [e["name"] for e in c["env"]]
    assert names.index("GPUHUB_POD") < names.index("MLFLOW_RUN_CONTEXT")  # $(VAR) expands only from earlier vars
    # Recovery: preemption/disruption ignored, exit 75 retried up to 3 times, any other exit fails at once.
    assert js["backoffLimit"] == 3 and js["activeDeadlineSeconds"] == 7200
    assert js["podFailurePolicy"]["rules"] == [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "Count", "onExitCodes": {"operator": "In", "values": [75]}},
        {"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [0]}},
    ]
    # The Workload Kueue's job controller makes from it is valid for Kueue v0.19.2.
    wl = workload_for(job, policy.priority_value("batch"))
    validate(wl)
    assert wl["spec"]["maximumExecutionTimeSeconds"] == 7200


async def test_a_cpu_job_sees_no_gpu_and_fails_on_any_exit_without_retries(make_spawner, policy_store):
    spawner = make_spawner(user="erin", groups=("students",), profile="cpu")
    pod = await server_pod(spawner)
    policy = policy_store.policy
    spec = parse_job("profile: cpu\ncommand: python eval.py\n")
    choice = resolve_choice(policy, ["students"], {"profile": "cpu"})
    job = job_manifest("job-00000000aa", "erin", spec, policy, choice, pod, namespace=spawner.namespace)
    validate(job)
    c = job["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void" and "nvidia.com/gpu" not in (c["resources"].get("limits") or {})
    assert c["command"] == ["/bin/sh", "-c", "python eval.py"]
    assert job["metadata"]["labels"][PRIORITY_LABEL] == choice.priority_class
    assert job["spec"]["backoffLimit"] == 0 and "activeDeadlineSeconds" not in job["spec"]
    validate(workload_for(job))
