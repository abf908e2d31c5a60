"""What a waiting Kubernetes server is told for each state real Kueue v0.19.2 leaves on its
Workload (seen in tests/kube/test_kueue_real_vs_double.py): its message on the head of the
queue, none at all on later waiters of the same shape (N3), and "no longer fits" when
another request took the quota in the same cycle (N2)."""

from gpuhub_spawner.kube import kueue as K
from gpuhub_spawner.kube.messages import waiting_message
from gpuhub_spawner.policy import parse_policy
from gpuhub_spawner.policy.access import resolve_choice

POLICY = parse_policy("""\
flavors: [{name: l4, displayName: L4 24GB, local: {virtual: 2}}]
teams: [{name: vision, displayName: Vision Lab, groups: [v], cohort: lab, quota: {gpus: {l4: 1}}}]
profiles: [{slug: l4-1, displayName: One L4, gpu: {count: 1, flavor: l4}, teams: "*"}]
""")
CHOICE = resolve_choice(POLICY, ["v"], {"profile": "l4-1"})
WHY = "waits for 1 L4 24GB GPU: Vision Lab uses 1 of its 1"


def workload(message=None):
    conds = (
        [] if message is None else [{"type": K.QUOTA_RESERVED, "status": "False", "reason": K.REASON_PENDING, "message": message}]
    )
    return {"metadata": {"name": "pod-x"}, "status": {"conditions": conds}}


def words(wl, why=None, position=None, length=None):
    pending = {"positionInLocalQueue": position} if position is not None else None
    return waiting_message(POLICY, CHOICE, wl, pending, length, why)


def test_the_head_of_the_queue_gets_kueues_shortage_in_the_hubs_words():
    short = K.MSG_ASSIGN_PREFIX.format(podset="main") + K.MSG_UNUSED_QUOTA.format(
        resource="nvidia.com/gpu", flavor="l4", more="1"
    )
    assert words(workload(short), WHY, 0, 3) == f"Your server {WHY}. You are 1st of 3 in the Vision Lab queue."
    assert words(workload(short)) == "Waiting for quota: team Vision Lab has no free capacity; 1 L4 24GB GPU more needed."


def test_a_later_waiter_without_any_kueue_condition_is_still_told_why():
    assert words(workload(None), WHY, 2, 3) == f"Your server {WHY}. You are 3rd of 3 in the Vision Lab queue."
    assert (
        words(workload(None), None, 2, 3)
        == "Waiting for quota in team Vision Lab's queue. You are 3rd of 3 in the Vision Lab queue."
    )


def test_with_a_queue_per_user_the_place_is_the_teams_queue_not_the_users_own():
    """fairShare.users: the visibility API of the user's own LocalQueue says 1st of 1 there; the
    place that matters is positionInClusterQueue (Kueue's order of the team by recent use)."""
    from gpuhub_spawner.policy.model import FairShare

    policy = POLICY.model_copy(update={"fair_share": FairShare(users=True)})
    pending = {"positionInLocalQueue": 0, "positionInClusterQueue": 2}
    assert (
        waiting_message(policy, CHOICE, workload(None), pending, 1, WHY)
        == f"Your server {WHY}. You are 3rd in the Vision Lab queue."
    )
    assert (
        waiting_message(POLICY, CHOICE, workload(None), pending, 1, WHY)
        == f"Your server {WHY}. You are 1st of 1 in the Vision Lab queue."
    )


def test_a_request_another_took_the_quota_from_in_the_same_cycle():
    assert words(workload(K.MSG_NO_LONGER_FITS), WHY) == f"Your server {WHY}."
    assert words(workload(K.MSG_NO_LONGER_FITS)) == (
        "Waiting for quota: another request was admitted to the capacity team Vision Lab could use."
    )


def test_a_server_evicted_for_not_starting_in_time_is_told_so_in_plain_words():
    """What Kueue v0.19.2 leaves when waitForPodsReady's timeout evicts a server pod (seen on the
    real control plane in tests/kube/test_kueue_pods_ready.py): the Workload's Evicted reason, and
    on the pod, which Kueue then deletes, its TerminationTarget condition."""
    from gpuhub_spawner.kube.messages import eviction_message

    wl = {"status": {"conditions": [{"type": "Evicted", "status": "True", "reason": K.EVICTED_BY_PODS_READY_TIMEOUT}]}}
    pod = {
        "status": {
            "conditions": [{"type": K.POD_TERMINATION_TARGET, "status": "True", "reason": "WorkloadEvictedDueToPodsReadyTimeout"}]
        }
    }
    for words in (eviction_message(wl, None), eviction_message(None, pod)):
        assert words.startswith("Your server was stopped because it did not start in time after the queue gave it its GPUs")
        assert "Start it again" in words and "PodsReadyTimeout" not in words
