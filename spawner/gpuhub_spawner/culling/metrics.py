"""Prometheus series for culling, in prometheus_client's default registry (the hub's
``/hub/metrics`` serves it).

Gauges are set for every team of the policy on every pass, so a team whose GPUs stop
being idle (or that stops altogether) reads 0 instead of its last value.
"""

from prometheus_client import Counter, Gauge

WARNINGS = Counter("gpuhub_cull_warnings", "Cull warnings issued, by rule", ["rule"])
SNOOZES = Counter("gpuhub_cull_snoozes", "Snoozes used, by how (user click or the user coming back)", ["how"])
CULLS = Counter("gpuhub_culls", "Servers stopped by the culler, by rule", ["rule"])
IDLE_GPU_SECONDS = Counter("gpuhub_idle_gpu_seconds", "GPU-seconds held by servers whose GPUs read idle (or unknown)", ["team"])
IDLE_GPUS = Gauge("gpuhub_idle_gpus", "GPUs held by servers whose GPUs read idle (or unknown) at the last pass", ["team"])
PASS_SECONDS = Gauge("gpuhub_cull_pass_decision_seconds", "Hub time spent deciding the last culler pass")


class TeamGauge:
    """A per-team gauge that returns to zero for teams no longer reported."""

    def __init__(self, gauge: Gauge):
        self.gauge = gauge
        self.seen: set[str] = set()

    def publish(self, values: dict[str, float], teams: set[str]) -> None:
        for team in self.seen | teams | set(values):
            self.gauge.labels(team=team).set(values.get(team, 0))
        self.seen |= set(values) | teams


IDLE_GPUS_BY_TEAM = TeamGauge(IDLE_GPUS)
