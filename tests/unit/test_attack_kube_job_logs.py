"""From the tenant's seat: a job's output is the user's, and on Kubernetes the hub copies it
into its own memory and data directory (kube/job_manager.py ``_copy_log``,
``_copy_worker_logs``) on every read of a running job. A job that prints without end (or N
workers that each do) must not make the hub hold or write more than a bounded amount per
read: the hub asks the API server for a bounded log (``limitBytes``, the end of it by
``tailLines``), and keeps at most that of what comes back even if it were more."""

from __future__ import annotations

import asyncio
import time

from gpuhub_spawner.jobs import records as R
from gpuhub_spawner.kube.job_manager import MAX_POD_LOG_BYTES, KubeJobManager

HUGE = 12 * 1024 * 1024  # more than the kubelet's default containerLogMaxSize (10 Mi)


class FloodingPods:
    """CoreV1Api's ``read_namespaced_pod_log`` as the API server answers it: ``tailLines``
    then ``limitBytes`` (both optional), of a pod that printed ``size`` bytes."""

    def __init__(self, size: int = HUGE) -> None:
        self.lines = size // 120
        self.calls: list[dict] = []

    async def read_namespaced_pod_log(self, name, namespace, **kwargs):
        self.calls.append({"pod": name, **kwargs})
        text = "".join(f"{name} line {i:07d} {'x' * 100}\n" for i in range(self.lines))
        if kwargs.get("tail_lines") is not None:
            text = "".join(text.splitlines(keepends=True)[-int(kwargs["tail_lines"]) :])
        if kwargs.get("limit_bytes") is not None:
            text = text.encode()[: int(kwargs["limit_bytes"])].decode(errors="ignore")
        return text


def _manager(tmp_path, pods: FloodingPods) -> KubeJobManager:
    m = KubeJobManager(data_dir=str(tmp_path))
    m._client = lambda kind: pods  # type: ignore[method-assign]
    return m


def _record(workers: int) -> R.JobRecord:
    return R.JobRecord(
        id="job-00000000aa",
        user="u",
        team="t",
        profile={"slug": "cpu"},
        priority_class=None,
        priority=0,
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
        backend="kubernetes",
        workers=workers,
    )


def test_attack_one_pod_printing_without_end_is_copied_bounded(tmp_path):
    pods = FloodingPods()
    m = _manager(tmp_path, pods)
    rec = _record(1)
    att = R.Attempt(number=1, queued=time.time())
    asyncio.run(m._copy_log(rec, att, "ns", "job-00000000aa-abcde"))
    assert pods.calls and all(0 < (c.get("limit_bytes") or 0) <= MAX_POD_LOG_BYTES for c in pods.calls), pods.calls
    assert len(pods.calls) <= 3  # a cut answer is asked again with fewer lines, a bounded number of times
    size = (tmp_path / "jobs" / rec.id / "attempt-1.log").stat().st_size
    assert size <= MAX_POD_LOG_BYTES, size
    # The end of the output is kept (where a traceback is), not its beginning.
    assert (tmp_path / "jobs" / rec.id / "attempt-1.log").read_text().endswith(f"line {HUGE // 120 - 1:07d} {'x' * 100}\n")


def test_attack_many_workers_printing_without_end_are_copied_within_one_bound(tmp_path):
    n = 16
    pods = FloodingPods(2 * 1024 * 1024)  # 32 MiB in all: 8 times the bound
    m = _manager(tmp_path, pods)
    rec = _record(n)
    names = [f"job-00000000aa-{r}-pod" for r in range(n)]
    att = R.Attempt(number=1, queued=time.time())
    att.rendezvous = {"pods": list(names)}
    asyncio.run(m._copy_worker_logs(rec, att, "ns", names))
    assert {c["pod"] for c in pods.calls} == set(names) and len(pods.calls) <= 3 * n
    # What the hub asks for, all workers together, is one job's bound (not N of them).
    most = {name: max(c.get("limit_bytes") or HUGE for c in pods.calls if c["pod"] == name) for name in names}
    assert sum(most.values()) <= MAX_POD_LOG_BYTES, most
    assert all(c.get("limit_bytes") for c in pods.calls), pods.calls
    merged = (tmp_path / "jobs" / rec.id / "attempt-1.log").stat().st_size
    assert merged <= MAX_POD_LOG_BYTES + n * 200, merged  # each rank's header line besides
    text = (tmp_path / "jobs" / rec.id / "attempt-1.log").read_text()
    assert "[gpuhub] worker rank 15" in text
    # Each worker's last line is there (its traceback would be).
    assert all(f"{name} line {pods.lines - 1:07d}" in text for name in names)
