"""Read the utilisation of specific GPUs with nvidia-ml-py (hub side, one machine).

The hub assigned the devices itself, so it reads them directly rather than trusting a
number the user's own server reports.
"""

from __future__ import annotations

import logging

log = logging.getLogger("JupyterHub.gpuhub.gpu")


def read_utilization(device_ids: list[str]) -> dict[str, int] | None:
    """Percent utilisation per device id (UUID or index); None when NVML is absent."""
    if not device_ids:
        return {}
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # no driver, virtual GPUs
        log.debug("NVML unavailable: %s", e)
        return None
    try:
        out = {}
        for dev in device_ids:
            try:
                handle = (
                    pynvml.nvmlDeviceGetHandleByIndex(int(dev))
                    if dev.isdigit()
                    else pynvml.nvmlDeviceGetHandleByUUID(dev)
                )
                out[dev] = int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except pynvml.NVMLError as e:
                log.warning("Cannot read GPU %s: %s", dev, e)
        return out or None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
