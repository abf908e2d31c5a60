"""Trusted GPU utilisation for culling: read by the hub, never reported by a user's server.

A user controls their server's process, so whatever it says about its GPUs is theirs to
forge. The hub reads utilisation from a source the user cannot touch:

- one machine: NVML (nvidia-ml-py) in the hub process, for the devices the hub assigned. A MIG
  slice has no ``nvmlDeviceGetUtilizationRates``; where its parent GPU has GPM (Hopper and later:
  H100, H200, GH200) the slice's graphics-engine activity is read from two GPM samples of its GPU
  instance ``GPM_WINDOW`` apart, as DCGM's ``DCGM_FI_PROF_GR_ENGINE_ACTIVE``. An A100 has no GPM:
  its slices have no reading, and the profile's ``idle.gpuUnread`` decides (culling/rules.py);
- Kubernetes: NVIDIA's DCGM exporter (a privileged node DaemonSet, part of the GPU Operator)
  scraped by Prometheus; the hub queries Prometheus for the pod's GPUs.

No reading (virtual GPUs, NVML absent, Prometheus unreachable, a pod with no series) is
*unknown*, and unknown counts as idle: an idle GPU cannot be kept by hiding it.
"""

from __future__ import annotations

import json
import logging
import time
from urllib.parse import urlencode

from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from traitlets import Float, Unicode
from traitlets.config import LoggingConfigurable

log = logging.getLogger("JupyterHub.gpuhub.gpu")


GPM_WINDOW = 1.0  # seconds between a slice's two GPM samples (NVML's own utilisation spans 1/6 s to 1 s)


def read_nvml(device_ids: list[str], gpm_window: float = GPM_WINDOW) -> dict[str, int]:
    """Percent utilisation per device id (UUID or index); {} when NVML is absent.

    A MIG slice is read through GPM where its parent GPU has it (``read_gpm_slices``); a slice
    without (an A100's) is left out: no reading. Blocking (NVML is a C library, and a slice's
    reading takes ``gpm_window`` seconds, once for all slices): call it from a thread. One init
    per pass.
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
    slices: list[tuple[str, object]] = []
    try:
        for dev in device_ids:
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(dev)) if dev.isdigit() else pynvml.nvmlDeviceGetHandleByUUID(dev)
            except pynvml.NVMLError as e:
                log.debug("Cannot read GPU %s: %s", dev, e)
                continue
            try:
                out[dev] = int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except pynvml.NVMLError as e:  # a MIG slice has no utilisation rates: GPM, where there is
                if _is_mig(pynvml, handle):
                    slices.append((dev, handle))
                else:
                    log.debug("Cannot read GPU %s: %s", dev, e)
        if slices:
            out.update(read_gpm_slices(pynvml, slices, gpm_window))
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return out


def _is_mig(pynvml, handle) -> bool:
    try:
        return bool(pynvml.nvmlDeviceIsMigDeviceHandle(handle))
    except (pynvml.NVMLError, AttributeError):
        return False


def read_gpm_slices(pynvml, slices: list[tuple[str, object]], window: float = GPM_WINDOW) -> dict[str, int]:
    """Graphics-engine activity in percent of each MIG slice ``(id, MIG handle)`` whose parent GPU
    has GPM: a sample of the slice's GPU instance, ``window`` seconds (one wait for all of them),
    a second, and NVML's ``NVML_GPM_METRIC_GRAPHICS_UTIL`` between the two. A slice without GPM
    (a GPU before Hopper, an nvidia-ml-py without the calls) or whose metric fails is left out."""
    started: list[tuple[str, object, int, object, object]] = []
    for dev, mig in slices:
        samples = []
        try:
            parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
            if not pynvml.nvmlGpmQueryDeviceSupport(parent).isSupportedDevice:
                log.debug("MIG slice %s: its GPU has no GPM (before Hopper): no reading", dev)
                continue
            gi = pynvml.nvmlDeviceGetGpuInstanceId(mig)
            samples = [pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()]
            pynvml.nvmlGpmMigSampleGet(parent, gi, samples[0])
            started.append((dev, parent, gi, samples[0], samples[1]))
        except (pynvml.NVMLError, AttributeError) as e:  # AttributeError: nvidia-ml-py before GPM
            log.debug("No GPM reading for MIG slice %s: %s", dev, e)
            _free(pynvml, samples)
    if not started:
        return {}
    time.sleep(window)
    out: dict[str, int] = {}
    for dev, parent, gi, first, second in started:
        try:
            pynvml.nvmlGpmMigSampleGet(parent, gi, second)
            out[dev] = gpm_graphics_util(pynvml, first, second)
        except (pynvml.NVMLError, AttributeError) as e:
            log.debug("No GPM reading for MIG slice %s: %s", dev, e)
        finally:
            _free(pynvml, [first, second])
    return out


def gpm_graphics_util(pynvml, first, second) -> int:
    """``NVML_GPM_METRIC_GRAPHICS_UTIL`` in percent between two GPM samples of one GPU or GPU
    instance; raises the metric's NVMLError when NVML has no value."""
    get = pynvml.c_nvmlGpmMetricsGet_t()
    get.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    get.numMetrics = 1
    get.sample1, get.sample2 = first, second
    get.metrics[0].metricId = pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL
    pynvml.nvmlGpmMetricsGet(get)
    metric = get.metrics[0]
    if metric.nvmlReturn != pynvml.NVML_SUCCESS:
        raise pynvml.NVMLError(metric.nvmlReturn)
    return int(round(max(0.0, min(100.0, metric.value))))


def _free(pynvml, samples) -> None:
    for sample in samples:
        try:
            pynvml.nvmlGpmSampleFree(sample)
        except Exception:
            pass


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
        "max by (namespace, pod, exported_namespace, exported_pod) (max_over_time(DCGM_FI_DEV_GPU_UTIL[{window}s]))",
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
