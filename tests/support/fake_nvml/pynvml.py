"""A small stand-in for nvidia-ml-py's ``pynvml``, for machines without a GPU.

Tests put this directory first on ``PYTHONPATH`` so product code imports it as
``pynvml`` unchanged. Devices and their readings come from the JSON file named by
``GPUHUB_FAKE_NVML``, re-read on every call so a test can change utilisation while
the hub and servers run::

    {"devices": [{"uuid": "GPU-fake-0", "name": "NVIDIA Fake A100",
                  "memory_total": 85899345920, "memory_used": 0, "utilization": 0}]}

Only the calls gpuhub makes are implemented; anything else raises, so a new NVML call
in product code fails loudly here instead of silently passing.
"""

import json
import os
from types import SimpleNamespace

NVML_DEVICE_MIG_ENABLE = 1
NVML_DEVICE_MIG_DISABLE = 0


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


_initialised = False


def _devices():
    path = os.environ.get("GPUHUB_FAKE_NVML")
    if not path:
        raise NVMLError("NVML Shared Library Not Found")
    with open(path) as f:
        return json.load(f)["devices"]


def nvmlInit():
    global _initialised
    _devices()
    _initialised = True


def nvmlShutdown():
    global _initialised
    _initialised = False


def _check():
    if not _initialised:
        raise NVMLError("Uninitialized")


def nvmlDeviceGetCount():
    _check()
    return len(_devices())


def nvmlDeviceGetHandleByIndex(index):
    _check()
    devices = _devices()
    if not 0 <= index < len(devices):
        raise NVMLError("Invalid Argument")
    return ("fake", index)


def nvmlDeviceGetHandleByUUID(uuid):
    _check()
    if isinstance(uuid, bytes):
        uuid = uuid.decode()
    for i, d in enumerate(_devices()):
        if d["uuid"] == uuid:
            return ("fake", i)
    raise NVMLError("Not Found")


def _get(handle):
    _check()
    return _devices()[handle[1]]


def nvmlDeviceGetUUID(handle):
    return _get(handle)["uuid"]


def nvmlDeviceGetName(handle):
    return _get(handle).get("name", "NVIDIA Fake GPU")


def nvmlDeviceGetMemoryInfo(handle):
    d = _get(handle)
    total = d.get("memory_total", 80 * 2**30)
    used = d.get("memory_used", 0)
    return SimpleNamespace(total=total, used=used, free=total - used)


def nvmlDeviceGetUtilizationRates(handle):
    d = _get(handle)
    return SimpleNamespace(gpu=int(d.get("utilization", 0)), memory=int(d.get("memory_utilization", 0)))


def nvmlDeviceGetMigMode(handle):
    _get(handle)
    raise NVMLError_NotSupported("Not Supported")


def __getattr__(name):
    raise AttributeError(f"fake pynvml does not implement {name}; add it to tests/support/fake_nvml/pynvml.py")
