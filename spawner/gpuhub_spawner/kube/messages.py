"""Kueue's and the kubelet's state in plain words for the spawn page.

Researchers should read "waiting for 1 more A100 GPU, you are 2nd of 3 in the Vision
Lab queue", never "couldn't assign flavors to pod set main: ..." or "0/4 nodes are
available". Raw messages go to the hub log only. The patterns are built from the
message templates in ``kueue.py`` (copied from Kueue v0.19.2's source), so what is
parsed here is exactly what Kueue and the test double write.
"""

from __future__ import annotations

import re

from ..policy.access import Choice
from ..policy.mig import MIG_MEMORY_RESOURCE
from ..policy.model import Policy
from ..policy.quantities import format_memory, parse_cpu_millis, parse_memory_bytes
from . import kueue as K
from .kueue import ADMITTED, EVICTED, PREEMPTED, QUOTA_RESERVED, condition, is_true


def _pattern(template: str) -> re.Pattern:
    """A Kueue message template (``{name}`` fields) as a regex with one group per field."""
    out, pos = "", 0
    for m in re.finditer(r"\{(\w+)\}", template):
        out += re.escape(template[pos : m.start()]) + rf"(?P<{m.group(1)}>[^\s,()]+)"
        pos = m.end()
    return re.compile(out + re.escape(template[pos:]))


_SHORT = _pattern(K.MSG_UNUSED_QUOTA)
_NEVER = _pattern(K.MSG_MAX_CAPACITY)
_NO_RES = _pattern(K.MSG_RESOURCE_UNAVAILABLE)
_BLOCKED = [_pattern(t) for t in (K.MSG_LQ_MISSING, K.MSG_LQ_INACTIVE, K.MSG_CQ_MISSING, K.MSG_CQ_INACTIVE)]


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def amount(policy: Policy, resource: str, flavor: str | None, qty: str) -> str:
    """``("nvidia.com/gpu", "a100", "1")`` -> ``"1 A100 80GB GPU"``."""
    try:
        if resource == "cpu":
            millis = parse_cpu_millis(qty)
            cores = f"{millis / 1000:g}"
            return f"{cores} CPU core" + ("" if cores == "1" else "s")
        if resource == "memory":
            return f"{format_memory(parse_memory_bytes(qty))} of memory"
        if resource == MIG_MEMORY_RESOURCE:  # MIG slices a team counts in memory (docs/mig.md)
            return f"{format_memory(parse_memory_bytes(qty))} of MIG slice memory"
    except ValueError:
        return f"{qty} {resource}"
    gpu = next((f for f in policy.flavors if f.name == flavor), None)
    label = (gpu.display_name or gpu.name) if gpu else (flavor or resource)
    if gpu is not None and gpu.mig is not None:  # '1 A100 1g.10gb slice': a slice, never a GPU
        label = label if gpu.mig.profile in label else f"{label} {gpu.mig.profile}"
        return f"{qty} {label} slice" + ("" if qty == "1" else "s")
    return f"{qty} {label} GPU" + ("" if qty == "1" else "s")


def shortages(policy: Policy, message: str) -> tuple[list[str], list[str]]:
    """(resources short right now, requests that can never fit) parsed from Kueue's message."""
    short = [amount(policy, m["resource"], m["flavor"], m["more"]) for m in _SHORT.finditer(message or "")]
    never = [
        f"{amount(policy, m['resource'], m['flavor'], m['request'])} requested but the team can hold at most "
        f"{amount(policy, m['resource'], m['flavor'], m['capacity'])}"
        for m in _NEVER.finditer(message or "")
    ]
    never += [
        f"the team's queue has no quota for {m['resource']}"
        + (
            " (set by a LimitRange or the image? see docs/install-kubernetes.md)"
            if m["resource"] not in ("cpu", "memory")
            else ""
        )
        for m in _NO_RES.finditer(message or "")
    ]
    return short, never


def queue_blocked(message: str) -> bool:
    """True if Kueue says the LocalQueue/ClusterQueue is missing or inactive (any reason)."""
    return any(p.search(message or "") for p in _BLOCKED)


