"""What the hub's mirror of Kueue (``kube.ledger``) says about one server request.

Kueue tells a waiting pod only how much quota is missing. The hub knows more: who uses
the team's quota, whether it is on loan, whether the cohort is full. ``why_waiting``
words a shortage as the one-machine queue does (``admission.quota.check_fit``).

``reclaim.interactiveBorrowing: false``: a team's servers and jobs share its
ClusterQueue, so Kueue would let a server borrow. ``shortage`` says whether a server fits
the team's own nominal quota, counting what Kueue admitted to the team, the team's
servers waiting in Kueue, and the servers this hub is creating (``claim``; one hub
process creates every server pod, so the count has no race).
"""

from __future__ import annotations

from ..admission.quota import add_usage, check_fit, demand_for

# Servers this hub is creating for teams whose servers may not borrow: key -> (team, demand).
_CLAIMS: dict[str, tuple[str, dict]] = {}


def claim(policy, choice, key: str) -> None:
    _CLAIMS[key] = (choice.team.name, demand_for(policy, choice.profile))


def release(key: str) -> None:
    _CLAIMS.pop(key, None)


def shortage(policy, choice, key: str, ledger) -> tuple[str | None, str | None]:
    """(why this server must wait, why it can never fit) with only its team's own quota."""
    team = choice.team
    if not team.cohort or policy.reclaim_rules(team).interactive_borrowing or not choice.gpu_count:
        return None, None
    queue = ledger.queue
    usage = queue.usage()
    extra = [d for k, (t, d) in _CLAIMS.items() if t == team.name and k != key and k not in queue.admitted]
    extra += [
        t.demand
        for t in queue.waiting
        if t.team == team.name and not t.key.startswith("job:") and t.key != key and t.key not in _CLAIMS
    ]
    for d in extra:
        add_usage(usage, team.name, dict(d))
    fit = check_fit(policy, usage, team, demand_for(policy, choice.profile), may_borrow=False)
    if fit.never:
        return None, fit.never
    return (None if fit.fits else "; ".join(s.reason for s in fit.shortages)), None


def why_waiting(policy, choice, key: str, ledger) -> str | None:
    """The one-machine words for a quota shortage Kueue reports, or None."""
    if ledger is None or not ledger.watching or key in ledger.queue.admitted:
        return None  # not mirrored yet, or admitted meanwhile: Kueue's words until the gate lifts
    fit = check_fit(policy, ledger.queue.usage(), choice.team, demand_for(policy, choice.profile))
    return None if fit.fits else "; ".join(s.reason for s in fit.shortages)
