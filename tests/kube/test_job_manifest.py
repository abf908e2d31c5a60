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
from gpuhub_spawner.kube.job_manifest import job_manifest, workload_for
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
    job = job_manifest(
        "job-0123456789", "alice", spec, policy, choice, pod, job_priority_class="batch", namespace=spawner.namespace
    )
    validate(job)  # kubernetes-validate, strict: unknown fields are errors
    meta, js = job["metadata"], job["spec"]
    assert (
        meta["namespace"] == "gpuhub-users" and js["suspend"] is True and meta["labels"][QUEUE_LABEL] == choice.team.local_queue
    )
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


async def test_with_fairness_between_users_a_job_queues_in_its_users_own_localqueue(make_spawner, policy_store):
    """``fairShare.users``: a job counts against its user as their servers do (Kueue's Admission
    Fair Sharing orders the team's ClusterQueue by each LocalQueue's usage)."""
    from gpuhub_spawner.kube.render import user_queue_name
    from gpuhub_spawner.policy.model import FairShare

    spawner = make_spawner(user="alice", groups=("vision-lab",), profile="a100-1")
    pod = await server_pod(spawner)
    policy = policy_store.policy.model_copy(update={"fair_share": FairShare(users=True)})
    choice = resolve_choice(policy, ["vision-lab"], {"profile": "a100-1"})
    job = job_manifest("job-0123456789", "alice", parse_job(JOB), policy, choice, pod, namespace=spawner.namespace)
    assert job["metadata"]["labels"][QUEUE_LABEL] == user_queue_name(choice.team, "alice") != choice.team.local_queue


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


# -- through the API double: Kueue's job integration admits, suspends, preempts ------------------

import json as _json  # noqa: E402
import sys as _sys  # noqa: E402

import requests as _requests  # noqa: E402

from double.harness import NAMESPACE  # noqa: E402
from double.server import TOKEN  # noqa: E402
from support.hub import waiter  # noqa: E402

TRAIN = """\
import json, os, time
ckpt = os.path.join(os.environ["GPUHUB_CHECKPOINT_DIR"], "state.json")
os.makedirs(os.environ["GPUHUB_CHECKPOINT_DIR"], exist_ok=True)
state = {"step": 0, "total": 0}
if os.path.exists(ckpt):
    state = json.load(open(ckpt))
    print("resumed from step", state["step"], flush=True)
print("attempt", os.environ["GPUHUB_ATTEMPT"], flush=True)
for step in range(state["step"] + 1, 9):
    time.sleep(0.3)
    state = {"step": step, "total": state["total"] + step}
    json.dump(state, open(ckpt + ".tmp", "w")); os.replace(ckpt + ".tmp", ckpt)
    print("step", step, flush=True)
print("total", state["total"], flush=True)
"""


def _post_job(double, job):
    r = _requests.post(
        f"{double.url}/apis/batch/v1/namespaces/{NAMESPACE}/jobs", json=job, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert r.status_code == 201, r.text
    return r.json()


_until = waiter(60, interval=0.1)


def _cond(obj, ctype):
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})


def _log(double, pod):
    path = double.workdir / f"{NAMESPACE}-{pod['metadata']['name']}" / "container.log"
    return path.read_text() if path.exists() else ""


async def _student_job(make_spawner, policy_store, text, job_id, user="erin"):
    spawner = make_spawner(user=user, groups=("students",), profile="l4-1")
    pod = await server_pod(spawner)
    policy = policy_store.policy
    choice = resolve_choice(policy, ["students"], {"profile": "l4-1"})
    return job_manifest(job_id, user, parse_job(text), policy, choice, pod, namespace=spawner.namespace), pod


