"""A small stand-in for nvidia-ml-py's ``pynvml``, for machines without a GPU.

Tests put this directory first on ``PYTHONPATH`` so product code imports it as
``pynvml`` unchanged. Devices and their readings come from the JSON file named by
``GPUHUB_FAKE_NVML``, re-read on every call so a test can change utilisation, inject
faults and script events while the hub and servers run::

    {"devices": [{"uuid": "GPU-fake-0", "name": "NVIDIA Fake A100",
                  "memory_total": 85899345920, "memory_used": 0, "utilization": 0,
                  # health signals (all optional):
                  "ecc_uncorrected_volatile": 0,          # nvmlDeviceGetTotalEccErrors
                  "remapped_rows": [0, 0, 0, 0],           # corr, unc, pending, failure
                  "retired_pages_pending": 0,              # nvmlDeviceGetRetiredPagesPendingStatus
                  "recovery_action": 0,                    # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
                  "lost": false,                           # every call on it: GPU is lost
                  "not_supported": ["remapped_rows"],      # these calls raise NotSupported
                  "events": [{"id": 1, "type": 8, "data": 79}],   # 8: nvmlEventTypeXidCriticalError
                  # MIG (optional): mode on, and the slices (MIG devices) as NVML lists them
                  "mig": {"enabled": true, "max": 7,
                          "devices": [{"uuid": "MIG-...", "name": "NVIDIA A100-SXM4-80GB MIG 1g.10gb",
                                       "memory_total": 10200547328, "gi": 7, "ci": 0,
                                       "utilization": 80}]},   # read only through GPM, below
                  "gpm": true}],                              # GPM (Hopper and later: H100, H200)
     # the driver (optional): its version, and the newest CUDA it supports as NVML packs it
     "driver": {"version": "550.54.15", "cuda": 12040}}

A MIG device's handle is ``("mig", gpu index, slice index)``. As real NVML, a slice reports
no utilisation (``nvmlDeviceGetUtilizationRates`` raises NotSupported on it) and its health
comes from its parent GPU. A GPU with ``"gpm": true`` has GPM (``nvmlGpmQueryDeviceSupport``),
as a Hopper GPU does and an A100 does not: a slice's ``utilization`` is then its
``NVML_GPM_METRIC_GRAPHICS_UTIL`` between two ``nvmlGpmMigSampleGet`` samples of its GPU
instance (the value when the second sample was taken). A slice without ``utilization`` on a
GPM GPU has no reading (the metric's ``nvmlReturn`` is NotSupported).

An event set delivers each event (by ``id``) once, and only events added after the device
was registered with it, as the driver does. Errors are raised as nvidia-ml-py raises them:
``NVMLError(code)``, which becomes the code's subclass (``NVMLError_Timeout``, ...) with
``.value``. Init is reference-counted like the real library.

Only the calls gpuhub makes are implemented; anything else raises, so a new NVML call
in product code fails loudly here instead of silently passing.
"""

import json
import os
import string
import threading
import time
from types import SimpleNamespace

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_UNKNOWN = 999

NVML_DEVICE_MIG_ENABLE = 1
NVML_DEVICE_MIG_DISABLE = 0
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1

NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1

NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
NVML_GPU_RECOVERY_ACTION_NONE = 0
NVML_GPU_RECOVERY_ACTION_GPU_RESET = 1
NVML_GPU_RECOVERY_ACTION_NODE_REBOOT = 2
NVML_GPU_RECOVERY_ACTION_DRAIN_P2P = 3
NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET = 4

nvmlEventTypeSingleBitEccError = 0x0000000000000001
nvmlEventTypeDoubleBitEccError = 0x0000000000000002
nvmlEventTypePState = 0x0000000000000004
nvmlEventTypeXidCriticalError = 0x0000000000000008
nvmlEventTypeClock = 0x0000000000000010
nvmlEventTypeNone = 0x0000000000000000
_SUPPORTED_EVENTS = nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError | nvmlEventTypeXidCriticalError


