"""On a machine with a real NVIDIA GPU: every signal gpuhub's GPU health monitor reads, read
from the driver with the monitor's own code (docs/gpu-health.md).

Not part of the suite (no GPU in CI). Run on a GPU host from the repo root:
    PYTHONPATH=spawner python3 tests/device/health_check.py [OUT_DIR]

For each GPU NVML lists:

- the polled counters through ``local.gpu_health.read_counters`` (what the hub reads every
  ``health.pollInterval``): volatile uncorrected ECC errors, remapped rows (pending, failure),
  retired pages pending, the driver's recovery action, lost / reset required; each one says
  whether this GPU and driver answer it (``None``: not supported, skipped by the monitor);
- the XID event registration the monitor's event thread makes: which of
  ``nvmlEventTypeXidCriticalError | nvmlEventTypeDoubleBitEccError`` the GPU supports, that
  ``nvmlDeviceRegisterEvents`` takes them, and that ``nvmlEventSetWait`` times out cleanly on a
  quiet GPU (no event pending);
- what ``admission.health.classify_counters`` makes of the readings (a healthy GPU: nothing).

What a real GPU cannot be made to do on demand is listed, not faked: an XID 79 or any critical
XID, a double-bit ECC error, a pending or failed row remap, a pending page retirement, a
recovery action, a GPU falling off the bus. Those paths are covered with the fake NVML
(tests/unit/test_gpu_health.py, tests/integration/test_gpu_health_hub.py).

Without a GPU (no nvidia-ml-py, no driver, or no device) it says so, lists what it could not
read, and exits 0: there is nothing to check, and nothing failed.
"""

from __future__ import annotations

import json
import os
import sys
import time

NOT_INJECTABLE = [
    "XID events (79 fallen off the bus, 48 DBE, 94/95 contained/uncontained ECC, 13 application...): "
    "the driver raises them; nothing on a healthy GPU makes one on demand",
    "double-bit ECC event and a non-zero volatile uncorrected ECC count",
    "remapped rows pending / failure (needs a failing memory row)",
    "retired pages pending (needs a page retirement)",
    "a driver recovery action other than none (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION)",
    "NVML_ERROR_GPU_IS_LOST / NVML_ERROR_RESET_REQUIRED (a GPU fallen off the bus)",
]
POLLED = ["ecc_uncorrected", "remap_pending", "remap_failure", "retired_pages_pending", "recovery_action", "lost"]


def write(results: dict) -> None:
    text = json.dumps(results, indent=2, default=str)
    print(text)
    if len(sys.argv) > 1:
        with open(os.path.join(sys.argv[1], "health_check.json"), "w") as f:
            f.write(text)


def no_gpu(results: dict, why: str) -> int:
    results["gpu"] = None
    results["skipped"] = why
    results["not_read"] = [f"{name} (every GPU)" for name in POLLED] + [
        "XID / double-bit ECC event registration and nvmlEventSetWait"
    ]
    write(results)
    print(f"HEALTH CHECK SKIPPED: {why}")
    return 0


def text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def events_of(pynvml, handle) -> dict:
    """What the monitor's event thread (GpuHealthMonitor._events) does for one GPU, once."""
    out: dict = {}
    wanted = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
    eventset = pynvml.nvmlEventSetCreate()
    try:
        supported = pynvml.nvmlDeviceGetSupportedEventTypes(handle)
        out["supported_mask"] = hex(supported)
        out["xid_events_supported"] = bool(supported & pynvml.nvmlEventTypeXidCriticalError)
        out["dbe_events_supported"] = bool(supported & pynvml.nvmlEventTypeDoubleBitEccError)
        mask = wanted & supported
        pynvml.nvmlDeviceRegisterEvents(handle, mask, eventset)
        out["registered_mask"] = hex(mask)
        t0 = time.monotonic()
        try:
            event = pynvml.nvmlEventSetWait(eventset, 1000)
            # Not an error of this check: a real event was pending on this GPU. Say which.
            out["wait"] = {"event_type": hex(int(event.eventType)), "data": int(event.eventData)}
        except pynvml.NVMLError as e:
            out["wait"] = {
                "error": str(e),
                "timed_out": e.value == pynvml.NVML_ERROR_TIMEOUT,
                "seconds": round(time.monotonic() - t0, 2),
            }
    except pynvml.NVMLError as e:
        out["error"] = str(e)
    finally:
        try:
            pynvml.nvmlEventSetFree(eventset)
        except pynvml.NVMLError:
            pass
    return out


def main() -> int:
    results: dict = {"not_injectable": NOT_INJECTABLE}
    try:
        import pynvml  # nvidia-ml-py: the hub's own dependency
    except ImportError as e:
        return no_gpu(results, f"nvidia-ml-py is not installed ({e})")
    from gpuhub_spawner.admission.health import classify_counters
    from gpuhub_spawner.local.gpu_health import read_counters  # what the monitor polls

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return no_gpu(results, f"NVML cannot start: {e} (no NVIDIA driver on this machine)")
    try:
        count = pynvml.nvmlDeviceGetCount()
        results["driver"] = text(pynvml.nvmlSystemGetDriverVersion())
        results["recovery_action_field"] = getattr(pynvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if count == 0:
            return no_gpu(results, "NVML lists no GPU")
        gpus = []
        for i in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            g: dict = {"index": i, "uuid": text(pynvml.nvmlDeviceGetUUID(handle)), "name": text(pynvml.nvmlDeviceGetName(handle))}
            try:
                current, _pending = pynvml.nvmlDeviceGetEccMode(handle)
                g["ecc_enabled"] = current == pynvml.NVML_FEATURE_ENABLED
            except (pynvml.NVMLError, AttributeError) as e:  # AttributeError: a rehearsal on the fake NVML
                g["ecc_enabled"] = f"unknown ({e})"
            c = read_counters(pynvml, handle)
            g["counters"] = {name: getattr(c, name) for name in POLLED}
            g["not_supported"] = [name for name in POLLED[:-1] if getattr(c, name) is None]
            g["verdicts"] = classify_counters(c)
            g["events"] = events_of(pynvml, handle)
            gpus.append(g)
        results["gpus"] = gpus
    finally:
        pynvml.nvmlShutdown()

    problems = []
    for g in gpus:
        if g["counters"]["lost"]:
            problems.append(f"GPU {g['index']}: NVML says {g['counters']['lost']}")
        if "error" in g["events"]:
            problems.append(f"GPU {g['index']}: event registration failed: {g['events']['error']}")
        wait = g["events"].get("wait", {})
        if "error" in wait and not wait.get("timed_out"):
            problems.append(f"GPU {g['index']}: nvmlEventSetWait failed: {wait['error']}")
        if g["verdicts"]:
            # A real fault on the lent GPU: reported (the monitor would act on it), not a failure of gpuhub's code.
            print(f"NOTE: GPU {g['index']} reads as {g['verdicts']}: the hub would take it out or warn")
    results["problems"] = problems
    write(results)
    if problems:
        print("HEALTH CHECK FAILED")
        return 1
    print("HEALTH CHECK PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
