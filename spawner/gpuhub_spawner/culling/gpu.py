"""Trusted GPU utilisation for culling: read by the hub, never reported by a user's server.

A user controls their server's process, so whatever it says about its GPUs is theirs to
forge. The hub reads utilisation from a source the user cannot touch:

- one machine: NVML (nvidia-ml-py) in the hub process, for the devices the hub assigned;
- Kubernetes: NVIDIA's DCGM exporter (a privileged node DaemonSet, part of the GPU Operator)
  scraped by Prometheus; the hub queries Prometheus for the pod's GPUs.

No reading (virtual GPUs, NVML absent, Prometheus unreachable, a pod with no series) is
*unknown*, and unknown counts as idle: an idle GPU cannot be kept by hiding it.
"""

from __future__ import annotations

import json
import logging
from urllib.parse import urlencode

from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from traitlets import Float, Unicode
from traitlets.config import LoggingConfigurable

log = logging.getLogger("JupyterHub.gpuhub.gpu")


def read_nvml(device_ids: list[str]) -> dict[str, int]:
    """Percent utilisation per device id (UUID or index); {} when NVML is absent.

    Blocking (NVML is a C library): call it from a thread. One init per pass.
    """
    if not device_ids:
        return {}
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # no driver, virtual GPUs
        log.debug("NVML unavailable: %s", e)
        return {}
    out: dict[str, int] = {}
    try:
        for dev in device_ids:
            try:
                handle = (
                    pynvml.nvmlDeviceGetHandleByIndex(int(dev)) if dev.isdigit() else pynvml.nvmlDeviceGetHandleByUUID(dev)
                )
                out[dev] = int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except pynvml.NVMLError as e:  # a MIG slice has no utilisation: unknown
                log.debug("Cannot read GPU %s: %s", dev, e)
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return out


def parse_dcgm_vector(body: dict, metric_scale: float = 1.0) -> dict[tuple[str, str], float]:
    """``{(namespace, pod): max percent}`` from a Prometheus instant-vector answer.

    dcgm-exporter (with ``DCGM_EXPORTER_KUBERNETES=true``) labels each GPU series with the
    ``namespace``/``pod``/``container`` that holds the GPU. Scraped through a
    ServiceMonitor, Prometheus keeps the target's own ``namespace``/``pod`` (the exporter's)
    and renames the workload's to ``exported_namespace``/``exported_pod`` unless
    ``honorLabels`` is set; the exported labels win when present. A series without a pod
    (a GPU nobody holds) is ignored.
    """
    if body.get("status") != "success":
        raise ValueError(f"Prometheus answered {body.get('status')}: {body.get('error', '')}")
    out: dict[tuple[str, str], float] = {}
    for series in body.get("data", {}).get("result", []):
        labels = series.get("metric", {})
        pod = labels.get("exported_pod") or labels.get("pod")
        ns = labels.get("exported_namespace") or labels.get("namespace") or ""
        if not pod:
            continue
        try:
            value = float(series["value"][1]) * metric_scale
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if value != value:  # NaN
            continue
        key = (ns, pod)
        out[key] = max(out.get(key, 0.0), value)
    return out


class DcgmPrometheusReader(LoggingConfigurable):
    """GPU utilisation per pod from DCGM exporter metrics in Prometheus (Kubernetes)."""

    prometheus_url = Unicode(
        "", help="Prometheus base URL (e.g. http://prometheus-operated.monitoring:9090); empty: no GPU readings."
    ).tag(config=True)
    query = Unicode(
        "max by (namespace, pod, exported_namespace, exported_pod) "
        "(max_over_time(DCGM_FI_DEV_GPU_UTIL[{window}s]))",
        help="PromQL giving percent utilisation per pod; {window} is the culler's pass interval. "
        "For MIG slices use DCGM_FI_PROF_GR_ENGINE_ACTIVE (a ratio) with metric_scale=100.",
    ).tag(config=True)
    metric_scale = Float(1.0, help="Factor turning the query's values into percent.").tag(config=True)
    timeout = Float(10.0, help="Seconds to wait for Prometheus.").tag(config=True)

    async def read(self, pods: list[tuple[str, str]], window: float) -> dict[tuple[str, str], float]:
        if not self.prometheus_url or not pods:
            return {}
        q = self.query.format(window=max(30, int(window)))
        url = self.prometheus_url.rstrip("/") + "/api/v1/query?" + urlencode({"query": q})
        try:
            resp = await AsyncHTTPClient().fetch(HTTPRequest(url, request_timeout=self.timeout), raise_error=False)
            if resp.code != 200:
                raise ValueError(f"HTTP {resp.code}")
            values = parse_dcgm_vector(json.loads(resp.body), self.metric_scale)
        except Exception as e:
            log.warning("No GPU readings from Prometheus (%s): GPUs count as idle", e)
            return {}
        return {p: values[p] for p in pods if p in values}
