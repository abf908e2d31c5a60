"""Per team and flavor quota metrics, computed from the live queue at scrape time.

A collector (not gauges set on events) so every series describes *now*: a team that
stops using a flavor reads 0, a team removed from the policy disappears, a released
device's utilisation series disappears. Counters that must accumulate (culls, warnings,
snoozes: ``culling/metrics.py``; waits: ``TEAM_WAIT`` below) stay ordinary metrics.
Served at ``/hub/metrics`` with JupyterHub's own (scope ``read:metrics``).
"""

from __future__ import annotations

import time

from prometheus_client import REGISTRY, Histogram
from prometheus_client.core import GaugeMetricFamily

TEAM_WAIT = Histogram(
    "gpuhub_team_admission_wait_seconds",
    "Time from request to admission, per team",
    ["team"],
    buckets=(1, 5, 30, 60, 300, 900, 1800, 3600, 7200, float("inf")),
)


def register(broker, recorder) -> None:
    """Scrapes describe ``broker``'s queue from now on (the hub's recorder attaches it)."""
    QUOTA.broker, QUOTA.recorder = broker, recorder


def lent_and_borrowed(policy, usage: dict[str, dict[str, int]], flavor: str) -> tuple[dict[str, int], dict[str, int]]:
    """Kueue's picture per cohort: what each team borrows above its nominal quota, and
    which teams' unused nominal quota lends it (lenders in policy order, each up to its
    lending limit)."""
    key = f"gpu/{flavor}"
    borrowed: dict[str, int] = {}
    lent: dict[str, int] = {}
    cohorts: dict[str, list] = {}
    for team in policy.teams:
        cohorts.setdefault(team.cohort or f"\0{team.name}", []).append(team)
    for members in cohorts.values():
        need = 0
        for t in members:
            q = t.quota.gpus.get(flavor)
            used = usage.get(t.name, {}).get(key, 0)
            b = max(0, used - (q.nominal if q else 0))
            borrowed[t.name] = b
            need += b
        for t in members:
            q = t.quota.gpus.get(flavor)
            if q is None:
                lent[t.name] = 0
                continue
            spare = max(0, q.nominal - usage.get(t.name, {}).get(key, 0))
            if q.lending_limit is not None:
                spare = min(spare, q.lending_limit)
            give = min(spare, need)
            lent[t.name] = give
            need -= give
    return lent, borrowed


