"""The Kubernetes Ray manager (``kube/ray_manager.py``, issue 24) on the API double: the
RayCluster it creates from the policy, Kueue's admission and words read back, the user's GPU
cap, stop, and idle culling (warn, then delete: a RayCluster holds its quota while it exists).

The double models KubeRay and Kueue's ``ray.io/raycluster`` integration (``double/ray.py``);
the same RayClusters against the real operator and Kueue: tests/kube/test_ray_real_cluster.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import yaml

from double.harness import NAMESPACE
from gpuhub_spawner.kube.ray_manager import ACTIVITY_ANNOTATION, WARNING_ANNOTATION, KubeRayManager, worker_groups
from gpuhub_spawner.policy.access import ChoiceError
from gpuhub_spawner.rayclusters import IDLE, QUEUED, RUNNING, STOPPED, WITH_SERVER, RayRequest

pytestmark = pytest.mark.asyncio(loop_scope="function")


@pytest.fixture
def ray_policy(policy_file):
    """The shipped policy with Ray on and room for 4 workers (its own ``ray:`` section replaced)."""
    data = yaml.safe_load(policy_file.read_text())
    data["ray"] = {"enabled": True, "maxWorkers": 4}
    policy_file.write_text(yaml.safe_dump(data, sort_keys=False))
    return policy_file


@pytest.fixture
def manager(ray_policy, make_spawner):
    users = {}

    def spawner_for(user, name):
        return make_spawner(user=user.name, groups=[g.name for g in user.groups], profile=None, server_name=name)

    m = KubeRayManager(namespace=NAMESPACE, poll_interval=0.1, spawner_for=spawner_for)
    m.users = users
    return m


def _user(make_spawner, name, groups=("vision-lab",)):
    return make_spawner(user=name, groups=groups, profile="cpu").user


async def _until(check, timeout, what, manager=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if manager is not None:
            await manager.refresh()  # what the manager's poller does every poll_interval
        value = check()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.asyncio(loop_scope="function")
async def test_the_profiles_gpus_are_split_evenly_over_the_workers():
    assert worker_groups(2, 2)[0].gpus == 1 and worker_groups(2, 0)[0].replicas == 1 and worker_groups(2, 0)[0].gpus == 2
    assert worker_groups(0, 3)[0].name == "cpu"
    with pytest.raises(ChoiceError, match="evenly"):
        worker_groups(2, 3)


async def test_queue_cap_stop_and_kueues_words(manager, make_spawner, kube):
    double = kube
    alice, bob = _user(make_spawner, "alice"), _user(make_spawner, "bob")
    view = await manager.start(alice, ["vision-lab"], RayRequest(user="alice", gpus=2, workers=2, name="train"))
    assert view.state == QUEUED and view.gpus == 2 and view.profile == "a100-2"
    rc = double.get("rayclusters", NAMESPACE, view.id)
    assert rc["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "vision"
    assert rc["spec"]["workerGroupSpecs"][0]["replicas"] == 2
    await _until(lambda: manager.status("train", "alice").state == RUNNING, 10, manager=manager, what="alice's cluster running")
    assert "head" in manager.status("train", "alice").status and manager.status("train", "alice").address

    # alice's cap (perUser maxGPUs: 2) counts her cluster like a server of that profile
    with pytest.raises(ChoiceError):
        await manager.start(alice, ["vision-lab"], RayRequest(user="alice", gpus=1, workers=1))

    # bob: over vision's quota (2 held of 2 nominal + 1 borrowable): queued with Kueue's reason
    bview = await manager.start(bob, ["vision-lab"], RayRequest(user="bob", gpus=2, workers=1))
    try:
        words = await _until(
            lambda: (s := manager.status(bview.id, "bob")) and "couldn't" not in s.status and "A100" in s.status and s.status,
            10,
            "bob's waiting words",
            manager,
        )
    except AssertionError:
        raise AssertionError(
            f"bob's status: {manager.status(bview.id, 'bob')}; workload {manager.workloads.get(bview.id)}"
        ) from None
    assert words.startswith("queued: ") and "Vision Lab" in words, words
    assert [v.name for v in manager.list("bob")] == [bview.name] and len(manager.list()) == 2

    stopped = await manager.stop("train", user_name="alice")
    assert stopped.state == STOPPED and double.get("rayclusters", NAMESPACE, view.id) is None
    await _until(
        lambda: manager.status(bview.id, "bob").state == RUNNING,
        10,
        manager=manager,
        what="bob's cluster admitted once alice's is gone",
    )
    await manager.stop(bview.id)


async def test_an_idle_cluster_is_warned_then_deleted(manager, make_spawner, kube, policy_store):
    double = kube
    alice = _user(make_spawner, "alice")
    view = await manager.start(alice, ["vision-lab"], RayRequest(user="alice", gpus=1, workers=1, name="idle"))
    await _until(lambda: manager.status("idle", "alice").state == RUNNING, 10, manager=manager, what="running")
    rules = policy_store.policy.idle_rules(policy_store.policy.profile("a100-1"))
    started = manager.status("idle", "alice").started
    first_rule = min(r for r in (rules.timeout, rules.gpu_idle_timeout, rules.max_age) if r)
    # Activity keeps it only for the activity rule; the GPU rule (no reading: idle) warns anyway.
    await manager.touch("idle", "alice", when=started + first_rule - 1)
    assert double.get("rayclusters", NAMESPACE, view.id)["metadata"]["annotations"][ACTIVITY_ANNOTATION]
    t_warn = started + first_rule + 1
    decisions = dict(await manager.cull_pass(now=t_warn))
    d = decisions[view.id]
    assert d.action == "warn", d
    ann = double.get("rayclusters", NAMESPACE, view.id)["metadata"]["annotations"]
    assert "will be deleted at" in ann[WARNING_ANNOTATION] and manager.status("idle", "alice").warning
    decisions = dict(await manager.cull_pass(now=d.deadline + 1))
    assert decisions[view.id].action == "cull"
    gone = manager.status("idle", "alice")
    assert gone.state == STOPPED and gone.reason == IDLE and double.get("rayclusters", NAMESPACE, view.id) is None
    assert not double.pods_of_ray(NAMESPACE, view.id)


async def test_a_cluster_stops_with_its_owners_server(manager, make_spawner, kube):
    double = kube
    servers = {"alice"}
    manager.users_with_servers = lambda: set(servers)  # the hub's admission view (the KueueLedger) in a hub
    alice = _user(make_spawner, "alice")
    view = await manager.start(alice, ["vision-lab"], RayRequest(user="alice", gpus=1, workers=1, name="with-server"))
    await _until(lambda: manager.status("with-server", "alice").state == RUNNING, 10, "running", manager)
    await manager.cull_pass()
    assert manager.status("with-server", "alice").state == RUNNING
    servers.clear()  # alice's server stopped (policy ray.stopWithServer: true by default)
    await manager.cull_pass()
    gone = manager.status("with-server", "alice")
    assert gone.state == STOPPED and gone.reason == WITH_SERVER and double.get("rayclusters", NAMESPACE, view.id) is None


async def test_a_kueue_spawner_hub_gets_the_kubernetes_manager(monkeypatch):
    from types import SimpleNamespace

    from traitlets.config import Config

    from gpuhub_spawner.kube.spawner import KueueSpawner
    from gpuhub_spawner.wiring import app as wiring_app

    from jupyterhub.app import JupyterHub

    c = Config()
    c.KubeSpawner.namespace = "gpuhub-users"
    monkeypatch.setattr(JupyterHub, "initialized", classmethod(lambda cls: True))
    monkeypatch.setattr(JupyterHub, "instance", classmethod(lambda cls, *a, **k: SimpleNamespace(spawner_class=KueueSpawner)))
    m = wiring_app.ray_manager(c)
    assert isinstance(m, KubeRayManager) and m.namespace == "gpuhub-users"


async def test_the_ledger_counts_a_clusters_gpus_in_its_teams_usage(manager, make_spawner, kube, tmp_path):
    """kube/ledger.py mirrors a RayCluster's Workload like a job's (``job:<cluster id>``): every
    pod set's GPUs in the team's usage while admitted, the request in the queue while it waits,
    and the history's end reason from the manager's stop."""
    from collections import OrderedDict
    from types import SimpleNamespace

    from traitlets.config import Config

    from gpuhub_spawner.culling.board import CullBoard
    from gpuhub_spawner.kube.ledger import KueueLedger
    from gpuhub_spawner.usage.recorder import UsageRecorder

    double = kube
    for cls in (KueueLedger, UsageRecorder, CullBoard):
        cls.clear_instance()
    c = Config()
    c.CullBoard.state_file = str(tmp_path / "culling.json")
    ledger = KueueLedger.instance(config=c)
    ended = []
    ledger.queue.on_release.append(lambda a: ended.append(a.key))

    def read():  # what the shared reflectors hold: the double's Workloads and pods, by namespace/name
        ledger._workloads = SimpleNamespace(
            resources={f"{NAMESPACE}/{w['metadata']['name']}": w for w in double.list("workloads", NAMESPACE)}, gone=OrderedDict()
        )
        ledger._pods = SimpleNamespace(
            resources={f"{NAMESPACE}/{p['metadata']['name']}": p for p in double.list("pods", NAMESPACE)}, gone=OrderedDict()
        )
        ledger.sync()
        return ledger.queue

    try:
        alice, bob = _user(make_spawner, "alice"), _user(make_spawner, "bob")
        view = await manager.start(alice, ["vision-lab"], RayRequest(user="alice", gpus=2, workers=2, name="train"))
        await _until(lambda: manager.status("train", "alice").state == RUNNING, 10, "alice's cluster running", manager)
        q = read()
        key = f"job:{view.id}"
        adm = q.admitted[key]
        assert (adm.user, adm.team, adm.profile) == ("alice", "vision", "a100-2")
        assert adm.demand.get("gpu/a100") == 2, adm.demand  # both workers' GPUs (the head has none)
        assert q.usage()["vision"]["gpu/a100"] == 2

        bview = await manager.start(bob, ["vision-lab"], RayRequest(user="bob", gpus=2, workers=1, name="wait"))
        await _until(
            lambda: any(
                w["metadata"].get("ownerReferences", [{}])[0].get("name") == bview.id for w in double.list("workloads", NAMESPACE)
            ),
            10,
            "bob's Workload",
        )
        q = read()
        (ticket,) = [t for t in q.waiting if t.key == f"job:{bview.id}"]
        assert (ticket.user, ticket.team, ticket.demand.get("gpu/a100")) == ("bob", "vision", 2)

        await manager.stop("train", user_name="alice")
        await _until(lambda: key not in read().admitted, 10, "alice's GPUs released")
        assert key in ended
        rows = [r for r in UsageRecorder.instance().history.rows(0, user="alice") if r.profile == "a100-2"]
        assert [(r.kind, r.team, r.gpus, r.end_reason, r.stopped_by) for r in rows] == [
            ("job", "vision", 2, "stopped", "alice")
        ], rows  # a Ray cluster is a job's GPU time, as on one machine
        await manager.stop(bview.id)
    finally:
        for cls in (KueueLedger, UsageRecorder, CullBoard):
            cls.clear_instance()
