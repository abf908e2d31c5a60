"""Reads of one Kubernetes job that overlap, through the API double (no hub).

The hub reads a job back from two places at once: its poller every ``poll_interval`` and every
API answer about the job (``hub.jobs_api.fresh``: ``gpuhub job status``, the jobs page, a test's
``wait_for``). Each read awaits the API server several times (the Job, its pods, its Workload,
the pod's log), so on a loaded machine two reads of the same record interleave. Interleaved,
each took a pod it had not seen for a new attempt: one pod became two attempts, the first
never ended, and once the Job's verdict came it was left without a reason (or, since
3839ff3, "interrupted") between the real ones. This was the cause of the intermittent failure of
``test_gpu_health_kube_e2e.py``'s NoExecute test, whose ``wait_for`` asks for the record
every 0.5 s while the poller reads it every 0.3 s. Here the overlap is made on purpose:
several reads started together, at every step of a job's life.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time

import pytest
import requests
from kubernetes_asyncio.client import ApiClient

from double.harness import NAMESPACE
from double.server import TOKEN
from gpuhub_spawner.jobs import records as R
from gpuhub_spawner.jobs.spec import parse_job
from gpuhub_spawner.kube.job_manager import KubeJobManager
from gpuhub_spawner.kube.job_manifest import job_manifest
from gpuhub_spawner.policy.access import resolve_choice

pytestmark = pytest.mark.asyncio(loop_scope="function")

JOB_ID = "job-0000be7ad2"
WAIT = 30  # a guard against a hang, not a measurement


async def until(check, what):
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


PROGRAM = """\
import os, sys, time
first, go = sys.argv[1:]
if not os.path.exists(first):  # the first pod fails (counted: the Job controller starts the next)
    open(first, "w").close()
    sys.exit(3)
while not os.path.exists(go):  # the second succeeds when the test says so
    time.sleep(0.05)
"""


async def submit(kube, make_spawner, policy, tmp_path) -> dict:
    """A job as the Kubernetes backend creates it (one retry for a failed exit)."""
    spawner = make_spawner(user="alice", groups=("vision-lab",), profile="cpu")
    await spawner.load_user_options()
    pod = ApiClient().sanitize_for_serialization(await spawner.get_pod_manifest())
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    spec = parse_job(
        f"profile: cpu\ncommand: [{sys.executable}, {program}, {tmp_path / 'first'}, {tmp_path / 'go'}]\n"
        "retries: {limit: 1, reasons: [failed]}\n"
    )
    manifest = job_manifest(
        JOB_ID, "alice", spec, policy, resolve_choice(policy, ["vision-lab"], {"profile": "cpu"}), pod, namespace=NAMESPACE
    )
    r = requests.post(
        f"{kube.url}/apis/batch/v1/namespaces/{NAMESPACE}/jobs",
        json=manifest,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    )
    assert r.status_code == 201, r.text
    return r.json()


def record(job: dict) -> R.JobRecord:
    """The record ``KubeJobManager.submit`` keeps for the Job it created."""
    return R.JobRecord(
        id=JOB_ID,
        user="alice",
        team="vision",
        profile={"slug": "cpu"},
        priority_class=None,
        priority=0,
        policy_sha256="",
        image="",
        image_digest="",
        command=[],
        working_dir="",
        checkpoint_dir="",
        env_names=[],
        experiment=None,
        time_limit=None,
        retries={"limit": 0, "reasons": ["failed"]},
        spec={"namespace": NAMESPACE, "uid": job["metadata"]["uid"]},
        backend="kubernetes",
        attempts=[R.Attempt(number=1, queued=time.time())],
    )


async def read_together(manager: KubeJobManager, rec: R.JobRecord, n: int = 4) -> None:
    await asyncio.gather(*(manager.refresh(rec) for _ in range(n)))


def pods(kube) -> list[str]:
    return [p["metadata"]["name"] for p in kube.pods_of_job(NAMESPACE, JOB_ID)]


def phase(kube, pod: str) -> str | None:
    return ((kube.get("pods", NAMESPACE, pod) or {}).get("status") or {}).get("phase")


async def test_reads_of_a_job_that_overlap_give_each_pod_one_attempt_and_every_attempt_an_end(
    kube, make_spawner, policy_store, tmp_path
):
    rec = record(await submit(kube, make_spawner, policy_store.policy, tmp_path))
    manager = KubeJobManager(data_dir=str(tmp_path / "data"))

    # The first pod failed, the Job controller's second runs: the reads meet a pod they know
    # (its log copied: an await) before one they do not.
    def failed_and_running():
        by_phase = {phase(kube, name): name for name in pods(kube)}
        pair = (by_phase.get("Failed"), by_phase.get("Running"))
        return pair if len(by_phase) == 2 and all(pair) else None

    first, second = await until(failed_and_running, "the first pod failed, the second running")
    await read_together(manager, rec)
    assert [(a.number, a.account, a.reason) for a in rec.attempts] == [(1, first, "failed"), (2, second, None)], rec.attempts
    assert rec.state == R.RUNNING

    (tmp_path / "go").touch()  # the second pod succeeds and the Job controller completes the Job
    await until(
        lambda: any(
            c["type"] == "Complete" and c["status"] == "True"
            for c in (kube.get("jobs", NAMESPACE, JOB_ID) or {}).get("status", {}).get("conditions") or []
        ),
        "the Job complete",
    )
    await read_together(manager, rec)
    assert rec.state == R.SUCCEEDED, rec
    assert [(a.number, a.account, a.reason) for a in rec.attempts] == [(1, first, "failed"), (2, second, "succeeded")], (
        rec.attempts
    )
    assert all(a.finished is not None and a.devices == ["double-node-1"] for a in rec.attempts), rec.attempts
    assert kube.invalid == [] and kube.errors == []


async def test_reading_a_running_job_leaves_no_http_session_open(kube, make_spawner, policy_store, tmp_path):
    """Each read of a running job (the poller's every ``poll_interval``, every API answer's) made
    throwaway ``ApiClient``s to turn answers into plain data, and each opened an aiohttp session
    nothing closed: an "Unclosed client session" error in the hub's log per read per job."""
    rec = record(await submit(kube, make_spawner, policy_store.policy, tmp_path))
    manager = KubeJobManager(data_dir=str(tmp_path / "data"))
    await until(lambda: [p for p in pods(kube) if phase(kube, p) == "Running"], "a pod of the job running")
    gc.collect()  # what came before (the test's own submit) is not counted
    reported = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: reported.append(context.get("message", "")))
    try:
        for _ in range(3):
            await manager.refresh(rec)
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert rec.state == R.RUNNING and rec.attempts[-1].account in pods(kube), rec
    assert reported == [], reported
    (tmp_path / "go").touch()