class QuotaCollector:
    broker = None
    recorder = None

    def describe(self):
        return []  # collected lazily; nothing is known before the hub has a policy

    def collect(self):
        broker = self.broker
        if broker is None:
            return
        policy = broker.store.current
        queue = broker.queue
        usage = queue.usage()
        flavors = [f.name for f in policy.flavors]
        nominal = GaugeMetricFamily(
            "gpuhub_quota_nominal_gpus", "Nominal GPU quota per team and flavor", labels=["team", "flavor"]
        )
        in_use = GaugeMetricFamily("gpuhub_gpus_in_use", "GPUs admitted to a team's servers and jobs", labels=["team", "flavor"])
        borrowed = GaugeMetricFamily(
            "gpuhub_gpus_borrowed", "GPUs a team holds above its nominal quota (from its cohort)", labels=["team", "flavor"]
        )
        lent = GaugeMetricFamily(
            "gpuhub_gpus_lent", "A team's unused nominal GPUs that cohort members borrow", labels=["team", "flavor"]
        )
        waiting = GaugeMetricFamily("gpuhub_team_waiting", "Requests waiting for admission, per team", labels=["team"])
        oldest = GaugeMetricFamily(
            "gpuhub_team_oldest_wait_seconds", "How long the team's longest waiting request has waited", labels=["team"]
        )
        now = time.time()
        counts: dict[str, int] = {}
        first: dict[str, float] = {}
        for t in queue.waiting:
            counts[t.team] = counts.get(t.team, 0) + 1
            first[t.team] = min(first.get(t.team, now), t.created)
        for flavor in flavors:
            l, b = lent_and_borrowed(policy, usage, flavor)
            for team in policy.teams:
                q = team.quota.gpus.get(flavor)
                used = usage.get(team.name, {}).get(f"gpu/{flavor}", 0)
                if q is None and not used:
                    continue
                nominal.add_metric([team.name, flavor], q.nominal if q else 0)
                in_use.add_metric([team.name, flavor], used)
                borrowed.add_metric([team.name, flavor], b.get(team.name, 0))
                lent.add_metric([team.name, flavor], l.get(team.name, 0))
        for team in policy.teams:
            waiting.add_metric([team.name], counts.get(team.name, 0))
            oldest.add_metric([team.name], round(now - first[team.name], 3) if team.name in first else 0)
        yield from (nominal, in_use, borrowed, lent, waiting, oldest)
        yield from self._fair_share(policy, queue)

        if broker.devices is None:  # Kubernetes: Kueue counts quota; devices are the nodes' (DCGM)
            yield from self._policy_status(broker)
            return
        free = GaugeMetricFamily("gpuhub_free_devices", "Devices of a flavor on this machine nobody holds", labels=["flavor"])
        total = GaugeMetricFamily("gpuhub_devices", "Devices of a flavor on this machine", labels=["flavor"])
        for flavor in flavors:
            free.add_metric([flavor], len(broker.devices.free_devices(flavor)))
            total.add_metric([flavor], len([d for d in broker.devices.devices if d.flavor == flavor]))
        yield free
        yield total

        util = GaugeMetricFamily(
            "gpuhub_gpu_utilization_percent",
            "Utilisation of each held device at the last culler pass (trusted readings only)",
            labels=["device", "flavor", "team"],
        )
        readings = self.recorder.utilisation() if self.recorder else {}
        flavor_of = {d.id: d.flavor for d in broker.devices.devices}
        for adm in queue.holdings():
            for d in adm.devices:
                if d in readings:
                    util.add_metric([d, flavor_of.get(d, ""), adm.team], readings[d])
        yield util
        yield from self._policy_status(broker)

    @staticmethod
    def _fair_share(policy, queue):
        """Fair share's figures (docs/fair-share.md): each team's decayed GPU use and its weight."""
        ledger = getattr(queue, "fair", None)
        if policy.fair is None or ledger is None:
            return
        used = GaugeMetricFamily(
            "gpuhub_fair_share_recent_gpu_hours",
            "A team's recent GPU use: GPU-hours held, times the flavor weights, decayed by the fair-share half-life",
            labels=["team"],
        )
        weight = GaugeMetricFamily("gpuhub_fair_share_weight", "A team's fair-share weight", labels=["team"])
        share = GaugeMetricFamily(
            "gpuhub_fair_share_share", "A team's weight as a fraction of its cohort's (0-1)", labels=["team", "cohort"]
        )
        now = ledger.teams()
        for t in policy.teams:
            used.add_metric([t.name], round(now.get(t.name, 0.0) / 3600, 4))
            weight.add_metric([t.name], t.weight)
            share.add_metric([t.name, t.cohort or ""], round(policy.share_of(t), 6))
        yield from (used, weight, share)

    @staticmethod
    def _policy_status(broker):
        status = broker.store.status
        ok = GaugeMetricFamily(
            "gpuhub_policy_ok", "1 when the policy file on disk is the one in force, 0 when its last edit was refused"
        )
        ok.add_metric([], 0 if status.stale else 1)
        yield ok
        loaded = GaugeMetricFamily("gpuhub_policy_loaded_timestamp_seconds", "When the policy in force was loaded")
        loaded.add_metric([], status.loaded_at or 0)
        yield loaded


# One per process, registered at import like the histograms above (Prometheus's registry is
# the process's); it yields nothing until a hub's recorder hands it the admission view.
QUOTA = QuotaCollector()
REGISTRY.register(QUOTA)
