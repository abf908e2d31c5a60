"""Each user's own LocalQueue with ``fairShare.users`` (issue 41; docs/fair-share.md): a real
JupyterHub with KueueSpawner, on the API double and, from the same code, on the real control
plane (``GPUHUB_CLUSTER=1``; ``backends.py``), where the hub speaks as the install guide's
service account with only the shipped Role (``helm-values/user-namespace.yaml``), every request
of it in the API server's audit log and checked against ``kube/rights.py``.

* alice's and bob's servers (one team) queue in a LocalQueue each, which the hub created at
  their first start, pointing at the team's ClusterQueue (Kueue's Admission Fair Sharing then
  orders the team's queue by each one's usage: ``test_fair_share_kueue.py``);
* lena, waiting, is told her place in the team's queue (not in her own);
* alice's second start finds her queue there (the hub's create answers 409: no read right is
  needed) and it keeps her usage record, as it does across hub restarts and policy applies
  (``gpuhub render kueue`` never lists per-user queues, so applying it touches none);
* off-boarding bob deletes his queue and only his.
"""

from __future__ import annotations

import pytest

from backends import NAMESPACE, backend_fixture
from gpuhub_spawner.kube.kueue import QUEUE_LABEL
from gpuhub_spawner.kube.render import user_queue_name
from gpuhub_spawner.policy import parse_policy
from support.hub import Hub, wait_for

pytestmark = pytest.mark.integration

POLICY = """\
apiVersion: gpuhub/v1
flavors:
  - {name: l4, displayName: L4 24GB, resource: nvidia.com/gpu, nodeLabels: {nvidia.com/gpu.product: NVIDIA-L4}, local: {virtual: 2},
     tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]}
priorityClasses:
  - {name: interactive, value: 1000}
fairShare:
  users: true
teams:
  - {name: vision, displayName: Vision Lab, groups: [vision-lab], defaultPriority: interactive,
     quota: {cpu: 4, memory: 8Gi, gpus: {l4: {nominal: 2}}}, perUser: {maxGPUs: 1}}
roles:
  admins: [platform-admins]
profiles:
  - {slug: l4-1, displayName: One L4, cpu: 1, memory: 2Gi, gpu: {count: 1, flavor: l4}, teams: [vision]}
"""

backend = backend_fixture(POLICY)
VISION = parse_policy(POLICY).team("vision")


@pytest.fixture(scope="module")
def kube_hub(backend, tmp_path_factory):
    hub = Hub(
        tmp_path_factory.mktemp(f"kube-user-queues-{backend.name}"),
        POLICY,
        extra_config=backend.hub_config(),
        env={"KUBECONFIG": str(backend.kubeconfig)},
    )
    try:
        hub.start()
        yield hub
    finally:
        hub.stop()


def local_queues(backend) -> dict[str, dict]:
    if backend.name == "double":
        items = backend.double.list("localqueues", NAMESPACE)
    else:
        items = backend.cluster.list("localqueues", NAMESPACE)
    return {q["metadata"]["name"]: q for q in items}


def test_each_user_queues_in_a_localqueue_of_their_own_made_by_the_hub_and_removed_at_offboarding(kube_hub, backend):
    alice, bob, admin = kube_hub.login("alice"), kube_hub.login("bob"), kube_hub.login("admin")
    mine = {u: user_queue_name(VISION, u) for u in ("alice", "bob")}
    assert not set(mine.values()) & set(local_queues(backend)), "no user queue before the first start"

    for user in (alice, bob):
        assert user.start("l4-1").status_code in (201, 202)
    for user in (alice, bob):
        user.wait_ready()
    queues = local_queues(backend)
    for name, queue in mine.items():
        [pod] = backend.pods(name)
        assert pod["metadata"]["labels"][QUEUE_LABEL] == queue, pod["metadata"]["labels"]
        lq = queues[queue]
        assert lq["spec"]["clusterQueue"] == "vision" and lq["metadata"]["annotations"]["gpuhub.io/user"] == name, lq
    assert "vision" in queues  # the team's own queue, from `gpuhub render kueue`, is still there

    # lena waits (Vision's 2 L4s are held): her place is the team's queue's, from the visibility
    # API of her own queue (positionInClusterQueue), not "1st of 1" in a queue of her own.
    lena = kube_hub.login("lena")
    pending = lena.start_background("l4-1")
    events = lena.progress(until=lambda e: "in the Vision Lab queue" in e.get("message", ""), timeout=90)
    assert events[-1]["message"].endswith("You are 1st in the Vision Lab queue."), events
    assert pending.result(timeout=90).status_code in (201, 202)
    lena.stop()
    lena.wait_gone()

    # A second start: the queue exists (409), the server starts in it again.
    uid = queues[mine["alice"]]["metadata"]["uid"]
    alice.stop()
    wait_for(lambda: not backend.pods("alice"), 60, "alice's pod gone")
    assert alice.start("l4-1").status_code in (201, 202)
    alice.wait_ready()
    assert local_queues(backend)[mine["alice"]]["metadata"]["uid"] == uid, "alice's queue (and its usage record) kept"

    # Off-boarding bob: his server stops and his queue goes; alice's stays.
    r = admin.api.post(admin.url("/gpuhub/users/bob/offboard"))
    assert r.status_code == 200, r.text
    steps = {s["step"]: s for s in r.json()["steps"]}
    assert steps["queues"].get("done") == f"deleted 1 LocalQueue(s) of their own: {mine['bob']}", steps
    queues = local_queues(backend)
    assert mine["bob"] not in queues and mine["alice"] in queues
    alice.stop()
    backend.healthy()  # real plane: no request of the hub refused by RBAC, each one a listed right
