"""The fake NVML's file (tests/support/fake_nvml): what the driver would say about each GPU,
written atomically so a hub reading it mid-test never sees half a file."""

from __future__ import annotations

import json
from pathlib import Path


FAKE_NVML_DIR = Path(__file__).resolve().parent / "fake_nvml"


def fake_nvml_env(nvml_file, **extra: str) -> dict[str, str]:
    """The environment that makes a hub, and every process it starts, import the fake
    ``pynvml`` (first on PYTHONPATH) and read the GPUs from ``nvml_file``."""
    return {"PYTHONPATH": str(FAKE_NVML_DIR), "GPUHUB_FAKE_NVML": str(nvml_file), **extra}


class FakeGpus:
    """``n`` GPUs ``GPU-fake-0``... as NVML reports them; ``set`` and ``xid`` change what it says."""

    def __init__(self, path: Path, n: int, utilization: int = 0, name: str = "NVIDIA Fake A100", memory_total: int = 80 * 2**30):
        self.path = path
        self.devices = [
            {
                "uuid": f"GPU-fake-{i}",
                "name": name,
                "memory_total": memory_total,
                "memory_used": 0,
                "utilization": utilization,
                "events": [],
            }
            for i in range(n)
        ]
        self._event = 0
        self.write()

    def write(self):
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"devices": self.devices}))
        tmp.replace(self.path)

    def _dev(self, which):
        """A device by its UUID or by the index the hub's status page shows."""
        return next(d for d in self.devices if d["uuid"] == which or d["uuid"].endswith(f"-{which}"))

    def xid(self, uuid, xid):
        self._event += 1
        self._dev(uuid)["events"].append({"id": self._event, "type": 8, "data": xid})  # nvmlEventTypeXidCriticalError
        self.write()

    def set(self, which, utilization: int | None = None, **fields):
        if utilization is not None:
            fields["utilization"] = utilization
        self._dev(which).update(fields)
        self.write()


def health_policy(gpus: int) -> str:
    """Vision Lab holding up to ``gpus`` of the fake NVML's A100s, one a server, GPU health
    polled every second: the GPU-health tests' policy (test_gpu_health_hub, test_gpu_health_ui)."""
    return _HEALTH_POLICY.replace("QUOTA", str(gpus))


_HEALTH_POLICY = """\
flavors:
  - name: a100
    displayName: A100
    local: {match: Fake}
teams:
  - name: vision
    displayName: Vision Lab
    groups: [vision-lab]
    quota: {gpus: {a100: QUOTA}}
roles:
  admins: [platform-admins]
profiles:
  - slug: gpu-1
    displayName: One A100
    cpu: 1
    memory: 1Gi
    gpu: {count: 1, flavor: a100}
    teams: [vision]
health:
  pollInterval: 1s
"""
