"""Which running jobs an interactive server reclaims GPUs from (one machine).

Jobs never preempt anything; a waiting server of a team takes GPUs back from that team's
running jobs of no higher priority, youngest first, and only as many as it needs.
"""

import time

import pytest
from traitlets.config import Config

from gpuhub_spawner.admission.queue import Ticket
from gpuhub_spawner.admission.quota import demand_for
from gpuhub_spawner.jobs import records as R
from gpuhub_spawner.local.job_manager import KEY_PREFIX, JobManager, _Live
from gpuhub_spawner.local.broker import LocalBroker
from gpuhub_spawner.policy import PolicyStore

POLICY = """\
flavors: [{name: gpu, local: {virtual: 3}}]
priorityClasses: [{name: interactive, value: 1000}, {name: batch, value: 100}, {name: urgent, value: 5000}]
teams:
  - {name: vision, groups: [v], defaultPriority: interactive, jobPriority: batch, quota: {gpus: {gpu: 2}}}
  - {name: nlp, groups: [n], defaultPriority: interactive, jobPriority: batch, quota: {gpus: {gpu: 1}}}
profiles:
  - {slug: gpu-1, displayName: G, gpu: {count: 1, flavor: gpu}, teams: "*"}
  - {slug: gpu-2, displayName: G2, gpu: {count: 2, flavor: gpu}, teams: [vision]}
"""


@pytest.fixture
def manager(tmp_path):
    (tmp_path / "p.yaml").write_text(POLICY)
    for cls in (PolicyStore, LocalBroker, JobManager):
        cls.clear_instance()
    cfg = Config()
    cfg.PolicyStore.policy_file = str(tmp_path / "p.yaml")
    cfg.JobManager.data_dir = str(tmp_path)
    cfg.LocalBroker.job_manager_class = JobManager  # as wiring.jobs hands it in
    m = JobManager.instance(config=cfg)
    yield m
    for cls in (PolicyStore, LocalBroker, JobManager):
        cls.clear_instance()


def run_job(m, job_id, team, profile="gpu-1", priority=100, started=None):
    policy = m.policy
    demand = demand_for(policy, policy.profile(profile))
    m.broker.queue.submit(Ticket(key=KEY_PREFIX + job_id, user="u", team=team, profile=profile, demand=demand, priority=priority))
    assert KEY_PREFIX + job_id in m.broker.queue.admitted
    rec = R.JobRecord(
        id=job_id,
        user="u",
        team=team,
        profile={"slug": profile},
        priority_class="batch",
        priority=priority,
        policy_sha256="",
        image="",
        image_digest="",
        command=["x"],
        working_dir="",
        checkpoint_dir="",
        env_names=[],
        experiment=None,
        time_limit=None,
        retries={},
        spec={},
    )
    rec.attempts.append(R.Attempt(number=1, queued=time.time(), started=started or time.time()))
    m.jobs[job_id] = rec
    m._live[job_id] = _Live(launcher=object(), demand=demand)


def wait_server(m, user, team, profile="gpu-1", priority=1000):
    demand = demand_for(m.policy, m.policy.profile(profile))
    t = m.broker.queue.submit(Ticket(key=f"{user}/", user=user, team=team, profile=profile, demand=demand, priority=priority))
    assert t.admission is None
    return t


def test_a_waiting_server_reclaims_the_youngest_job_of_its_own_team_only(manager):
    run_job(manager, "job-000000000a", "vision", started=100)
    run_job(manager, "job-000000000b", "vision", started=200)
    run_job(manager, "job-000000000c", "nlp")
    assert manager.victims() == []  # nobody waits
    wait_server(manager, "alice", "vision")
    victims = manager.victims()
    assert [v for v, _ in victims] == ["job-000000000b"]
    assert victims[0][1] == "preempted: an interactive server in vision needed 1 gpu GPU"


def test_a_server_needing_two_gpus_takes_two_jobs_and_never_another_teams(manager):
    run_job(manager, "job-000000000a", "vision", started=100)
    run_job(manager, "job-000000000b", "vision", started=200)
    run_job(manager, "job-000000000c", "nlp")
    wait_server(manager, "alice", "vision", profile="gpu-2")
    assert sorted(v for v, _ in manager.victims()) == ["job-000000000a", "job-000000000b"]


def test_jobs_never_preempt_and_higher_priority_jobs_are_kept(manager):
    run_job(manager, "job-000000000a", "vision", priority=5000)  # an urgent job outranks servers
    run_job(manager, "job-000000000b", "vision", priority=5000)
    wait_server(manager, "alice", "vision")
    assert manager.victims() == []
    # A waiting *job* reclaims nothing, whatever its priority.
    manager.broker.queue.cancel("alice/")
    demand = demand_for(manager.policy, manager.policy.profile("gpu-1"))
    manager.broker.queue.submit(
        Ticket(key=KEY_PREFIX + "job-000000000d", user="u", team="vision", profile="gpu-1", demand=demand, priority=9000)
    )
    assert manager.victims() == []


def test_no_reclaim_when_freeing_the_teams_jobs_would_not_be_enough(manager):
    run_job(manager, "job-000000000c", "nlp")
    wait_server(manager, "carol", "nlp")
    assert [v for v, _ in manager.victims()] == ["job-000000000c"]
    manager.broker.queue.cancel("carol/")
    # bob's server and a job hold vision's quota of 2; alice's 2-GPU server could only fit
    # by also stopping bob's server, which is never done: the job keeps running.
    demand = demand_for(manager.policy, manager.policy.profile("gpu-1"))
    manager.broker.queue.submit(Ticket(key="bob/", user="bob", team="vision", profile="gpu-1", demand=demand, priority=1000))
    run_job(manager, "job-000000000a", "vision")
    wait_server(manager, "alice", "vision", profile="gpu-2")
    assert manager.victims() == []
