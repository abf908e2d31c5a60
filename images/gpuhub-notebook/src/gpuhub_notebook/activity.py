"""What this single-user server is doing: its GPUs (read with nvidia-ml-py), kernels and terminals.

The hub's culler reads it through ``GET <base_url>gpuhub/activity`` (see ``server_extension``)::

    {"gpus": [{"id": "GPU-...", "uuid": "GPU-...", "index": 0, "name": "...",
               "utilization": 37, "memory_used": 1234, "memory_total": 85899345920}],
     "sampled_at": 1700000000.0,
     "kernels": {"count": 2, "busy": 1, "last_activity": "2024-01-01T00:00:00.000000Z"},
     "terminals": {"count": 0, "last_activity": null}}

Visible GPUs are those CUDA would let this server use: the entries of ``CUDA_VISIBLE_DEVICES``
(GPU/MIG UUIDs, unique UUID prefixes, or NVML indices), every NVML device when it is unset, none
when it is empty. ``id`` is the entry exactly as the hub assigned it (the NVML UUID when the
variable is unset). Without NVML the answer is ``"gpus": []`` plus ``"error"``. A device whose
utilisation NVML cannot read (MIG instances) reports ``"utilization": null`` and its own
``"error"``: the culler should treat it as unknown, not as idle.

Tests put a fake ``pynvml`` first on ``PYTHONPATH``; the code path here is the same.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import datetime, timezone
from typing import Any

_nvml_lock = threading.Lock()
_nvml_ready = False


def visible_device_entries(environ=None) -> list[str] | None:
    """The ``CUDA_VISIBLE_DEVICES`` entries, or None when unset (all devices are visible).

    CUDA stops at the first entry it cannot parse; so do we.
    """
    env = os.environ if environ is None else environ
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    entries: list[str] = []
    for part in raw.split(","):
        part = part.strip()
        if not part:
            break
        if part.isdigit() or part.startswith(("GPU-", "MIG-")):
            entries.append(part)
        else:
            break  # e.g. "NoDevFiles", "-1", "void": nothing further is visible
    return entries


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml():
    """The initialised ``pynvml`` module (raises ImportError or NVMLError)."""
    global _nvml_ready
    import pynvml

    if not _nvml_ready:
        pynvml.nvmlInit()
        _nvml_ready = True
    return pynvml


def _handle(pynvml, entry: str):
    if entry.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
    try:
        return pynvml.nvmlDeviceGetHandleByUUID(entry)
    except pynvml.NVMLError:
        if not entry.startswith("GPU-"):
            raise
        # CUDA accepts a unique prefix of a GPU UUID.
        matches = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            if _text(pynvml.nvmlDeviceGetUUID(h)).startswith(entry):
                matches.append(h)
        if len(matches) != 1:
            raise
        return matches[0]


def _read_device(pynvml, entry: str | None, index: int | None) -> dict[str, Any]:
    handle = _handle(pynvml, entry) if entry is not None else pynvml.nvmlDeviceGetHandleByIndex(index)
    uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
    gpu: dict[str, Any] = {"id": entry if entry is not None else uuid, "uuid": uuid}
    if entry is not None and entry.isdigit():
        gpu["index"] = int(entry)
    elif index is not None:
        gpu["index"] = index
    try:
        gpu["name"] = _text(pynvml.nvmlDeviceGetName(handle))
    except pynvml.NVMLError:
        pass
    try:
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        gpu["memory_used"] = int(mem.used)
        gpu["memory_total"] = int(mem.total)
    except pynvml.NVMLError as e:
        gpu["memory_used"] = None
        gpu["error"] = f"memory: {e}"
    try:
        gpu["utilization"] = max(0, min(100, int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)))
    except pynvml.NVMLError as e:
        gpu["utilization"] = None
        gpu["error"] = f"utilization: {e}"
    return gpu


def read_gpus(environ=None) -> dict[str, Any]:
    """``{"gpus": [...], "sampled_at": epoch}`` plus ``"error"`` when NVML failed."""
    global _nvml_ready
    entries = visible_device_entries(environ)
    result: dict[str, Any] = {"gpus": [], "sampled_at": time.time()}
    if entries == []:
        return result
    with _nvml_lock:
        try:
            pynvml = _nvml()
        except ImportError:
            result["error"] = "nvidia-ml-py (pynvml) is not installed"
            return result
        except Exception as e:  # NVMLError: no driver, no library
            _nvml_ready = False
            result["error"] = f"NVML unavailable: {e}"
            return result
        errors = []
        try:
            if entries is None:
                targets = [(None, i) for i in range(pynvml.nvmlDeviceGetCount())]
            else:
                targets = [(e, None) for e in entries]
            for entry, index in targets:
                try:
                    result["gpus"].append(_read_device(pynvml, entry, index))
                except pynvml.NVMLError as e:
                    errors.append(f"{entry if entry is not None else index}: {e}")
        except pynvml.NVMLError as e:
            errors.append(str(e))
            _nvml_ready = False  # re-initialise on the next sample
        if errors:
            result["error"] = "; ".join(errors)
    result["sampled_at"] = time.time()
    return result


def _iso(dt: datetime | None) -> str | None:
    if dt is None:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


def _latest(times) -> datetime | None:
    aware = []
    for t in times:
        if isinstance(t, datetime):
            aware.append(t if t.tzinfo else t.replace(tzinfo=timezone.utc))
    return max(aware) if aware else None


def kernel_activity(kernel_manager) -> dict[str, Any]:
    if kernel_manager is None:
        return {"count": 0, "busy": 0, "last_activity": None}
    kernels = []
    for kid in list(kernel_manager.list_kernel_ids()):
        try:
            kernels.append(kernel_manager.get_kernel(kid))
        except KeyError:  # culled between the two calls
            continue
    busy = sum(1 for k in kernels if getattr(k, "execution_state", None) == "busy")
    last = _latest(getattr(k, "last_activity", None) for k in kernels)
    return {"count": len(kernels), "busy": busy, "last_activity": _iso(last)}


def terminal_activity(terminal_manager) -> dict[str, Any]:
    terminals = list(getattr(terminal_manager, "terminals", {}).values()) if terminal_manager else []
    last = _latest(getattr(t, "last_activity", None) for t in terminals)
    return {"count": len(terminals), "last_activity": _iso(last)}