class NVMLError(Exception):
    """As nvidia-ml-py's: ``NVMLError(code)`` is an instance of the code's subclass."""

    _valClassMapping = dict()
    _errcode_to_string = {
        NVML_ERROR_UNINITIALIZED: "Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED: "Not Supported",
        NVML_ERROR_NOT_FOUND: "Not Found",
        NVML_ERROR_TIMEOUT: "Timeout",
        NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
        NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
        NVML_ERROR_UNKNOWN: "Unknown Error",
    }

    def __new__(typ, value):
        if typ == NVMLError:
            typ = NVMLError._valClassMapping.get(value, typ)
        obj = Exception.__new__(typ)
        obj.value = value
        return obj

    def __str__(self):
        return NVMLError._errcode_to_string.get(self.value, "NVML Error with code %d" % self.value)

    def __eq__(self, other):
        return self.value == other.value

    def __hash__(self):
        return hash(self.value)


def _extractNVMLErrorsAsClasses():
    names = globals()
    for err_name in [x for x in list(names) if x.startswith("NVML_ERROR_")]:
        class_name = "NVMLError_" + string.capwords(err_name.replace("NVML_ERROR_", ""), "_").replace("_", "")
        err_val = names[err_name]

        def gen_new(val):
            def new(typ, *args):
                return NVMLError.__new__(typ, val)

            return new

        cls = type(class_name, (NVMLError,), {"__new__": gen_new(err_val)})
        cls.__module__ = __name__
        names[class_name] = cls
        NVMLError._valClassMapping[err_val] = cls


_extractNVMLErrorsAsClasses()

_refcount = 0
_lock = threading.Lock()


def _state():
    path = os.environ.get("GPUHUB_FAKE_NVML")
    if not path:
        raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
    with open(path) as f:
        return json.load(f)


def _devices():
    return _state()["devices"]


def nvmlInit():
    global _refcount
    _devices()
    with _lock:
        _refcount += 1


def nvmlShutdown():
    global _refcount
    with _lock:
        if _refcount <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        _refcount -= 1


def _check():
    if _refcount <= 0:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)


def nvmlDeviceGetCount():
    _check()
    return len(_devices())


# The driver: {"driver": {"version": "550.54.15", "cuda": 12040}} (CUDA as NVML packs it,
# 1000 * major + 10 * minor); without it, a 550 driver that supports CUDA 12.4.
def nvmlSystemGetDriverVersion():
    _check()
    return str((_state().get("driver") or {}).get("version", "550.54.15"))


def nvmlSystemGetCudaDriverVersion():
    _check()
    return int((_state().get("driver") or {}).get("cuda", 12040))


def nvmlSystemGetCudaDriverVersion_v2():
    return nvmlSystemGetCudaDriverVersion()


def nvmlDeviceGetHandleByIndex(index):
    _check()
    devices = _devices()
    if not 0 <= index < len(devices):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return ("fake", index)


def nvmlDeviceGetHandleByUUID(uuid):
    _check()
    if isinstance(uuid, bytes):
        uuid = uuid.decode()
    for i, d in enumerate(_devices()):
        if d["uuid"] == uuid:
            return ("fake", i)
        for m, s in enumerate(_slices(d)):
            if s["uuid"] == uuid:
                return ("mig", i, m)
    raise NVMLError(NVML_ERROR_NOT_FOUND)


def _slices(d):
    mig = d.get("mig") or {}
    return mig.get("devices", []) if mig.get("enabled") else []


def _slice(handle):
    _get(("fake", handle[1]))  # a lost parent loses its slices
    try:
        return _slices(_devices()[handle[1]])[handle[2]]
    except IndexError:
        raise NVMLError(NVML_ERROR_NOT_FOUND) from None  # the layout changed under the handle


def _get(handle, signal=None):
    _check()
    if handle[0] == "mig":
        return _slice(handle)
    d = _devices()[handle[1]]
    if d.get("lost"):
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    if d.get("reset_required"):
        raise NVMLError(NVML_ERROR_RESET_REQUIRED)
    if signal is not None and signal in d.get("not_supported", ()):
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return d


def nvmlDeviceGetUUID(handle):
    _check()
    if handle[0] == "mig":
        return _slice(handle)["uuid"]
    return _devices()[handle[1]]["uuid"]  # answered even for a lost GPU, as NVML does from its cache


def nvmlDeviceGetName(handle):
    return _get(handle).get("name", "NVIDIA Fake GPU")


def nvmlDeviceGetMemoryInfo(handle, version=None):
    d = _get(handle)
    total = d.get("memory_total", 80 * 2**30)
    used = d.get("memory_used", 0)
    return SimpleNamespace(total=total, used=used, free=total - used)


