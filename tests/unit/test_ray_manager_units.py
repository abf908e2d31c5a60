"""The one-machine Ray manager's own decisions, without Ray or a hub (docs/ray.md):
the ready line, the idle rule (warned, then stopped, the clock from readiness), and
``stopWithServer``. The job machinery under it is stood in by a small fake; the real
thing runs in tests/integration/test_ray_cluster.py."""

import asyncio
import json
from types import SimpleNamespace

from gpuhub_spawner.jobs import records as R
from gpuhub_spawner.local import ray_manager as M
from gpuhub_spawner.policy import parse_policy

POLICY = """\
flavors: [{name: gpu, local: {virtual: 2}}]
teams: [{name: vision, groups: [vision-lab], quota: {gpus: {gpu: 2}}}]
profiles:
  - {slug: gpu-2, displayName: Two, gpu: {count: 2, flavor: gpu}, teams: [vision],
     idle: {gpuIdleTimeout: 100s, warning: 20s, maxSnoozes: 0}}
ray: {enabled: true, STOP}
"""


class FakeJobs:
    def __init__(self, policy, tmp_path):
        self.policy = policy
        self.jobs = {}
        self.data_dir = str(tmp_path)
        self.broker = SimpleNamespace(queue=SimpleNamespace(admitted={}))
        self.store = SimpleNamespace(save=lambda rec: None)
        self.cancelled = []

    async def cancel(self, job_id):
        rec = self.jobs[job_id]
        rec.state, rec.message, rec.finished = R.CANCELLED, "cancelled by its owner or an admin", 1.0
        self.cancelled.append(job_id)
        return rec


def cluster(tmp_path, started=1000.0):
    log = tmp_path / "attempt-1.log"
    log.write_text(
        "[gpuhub] admitted\n" + M.READY + json.dumps({"address": "10.0.0.1:6379", "dashboard_port": 8265, "virtual": True}) + "\n"
    )
    rec = R.JobRecord(
        id="job-0123456789",
        user="alice",
        team="vision",
        profile={"slug": "gpu-2", "gpu": {"count": 2, "flavor": "gpu"}, "cpu": 1000, "memory": 1},
        priority_class=None,
        priority=0,
        policy_sha256="",
        image="",
        image_digest="",
        command=["python", "--workers", "0"],
        working_dir="",
        checkpoint_dir="",
        env_names=[],
        experiment=None,
        time_limit=None,
        retries={},
        spec={"env": [M.MARK]},
        name="mine",
        state=R.RUNNING,
    )
    rec.attempts.append(R.Attempt(number=1, queued=started - 5, started=started, devices=["0", "1"], log=str(log)))
    return rec


def manager(tmp_path, monkeypatch, stop_with_server=True):
    policy = parse_policy(POLICY.replace("STOP", f"stopWithServer: {str(stop_with_server).lower()}"))
    jobs = FakeJobs(policy, tmp_path)
    m = M.LocalRayManager.__new__(M.LocalRayManager)
    m.config, m.check_interval, m._watch, m._loop_task, m._ending = {}, 1.0, {}, None, {}
    monkeypatch.setattr(M.LocalRayManager, "jobs", property(lambda self: jobs))  # the fake job machinery
    return m, jobs


def test_ready_line_gives_the_address_and_the_idle_clock_starts_there(tmp_path, monkeypatch):
    m, jobs = manager(tmp_path, monkeypatch)
    rec = cluster(tmp_path)
    jobs.jobs[rec.id] = rec
    monkeypatch.setattr(M.time, "time", lambda: 5000.0)  # seen ready long after the process started
    v = m.status("mine", "alice")
    assert (v.state, v.address, v.gpus) == ("running", "127.0.0.1:6379", 2)
    assert "virtual GPUs: Ray schedules on them, CUDA has none" in v.status
    asyncio.run(m.check(now=5050.0))  # 50 s after ready: not idle yet (100 s after the process start)
    assert m.status("mine").warning == ""
    asyncio.run(m.check(now=5101.0))
    v = m.status("mine")
    assert v.warning.startswith("idle: its GPUs were idle for 1m40s") and "it will be stopped at" in v.warning
    asyncio.run(m.check(now=5122.0))
    v = m.status("mine")
    assert jobs.cancelled == [rec.id]
    assert (v.state, v.reason) == ("stopped", "idle")
    assert v.status == "stopped: stopped because it was idle: its GPUs were idle for 1m40s"


def test_stops_with_its_owners_server_only_if_the_policy_says_so(tmp_path, monkeypatch):
    for stop_with_server, expected in ((True, "stopped"), (False, "running")):
        m, jobs = manager(tmp_path, monkeypatch, stop_with_server)
        rec = cluster(tmp_path)
        jobs.jobs[rec.id] = rec
        monkeypatch.setattr(M.time, "time", lambda: 2000.0)
        asyncio.run(m.check(now=2001.0))  # no server yet: a cluster from a laptop is kept
        assert m.status("mine").state == "running"
        jobs.broker.queue.admitted["alice/"] = SimpleNamespace(user="alice")
        asyncio.run(m.check(now=2002.0))
        del jobs.broker.queue.admitted["alice/"]
        asyncio.run(m.check(now=2003.0))
        v = m.status("mine")
        assert v.state == expected, stop_with_server
        if expected == "stopped":
            assert v.reason == "server-stopped" and "ray.stopWithServer" in v.status