async def test_the_double_admits_the_suspended_job_and_a_preemption_resumes_it_from_its_checkpoint(
    kube, make_spawner, policy_store, tmp_path
):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    ckpt = tmp_path / "ckpt"
    job, server = await _student_job(
        make_spawner,
        policy_store,
        (
            f"profile: l4-1\ncommand: [{_sys.executable}, {script}]\ncheckpointDir: {ckpt}\n"
            "retries: {limit: 0, reasons: [preempted]}\n"
        ),
        "job-00000000b1",
    )
    _post_job(kube, job)
    _until(
        lambda: (ckpt / "state.json").exists() and _json.loads((ckpt / "state.json").read_text())["step"] >= 2,
        30,
        "training to reach step 2",
    )
    first = kube.pods_of_job(NAMESPACE, "job-00000000b1")
    assert len(first) == 1 and QUEUE_LABEL not in first[0]["metadata"]["labels"]  # the Job is the managed object
    assert "schedulingGates" not in first[0]["spec"]
    # An interactive server of the same team needs the GPU; Kueue preempts the batch job for it.
    blocker = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "erin-interactive",
            "namespace": NAMESPACE,
            "labels": {**server["metadata"]["labels"], PRIORITY_LABEL: "interactive"},
        },
        "spec": {
            **server["spec"],
            "containers": [
                {
                    **server["spec"]["containers"][0],
                    "command": [_sys.executable, "-c", "import time; time.sleep(120)"],
                    "args": [],
                }
            ],
        },
    }
    status, _ = kube.create("pods", NAMESPACE, blocker)
    assert status == 201
    # (the double applies the ClusterQueue's withinClusterQueue: LowerPriority, tests/kube/test_preemption.py)
    _until(
        lambda: (
            "schedulingGates" not in (kube.get("pods", NAMESPACE, "erin-interactive") or {"spec": {"schedulingGates": 1}})["spec"]
        ),
        10,
        "the server to be admitted",
    )
    j = kube.get("jobs", NAMESPACE, "job-00000000b1")
    assert j["spec"]["suspend"] is True and not j["status"].get("failed")  # suspended, nothing counted
    [wl] = [w for w in kube.list("workloads", NAMESPACE) if w["metadata"]["name"].startswith("job-job-00000000b1")]
    assert _cond(wl, "Evicted")["reason"] == "Preempted" and _cond(wl, "QuotaReserved")["status"] == "False"
    # The server ends; the job is admitted again and its new pod continues from the checkpoint.
    kube.delete("pods", NAMESPACE, "erin-interactive")
    done = _until(
        lambda: (j := kube.get("jobs", NAMESPACE, "job-00000000b1")) and _cond(j, "Complete").get("status") == "True" and j,
        60,
        "the job to complete",
    )
    assert done["status"]["succeeded"] == 1 and not done["status"].get("failed")
    pods = kube.pods_of_job(NAMESPACE, "job-00000000b1")
    assert len(pods) == 1  # the preempted pod was deleted; this is the second attempt's
    out = _log(kube, pods[0])
    assert "resumed from step" in out and f"attempt {pods[0]['metadata']['name']}" in out
    assert out.strip().splitlines()[-1] == "total 36"
    [wl] = [w for w in kube.list("workloads", NAMESPACE) if w["metadata"]["name"].startswith("job-job-00000000b1")]
    assert _cond(wl, "Finished")["status"] == "True"


async def test_the_double_applies_the_jobs_failure_policy(kube, make_spawner, policy_store):
    code = "import sys; sys.exit(int(sys.argv[1]))"
    fatal, _ = await _student_job(
        make_spawner,
        policy_store,
        (f"profile: l4-1\ncommand: [{_sys.executable}, -c, '{code}', '3']\nretries: {{limit: 2, reasons: [preempted, 75]}}\n"),
        "job-00000000c1",
    )
    _post_job(kube, fatal)
    j = _until(
        lambda: (j := kube.get("jobs", NAMESPACE, "job-00000000c1")) and _cond(j, "Failed").get("status") == "True" and j,
        30,
        "the job to fail",
    )
    assert _cond(j, "Failed")["reason"] == "PodFailurePolicy" and j["status"]["failed"] == 1  # not retried
    retried, _ = await _student_job(
        make_spawner,
        policy_store,
        (f"profile: l4-1\ncommand: [{_sys.executable}, -c, '{code}', '75']\nretries: {{limit: 1, reasons: [75]}}\n"),
        "job-00000000c2",
        user="erin2",
    )
    _post_job(kube, retried)
    j = _until(
        lambda: (j := kube.get("jobs", NAMESPACE, "job-00000000c2")) and _cond(j, "Failed").get("status") == "True" and j,
        30,
        "the retried job to give up",
    )
    assert _cond(j, "Failed")["reason"] == "BackoffLimitExceeded" and j["status"]["failed"] == 2  # 1 retry


