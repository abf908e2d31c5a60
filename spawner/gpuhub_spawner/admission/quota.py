"""Does a request fit its team's quota? Kueue's arithmetic, without Kubernetes.

Resources are keyed ``cpu``, ``memory``, ``gpu/<flavor>`` and ``gpu_memory`` (the memory of a
request's MIG slices, by their shape's name: 1g.10gb is 10Gi; counted only for teams with
``quota.gpuMemory``, whose listed MIG flavors are then not counted in slices). Per key a team has a
nominal quota; in a cohort, the part above ``nominal - lendingLimit`` is pooled with
the other members, and a team may use pool capacity up to ``borrowingLimit`` above its
nominal. A team without a quota for cpu or memory is not limited on that key; a team
without a quota for a GPU flavor has a nominal of 0 (it may still borrow).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from ..policy.model import Policy, Profile, Team
from ..policy.quantities import format_cpu, format_memory

Demand = dict[str, int]
Usage = Mapping[str, Mapping[str, int]]  # team -> key -> amount admitted


GPU_MEMORY = "gpu_memory"  # the memory of MIG slices, for teams that count mixed shapes in memory


def gpu_key(flavor: str) -> str:
    return f"gpu/{flavor}"


def demand_for(policy: Policy, profile: Profile) -> Demand:
    demand = {
        "cpu": profile.cpu if profile.cpu is not None else policy.defaults.cpu,
        "memory": profile.memory if profile.memory is not None else policy.defaults.memory,
    }
    if profile.gpu and profile.gpu.count:
        demand[gpu_key(profile.gpu.flavor)] = profile.gpu.count
        flavor = next((f for f in policy.flavors if f.name == profile.gpu.flavor), None)
        if flavor is not None and flavor.mig is not None:
            demand[GPU_MEMORY] = profile.gpu.count * flavor.mig.memory
    return demand


@dataclass(frozen=True)
class _Limits:
    nominal: int
    borrowing_limit: int | None
    lending_limit: int | None

    @property
    def guaranteed(self) -> int:
        """The part no other team can borrow."""
        return self.nominal - (self.lending_limit if self.lending_limit is not None else self.nominal)

    @property
    def lendable(self) -> int:
        return self.nominal - self.guaranteed


def limits(team: Team, key: str) -> _Limits | None:
    if key.startswith("gpu/"):
        gm = team.quota.gpu_memory
        if gm is not None and key[4:] in gm.flavors:
            return None  # counted in memory (GPU_MEMORY), not in slices of its shape
        q = team.quota.gpus.get(key[4:])
        return _Limits(q.nominal, q.borrowing_limit, q.lending_limit) if q else _Limits(0, None, 0)
    q = getattr(team.quota, key)
    return _Limits(q.nominal, q.borrowing_limit, q.lending_limit) if q else None


def describe(key: str, amount: int, policy: Policy | None = None) -> str:
    if key == "cpu":
        return f"{format_cpu(amount)} CPU"
    if key == "memory":
        return f"{format_memory(amount)} memory"
    if key == GPU_MEMORY:
        return f"{format_memory(amount)} of MIG slice memory"
    flavor = key[4:]
    label = flavor
    if policy is not None:
        f = next((f for f in policy.flavors if f.name == flavor), None)
        label = (f.display_name or f.name) if f else flavor
        if f is not None and f.mig is not None:  # '7 A100 1g.10gb slices': a slice, never a GPU
            label = label if f.mig.profile in label else f"{label} {f.mig.profile}"
            return f"{amount} {label} slice{'s' if amount != 1 else ''}"
    return f"{amount} {label} GPU{'s' if amount != 1 else ''}"


@dataclass
class Shortage:
    key: str
    requested: int
    team_used: int
    nominal: int
    borrowable_now: int  # what the cohort could lend right now
    reason: str  # plain words
    capped: bool = False  # at the most the team may hold (not: the cohort has too little free now)


@dataclass
class Fit:
    fits: bool
    borrows: bool = False
    shortages: list[Shortage] = field(default_factory=list)
    never: str | None = None  # the request can never fit: refuse instead of queueing


def check_fit(policy: Policy, usage: Usage, team: Team, demand: Demand, may_borrow: bool = True) -> Fit:
    """Would ``demand`` fit now, given what every team has admitted (``usage``)?

    ``may_borrow=False``: only the team's own nominal quota counts (an interactive server
    of a team whose ``reclaim.interactiveBorrowing`` is false).
    """
    result = Fit(fits=True)
    members = policy.cohort_members(team)
    for key, amount in sorted(demand.items()):
        if amount <= 0:
            continue
        own = limits(team, key)
        if own is None:
            continue
        used = usage.get(team.name, {}).get(key, 0)
        after = used + amount
        if after > own.nominal:
            result.borrows = True
        ceiling = own.nominal
        pool_free = 0
        if team.cohort:
            pool_cap = pool_used = 0
            for m in members:
                lim = limits(m, key)
                if lim is None:
                    continue
                pool_cap += lim.lendable
                pool_used += max(0, usage.get(m.name, {}).get(key, 0) - lim.guaranteed)
            pool_free = pool_cap - pool_used
            borrow_cap = pool_cap - own.lendable
            if own.borrowing_limit is not None:
                borrow_cap = min(borrow_cap, own.borrowing_limit)
            ceiling = own.nominal + max(0, borrow_cap) if may_borrow else own.nominal
            need_from_pool = max(0, after - own.guaranteed) - max(0, used - own.guaranteed)
            fits_now = after <= ceiling and need_from_pool <= pool_free
        else:
            fits_now = after <= own.nominal
        if amount > ceiling:
            result.never = (
                f"{describe(key, amount, policy)} is more than team {team.name!r} can ever hold "
                f"({describe(key, ceiling, policy)} "
                + (
                    "including what it may borrow)."
                    if may_borrow or not team.cohort
                    else "of its own quota: its servers may not borrow; a batch job may)."
                )
            )
        if not fits_now:
            result.fits = False
            what = describe(key, amount, policy)
            n = (lambda v: format_memory(v)) if key == GPU_MEMORY else str  # noqa: E731
            if key == GPU_MEMORY:  # name the slices too: '10Gi of MIG slice memory (1 A100 1g.10gb slice)'
                slices = [describe(k, v, policy) for k, v in sorted(demand.items()) if k.startswith("gpu/")]
                what += f" ({', '.join(slices)})" if slices else ""
            if after > ceiling:
                why = f"your team {team.label} is using {n(used)} of the {n(ceiling)} it may hold"
                if ceiling > own.nominal:
                    why += f" (quota {n(own.nominal)}, may borrow {n(ceiling - own.nominal)})"
                elif team.cohort and not may_borrow:
                    why += " (its servers may not borrow from the cohort)"
                why += "; it waits until one of your team's servers or jobs stops"
            elif after <= own.nominal:
                why = (
                    f"{team.label}'s own quota ({n(own.nominal)}) is on loan to other teams of the "
                    f"{team.cohort} cohort; it comes back as they stop"
                )
            else:
                why = (
                    f"your team {team.label} uses its quota of {n(own.nominal)} and the {team.cohort} cohort "
                    f"has {n(max(0, pool_free))} free to lend (the other teams use their own quota)"
                )
            result.shortages.append(
                Shortage(key, amount, used, own.nominal, max(0, pool_free), f"needs {what}: {why}", after > ceiling)
            )
    return result


def add_usage(usage: dict[str, dict[str, int]], team: str, demand: Demand, sign: int = 1) -> None:
    bucket = usage.setdefault(team, {})
    for key, amount in demand.items():
        bucket[key] = bucket.get(key, 0) + sign * amount