def nvmlDeviceGetUtilizationRates(handle):
    d = _get(handle)
    if handle[0] == "mig" or _slices(d):  # NVML measures neither a slice nor a GPU split into slices
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return SimpleNamespace(gpu=int(d.get("utilization", 0)), memory=int(d.get("memory_utilization", 0)))


# -- MIG ---------------------------------------------------------------------------------------
def nvmlDeviceGetMigMode(device):
    d = _get(device)
    if "mig" not in d:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    mode = NVML_DEVICE_MIG_ENABLE if d["mig"].get("enabled") else NVML_DEVICE_MIG_DISABLE
    return [mode, mode]


def nvmlDeviceIsMigDeviceHandle(device):
    _check()
    return 1 if device[0] == "mig" else 0


def nvmlDeviceGetMaxMigDeviceCount(device):
    d = _get(device)
    return int((d.get("mig") or {}).get("max", 7))


def nvmlDeviceGetMigDeviceHandleByIndex(device, index):
    d = _get(device)
    if not 0 <= index < len(_slices(d)):
        raise NVMLError(NVML_ERROR_NOT_FOUND)
    return ("mig", device[1], index)


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(migDevice):
    _slice(migDevice)
    return ("fake", migDevice[1])


def nvmlDeviceGetGpuInstanceId(device):
    if device[0] != "mig":
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return int(_slice(device).get("gi", device[2] + 1))


def nvmlDeviceGetComputeInstanceId(device):
    if device[0] != "mig":
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return int(_slice(device).get("ci", 0))


# -- GPM (GPU performance monitoring: Hopper and later) ----------------------------------------
NVML_GPM_METRICS_GET_VERSION = 1
NVML_GPM_SUPPORT_VERSION = 1
NVML_GPM_METRIC_GRAPHICS_UTIL = 1
NVML_GPM_METRIC_SM_UTIL = 2
_GPM_METRIC_SLOTS = 8  # the real struct holds NVML_GPM_METRIC_MAX; gpuhub asks for one


class _GpmSample:
    def __init__(self):
        self.source = None  # (gpu index, gpu instance id or None for the whole GPU)
        self.reading = None
        self.at = None
        self.freed = False


def nvmlGpmSampleAlloc():
    _check()
    return _GpmSample()


def nvmlGpmSampleFree(gpmSample):
    if gpmSample.freed:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    gpmSample.freed = True


def nvmlGpmQueryDeviceSupport(device):
    d = _get(device)
    if device[0] == "mig":
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)  # asked of the parent GPU, as the real one
    return SimpleNamespace(version=NVML_GPM_SUPPORT_VERSION, isSupportedDevice=1 if d.get("gpm") else 0)


def _gpm_take(sample, source, reading):
    if sample.freed:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    sample.source, sample.reading, sample.at = source, reading, time.monotonic()
    return sample


def nvmlGpmSampleGet(device, gpmSample):
    d = _get(device)
    if device[0] == "mig" or not d.get("gpm"):
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return _gpm_take(gpmSample, (device[1], None), d.get("utilization"))


def nvmlGpmMigSampleGet(device, gpuInstanceId, gpmSample):
    d = _get(device)
    if device[0] == "mig":
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)  # the parent GPU and a GPU instance id
    if not d.get("gpm"):
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    for m, sl in enumerate(_slices(d)):
        if int(sl.get("gi", m + 1)) == int(gpuInstanceId):
            return _gpm_take(gpmSample, (device[1], int(gpuInstanceId)), sl.get("utilization"))
    raise NVMLError(NVML_ERROR_NOT_FOUND)


class c_nvmlGpmMetricsGet_t:
    """As nvidia-ml-py's ctypes struct, for what gpuhub touches: version, numMetrics, sample1,
    sample2 and ``metrics[i]`` with metricId in, nvmlReturn and value out."""

    def __init__(self):
        self.version = 0
        self.numMetrics = 0
        self.sample1 = self.sample2 = None
        self.metrics = [SimpleNamespace(metricId=0, nvmlReturn=NVML_SUCCESS, value=0.0) for _ in range(_GPM_METRIC_SLOTS)]