def waiting_message(
    policy: Policy,
    choice: Choice,
    workload: dict | None,
    pending: dict | None,
    queue_length: int | None,
    why: str | None = None,
    out_of_service: tuple[int, int] | None = None,
) -> str:
    """One sentence (two at most) about a gated pod's place in the queue.

    ``why``: what the request waits for in the hub's own words (``admission.quota``, from
    the ledger's view of Kueue: teammates' use, quota on loan, the cohort full), used when
    Kueue says the quota is short — Kueue's message only says how much is missing — and
    when Kueue has said nothing yet. ``out_of_service``: (GPUs out, GPUs on the cluster) of
    the request's flavor (``kube.capacity``), said while it waits for quota.
    """
    team = choice.team.label
    if workload is None:
        return f"Your server request was sent to team {team}'s queue; waiting for the queue to register it."
    reserved = condition(workload, QUOTA_RESERVED)
    if is_true(workload, QUOTA_RESERVED) or is_true(workload, ADMITTED):
        return "Quota granted; releasing your server to the scheduler."
    kueue_says = (reserved or {}).get("message", "")
    short, never = shortages(policy, kueue_says)
    taken = K.MSG_NO_LONGER_FITS in kueue_says  # it fitted, but another request took the quota first
    gone, total = out_of_service or (0, 0)
    if never and gone:  # the quota is lowered while GPUs are out (kube/capacity.py): not for ever
        label = amount(policy, "gpu", choice.flavor, "2").split(" ", 1)[1]
        return (
            f"Waiting: {gone} of {total} {label} on the cluster "
            f"{'is' if gone == 1 else 'are'} out of service (failed or drained), so team {team}'s queue "
            "cannot fit this server until they are back."
        )
    if never:
        return "This server can never start in team " + team + "'s queue: " + "; ".join(never) + ". Pick a smaller profile."
    if why and (short or taken or not kueue_says):
        # Kueue v0.19.2 writes its message on the first waiter of a shape in a scheduling
        # cycle only; the second and later get no QuotaReserved condition at all (N3, seen
        # on the real controller), so for them the hub's own words are all there is.
        text = f"Your server {why}."
    elif short:
        text = f"Waiting for quota: team {team} has no free capacity; {' and '.join(short)} more needed."
    elif taken:
        text = f"Waiting for quota: another request was admitted to the capacity team {team} could use."
    elif reserved and (
        queue_blocked(kueue_says) or reserved.get("reason") in (K.REASON_INADMISSIBLE, K.REASON_MISCONFIGURED, K.REASON_SUSPENDED)
    ):
        text = f"Waiting: team {team}'s queue is not accepting servers right now (an administrator has been told in the hub log)."
    else:
        text = f"Waiting for quota in team {team}'s queue."
    if gone:
        label = amount(policy, "gpu", choice.flavor, "2").split(" ", 1)[1]  # "L4 24GB GPUs"
        text += f" {gone} of {total} {label} on the cluster {'is' if gone == 1 else 'are'} out of service (failed or drained)."
    # With fairShare.users each user waits in a LocalQueue of their own (kube/render.py
    # queue_for): their place in the team's queue is the ClusterQueue's (Kueue orders it by
    # each user's recent use); the user's own queue's length is no length of the team's.
    own = policy.fair is not None and policy.fair.users
    where = "positionInClusterQueue" if own else "positionInLocalQueue"
    if pending is not None and pending.get(where) is not None:
        pos = int(pending[where]) + 1
        of = f" of {queue_length}" if queue_length and not own else ""
        text += f" You are {ordinal(pos)}{of} in the {team} queue."
    return text


