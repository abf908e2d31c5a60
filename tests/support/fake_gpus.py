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
    def __init__(self, path: Path, n: int, utilization: int = 0):
        self.path = path
        self.devices = [
            {
                "uuid": f"GPU-fake-{i}",
                "name": "NVIDIA Fake A100",
                "memory_total": 80 * 2**30,
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

    def _dev(self, uuid):
        return next(d for d in self.devices if d["uuid"] == uuid)

    def xid(self, uuid, xid):
        self._event += 1
        self._dev(uuid)["events"].append({"id": self._event, "type": 8, "data": xid})  # nvmlEventTypeXidCriticalError
        self.write()

    def set(self, uuid, **fields):
        self._dev(uuid).update(fields)
        self.write()