async def test_several_workers_render_as_one_indexed_job_kueue_admits_all_or_nothing(make_spawner, policy_store):
    """``workers: 3`` (issue 44): one Workload pod set of count 3 (quota for all three or none),
    each pod one worker with the profile's GPU, ranks from the completion index, rank 0's
    name through the Job's headless Service (owned by the Job), and a failing worker fails the
    whole Job (a rendezvous cannot go on with one worker restarted alone). The hub submitting
    it: ``test_job_workers_hub_e2e.py``."""
    from gpuhub_spawner.kube.job_manifest import COMPLETION_INDEX, rendezvous_service

    spawner = make_spawner(user="alice", groups=("vision-lab",), profile="a100-1")
    pod = await server_pod(spawner)
    policy = policy_store.policy
    spec = parse_job("profile: a100-1\nworkers: 3\ncommand: [python, train.py]\n")
    choice = resolve_choice(policy, ["vision-lab"], {"profile": "a100-1"})
    job = job_manifest("job-00000000aa", "alice", spec, policy, choice, pod, namespace=spawner.namespace)
    validate(job)
    js = job["spec"]
    assert (js["parallelism"], js["completions"], js["completionMode"], js["suspend"]) == (3, 3, "Indexed", True)
    tmpl = js["template"]["spec"]
    assert tmpl["subdomain"] == "job-00000000aa"
    c = tmpl["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"  # per worker: the profile's
    env = {e["name"]: e for e in c["env"]}
    assert env["MASTER_ADDR"]["value"] == "job-00000000aa-0.job-00000000aa" and env["MASTER_PORT"]["value"] == "29500"
    assert env["WORLD_SIZE"]["value"] == "3" and env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == COMPLETION_INDEX
    rules = js["podFailurePolicy"]["rules"]
    assert rules[-1] == {"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [0]}}
    assert not [r for r in rules if r["action"] == "Count"]  # no worker is restarted alone
    svc = rendezvous_service({**job, "metadata": {**job["metadata"], "uid": "4f6a0c2e-0000-4000-8000-000000000001"}})
    validate(svc)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == {"gpuhub/job": "job-00000000aa"}
    assert svc["metadata"]["ownerReferences"] == [
        {"apiVersion": "batch/v1", "kind": "Job", "name": "job-00000000aa", "uid": "4f6a0c2e-0000-4000-8000-000000000001"}
    ]  # collected with its Job
    assert not any(k.startswith("kueue.x-k8s.io/podset-") for k in js["template"]["metadata"]["annotations"])  # no topology
    assert js["template"]["metadata"]["labels"]["gpuhub/job"] == "job-00000000aa"  # the Service selects the workers
    wl = workload_for(job)
    validate(wl)
    assert [(ps["name"], ps["count"]) for ps in wl["spec"]["podSets"]] == [("main", 3)]
    # One worker stays a plain Job.
    one = job_manifest(
        "job-00000000ab", "alice", parse_job("profile: a100-1\ncommand: [x]\n"), policy, choice, pod, namespace=spawner.namespace
    )
    assert "completionMode" not in one["spec"] and "subdomain" not in one["spec"]["template"]["spec"]


TOPOLOGY = {
    "topologies": [{"name": "dc", "levels": ["example.com/block", "example.com/rack", "kubernetes.io/hostname"]}],
}


def _with_topology(policy_file, mode: str = "preferred"):
    """The shipped policy, its A100 flavor placed by the topology ``dc`` (Kueue TAS)."""
    import yaml

    from gpuhub_spawner.policy.loader import parse_policy

    data = yaml.safe_load(policy_file.read_text())
    data.update(TOPOLOGY)
    flavor = next(f for f in data["flavors"] if f["name"] == "a100")
    flavor["topology"] = {"name": "dc", "level": "example.com/rack", "mode": mode}
    return parse_policy(yaml.safe_dump(data))


@pytest.mark.parametrize("mode", ["preferred", "required"])
async def test_several_workers_on_a_flavor_with_a_topology_ask_kueue_for_one_domain(
    make_spawner, policy_store, policy_file, mode
):
    """Where the operator labelled the topology (the flavor's ``topology``), a several-worker
    job's pod set carries Kueue's TAS annotation for the flavor's level; one worker does not."""
    spawner = make_spawner(user="alice", groups=("vision-lab",), profile="a100-1")
    pod = await server_pod(spawner)
    policy = _with_topology(policy_file, mode)
    choice = resolve_choice(policy, ["vision-lab"], {"profile": "a100-1"})
    spec = parse_job("profile: a100-1\nworkers: 2\ncommand: [python, train.py]\n")
    job = job_manifest("job-00000000ac", "alice", spec, policy, choice, pod, namespace=spawner.namespace)
    validate(job)
    annotations = job["spec"]["template"]["metadata"]["annotations"]
    assert annotations[f"kueue.x-k8s.io/podset-{mode}-topology"] == "example.com/rack"
    other = "required" if mode == "preferred" else "preferred"
    assert f"kueue.x-k8s.io/podset-{other}-topology" not in annotations
    validate(workload_for(job))  # the Workload's pod set template keeps it
    one = job_manifest(
        "job-00000000ad", "alice", parse_job("profile: a100-1\ncommand: [x]\n"), policy, choice, pod, namespace=spawner.namespace
    )
    assert not any(k.startswith("kueue.x-k8s.io/podset-") for k in one["spec"]["template"]["metadata"]["annotations"])