def nvmlGpmMetricsGet(metricsGet):
    _check()
    a, b = metricsGet.sample1, metricsGet.sample2
    if (
        metricsGet.version != NVML_GPM_METRICS_GET_VERSION
        or a is None
        or b is None
        or a.freed
        or b.freed
        or a.at is None
        or b.at is None
        or a.source != b.source
        or not 0 < metricsGet.numMetrics <= _GPM_METRIC_SLOTS
    ):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    for metric in metricsGet.metrics[: metricsGet.numMetrics]:
        if metric.metricId in (NVML_GPM_METRIC_GRAPHICS_UTIL, NVML_GPM_METRIC_SM_UTIL) and b.reading is not None:
            metric.nvmlReturn, metric.value = NVML_SUCCESS, float(b.reading)
        else:
            metric.nvmlReturn, metric.value = NVML_ERROR_NOT_SUPPORTED, 0.0
    return metricsGet


# -- health signals --------------------------------------------------------------------------
def nvmlDeviceGetTotalEccErrors(handle, errorType, counterType):
    d = _get(handle, "ecc")
    if errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED and counterType == NVML_VOLATILE_ECC:
        return int(d.get("ecc_uncorrected_volatile", 0))
    if errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED and counterType == NVML_AGGREGATE_ECC:
        return int(d.get("ecc_uncorrected_aggregate", d.get("ecc_uncorrected_volatile", 0)))
    return int(d.get("ecc_corrected", 0))


def nvmlDeviceGetRemappedRows(device):
    d = _get(device, "remapped_rows")
    corr, unc, pending, failure = (list(d.get("remapped_rows", [])) + [0, 0, 0, 0])[:4]
    return (int(corr), int(unc), int(pending), int(failure))


def nvmlDeviceGetRetiredPagesPendingStatus(device):
    d = _get(device, "retired_pages")
    return NVML_FEATURE_ENABLED if d.get("retired_pages_pending") else NVML_FEATURE_DISABLED


def nvmlDeviceGetFieldValues(handle, fieldIds):
    d = _get(handle)
    out = []
    for fid in fieldIds:
        fid, scope = fid if isinstance(fid, tuple) else (fid, 0)
        if fid == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and "recovery_action" not in d.get("not_supported", ()):
            ret, val = NVML_SUCCESS, int(d.get("recovery_action", 0))
        else:
            ret, val = NVML_ERROR_NOT_SUPPORTED, 0
        out.append(
            SimpleNamespace(
                fieldId=fid,
                scopeId=scope,
                timestamp=int(time.time() * 1e6),
                latencyUsec=0,
                valueType=1,
                nvmlReturn=ret,
                value=SimpleNamespace(uiVal=val, ullVal=val),
            )
        )
    return out


# -- events ----------------------------------------------------------------------------------
class _EventSet:
    def __init__(self):
        self.registered = {}  # device index -> event mask
        self.delivered = set()  # (index, event id)


def nvmlEventSetCreate():
    _check()
    return _EventSet()


def nvmlDeviceGetSupportedEventTypes(handle):
    _get(handle)
    return _SUPPORTED_EVENTS


def nvmlDeviceRegisterEvents(handle, eventTypes, eventSet):
    d = _get(handle)
    if eventTypes & ~_SUPPORTED_EVENTS:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    eventSet.registered[handle[1]] = eventSet.registered.get(handle[1], 0) | eventTypes
    for e in d.get("events", []):  # only events after registration are delivered
        eventSet.delivered.add((handle[1], e["id"]))


def nvmlEventSetWait(eventSet, timeoutms):
    return nvmlEventSetWait_v2(eventSet, timeoutms)


def nvmlEventSetWait_v2(eventSet, timeoutms):
    _check()
    deadline = time.monotonic() + timeoutms / 1000
    while True:
        for index, mask in eventSet.registered.items():
            try:
                d = _devices()[index]
            except (IndexError, OSError, ValueError):
                continue
            for e in d.get("events", []):
                if (index, e["id"]) in eventSet.delivered or not e.get("type", nvmlEventTypeXidCriticalError) & mask:
                    continue
                eventSet.delivered.add((index, e["id"]))
                return SimpleNamespace(
                    device=("fake", index),
                    eventType=e.get("type", nvmlEventTypeXidCriticalError),
                    eventData=int(e.get("data", 0)),
                    gpuInstanceId=0xFFFFFFFF,
                    computeInstanceId=0xFFFFFFFF,
                )
        if time.monotonic() >= deadline:
            raise NVMLError(NVML_ERROR_TIMEOUT)
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def nvmlEventSetFree(eventSet):
    eventSet.registered.clear()


def __getattr__(name):
    raise AttributeError(f"fake pynvml does not implement {name}; add it to tests/support/fake_nvml/pynvml.py")
