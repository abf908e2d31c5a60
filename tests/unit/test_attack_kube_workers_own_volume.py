"""A several-worker job where the operator gives each job a ReadWriteOnce claim of its own
(``KueueSpawner.work_volume: own``, kube/storage.py): one claim for N pods that land on N
nodes cannot be attached to all of them (the second node's pod waits on "Multi-Attach
error" for ever), so the Job would hold N workers' quota of the team, evicted and
re-queued by ``waitForPodsReady`` again and again, and never run. Refused at submission,
with the reason, before anything is made in the cluster."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from traitlets.config import Config

from gpuhub_spawner.jobs.spec import parse_job
from gpuhub_spawner.kube.job_manager import KubeJobManager
from gpuhub_spawner.kube.storage import HOME, OWN
from gpuhub_spawner.policy import PolicyStore
from gpuhub_spawner.policy.access import ChoiceError

POLICY = """\
flavors:
  - {name: l4, displayName: L4 24GB, resource: nvidia.com/gpu, local: {virtual: 2}}
priorityClasses: [{name: interactive, value: 1000}, {name: batch, value: 100}]
teams:
  - {name: vision, displayName: Vision Lab, groups: [v], defaultPriority: interactive, quota: {cpu: 8, memory: 16Gi, gpus: {l4: 2}}}
profiles: [{slug: l4-1, displayName: One L4, cpu: 1, memory: 2Gi, gpu: {count: 1, flavor: l4}, teams: "*"}]
"""

POD = {
    "metadata": {"namespace": "users", "labels": {"hub.jupyter.org/username": "alice", "component": "singleuser-server"}},
    "spec": {"containers": [{"name": "notebook", "image": "img:1", "env": [{"name": "HOME", "value": "/home/jovyan"}]}]},
}


class Cluster:
    """What the hub asks of the API server, recorded; every create succeeds."""

    def __init__(self) -> None:
        self.created: list[str] = []
        self.api_client = self

    async def create_namespaced_job(self, namespace, job):
        self.created.append(f"job/{job['metadata']['name']}")
        return SimpleNamespace(metadata=SimpleNamespace(uid="uid-1"))

    async def delete_namespaced_job(self, *args, **kwargs):
        self.created.append("deleted")


@pytest.fixture
def manager(tmp_path):
    PolicyStore.clear_instance()
    (tmp_path / "policy.yaml").write_text(POLICY)
    c = Config()
    c.PolicyStore.policy_file = str(tmp_path / "policy.yaml")
    m = KubeJobManager(config=c, data_dir=str(tmp_path))
    yield m
    PolicyStore.clear_instance()


def _submit(m: KubeJobManager, work_volume: str, workers: int) -> Cluster:
    cluster = Cluster()

    async def pod_for(choice):
        return dict(POD)

    m._client = lambda kind: cluster  # type: ignore[method-assign]
    m._spawner = lambda user, job_id: SimpleNamespace(  # type: ignore[method-assign]
        work_volume=work_volume, namespace="users", user_options=None, pod_for=pod_for, granted={}
    )
    spec = parse_job(f"profile: l4-1\ncommand: [python, train.py]\nworkers: {workers}\n")
    alice = SimpleNamespace(name="alice", spawners={})
    try:
        asyncio.run(m.submit(alice, ["v"], spec))
    except ChoiceError as e:
        cluster.created.append(f"refused {e.status}: {e.message}")
    return cluster


def test_attack_several_workers_on_one_readwriteonce_claim_are_refused_before_anything_is_made(manager):
    made = _submit(manager, OWN, 2).created
    assert len(made) == 1 and made[0].startswith("refused 501"), made
    assert "ReadWriteOnce" in made[0] and "work_volume" in made[0], made[0]


def test_several_workers_on_the_home_volume_go_on_to_the_cluster(manager):
    # The same job with the home volume (ReadWriteMany) reaches the API server.
    assert any(c.startswith("job/job-") for c in _submit(manager, HOME, 2).created)