_PREEMPTED_WHY = {
    K.PREEMPTED_IN_CLUSTER_QUEUE: "to make room for a higher-priority server of your team",
    K.PREEMPTED_IN_COHORT_RECLAMATION: "because it ran on capacity borrowed from another team, and that team needed it back",
    K.PREEMPTED_IN_COHORT_FAIR_SHARING: "to give another team its fair share of the shared capacity",
    K.PREEMPTED_IN_COHORT_RECLAIM_WHILE_BORROWING: "because a higher-priority server of another team needed the capacity",
}
_EVICTED_WHY = {
    K.EVICTED_BY_PREEMPTION: "Your server was stopped by the queue to make room for a higher-priority server. Start it again to rejoin the queue.",
    K.EVICTED_DEACTIVATED: "Your server was stopped because an administrator deactivated it in the queue.",
    K.EVICTED_BY_CLUSTER_QUEUE_STOPPED: "Your server was stopped because your team's queue was stopped by an administrator.",
    K.EVICTED_BY_LOCAL_QUEUE_STOPPED: "Your server was stopped because your team's queue was stopped by an administrator.",
    K.EVICTED_DUE_TO_NODE_FAILURES: "Your server was stopped because its node failed. Start it again to rejoin the queue.",
    K.EVICTED_BY_PODS_READY_TIMEOUT: (
        "Your server was stopped because it did not start in time after the queue gave it its GPUs "
        "(no node could run it, or its image could not be downloaded), and its GPUs went back to the queue. "
        "Start it again to rejoin the queue; if it happens again, tell an administrator."
    ),
}


def eviction_message(workload: dict | None, pod: dict | None) -> str | None:
    """Why Kueue stopped this server, or None if nothing says Kueue did."""
    preempted = condition(workload, PREEMPTED)
    evicted = condition(workload, EVICTED)
    if preempted and preempted.get("status") == "True":
        why = _PREEMPTED_WHY.get(preempted.get("reason", ""), "to make room for a higher-priority server")
        return f"Your server was stopped by the queue {why}. Your files in your home directory are kept; start it again to rejoin the queue."
    if evicted and evicted.get("status") == "True":
        reason = evicted.get("reason", "")
        return _EVICTED_WHY.get(reason) or f"Your server was stopped by the queue ({reason or 'evicted'})."
    for cond in ((pod or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") in (K.POD_TERMINATION_TARGET, "DisruptionTarget") and cond.get("status") == "True":
            reason = cond.get("reason") or ""
            prefix = K.STOP_REASON_WORKLOAD_EVICTED + "DueTo"
            if reason.startswith(prefix):
                return _EVICTED_WHY.get(reason[len(prefix) :]) or (
                    "Your server was stopped by the queue to make room for other work. Start it again to rejoin the queue."
                )
            if reason.startswith(K.STOP_REASON_WORKLOAD_EVICTED) or reason == K.STOP_REASON_WORKLOAD_DELETED:
                return "Your server was stopped by the queue. Start it again to rejoin the queue."
            if cond.get("reason") == "PreemptionByScheduler":
                return "Your server was stopped by the cluster scheduler to make room for a higher-priority pod."
            if cond.get("reason") in ("EvictionByEvictionAPI", "DeletionByTaintManager"):
                return "Your server was stopped because its node was drained or became unhealthy."
    return None


_EVENT_WORDS = {
    "Scheduled": (60, "A node was found for your server."),
    "Pulling": (70, "Downloading the server image (this can take a few minutes the first time on a node)."),
    "Pulled": (80, "Server image ready."),
    "Created": (85, "Server container created."),
    "Started": (90, "Server started; waiting for it to answer."),
    "FailedScheduling": (55, "Quota granted; waiting for a node with free resources (the cluster may be scaling up)."),
    "TriggeredScaleUp": (55, "Quota granted; the cluster is adding a node for your server."),
    "BackOff": (80, "The server keeps failing to start; an administrator can see why in the hub log."),
    "Failed": (80, "The server failed to start; an administrator can see why in the hub log."),
}


def event_message(event: dict) -> tuple[int, str] | None:
    """Plain words for a pod event after admission; None for events users need not see.

    Kueue records its own ``Started`` event ("Admitted by clusterQueue X") when it lifts
    the gate: that means admitted, not that the container started.
    """
    reason, message = event.get("reason", ""), event.get("message") or event.get("note") or ""
    if reason == K.EVENT_STARTED and message.startswith(K.msg_started("")):
        return (50, "Quota granted; your server is being placed on a node.")
    if reason in (K.EVENT_CREATED_WORKLOAD, K.EVENT_STOPPED):
        return None
    return _EVENT_WORDS.get(reason)
