"""GPU utilisation per pod from DCGM exporter series as Prometheus returns them.

The label sets are dcgm-exporter's (``gpu``, ``UUID``, ``device``, ``modelName``,
``Hostname``, and with ``DCGM_EXPORTER_KUBERNETES=true`` the ``namespace``/``pod``/
``container`` holding the GPU); scraped through a ServiceMonitor without honorLabels,
Prometheus renames those to ``exported_*`` and sets ``namespace``/``pod`` to the
exporter's own.
"""

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from gpuhub_spawner.culling.gpu import DcgmPrometheusReader, parse_dcgm_vector

EXPORTER = {
    "gpu": "0",
    "UUID": "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52",
    "device": "nvidia0",
    "modelName": "NVIDIA H100 80GB HBM3",
    "Hostname": "gpu-node-1",
    "DCGM_FI_DRIVER_VERSION": "550.54.15",
}


def answer(*series):
    return {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [{"metric": labels, "value": [1764489600.0, value]} for labels, value in series],
        },
    }


def test_workload_labels_win_over_the_exporters_own():
    body = answer(
        (
            {
                "__name__": "DCGM_FI_DEV_GPU_UTIL",
                **EXPORTER,
                "namespace": "gpu-operator",
                "pod": "nvidia-dcgm-exporter-x7k2p",
                "exported_namespace": "gpuhub-users",
                "exported_pod": "jupyter-alice",
                "exported_container": "notebook",
            },
            "87",
        ),
        (
            {**EXPORTER, "gpu": "1", "UUID": "GPU-2", "namespace": "gpuhub-users", "pod": "jupyter-bob", "container": "notebook"},
            "0",
        ),
        ({**EXPORTER, "gpu": "2", "UUID": "GPU-3", "namespace": "gpu-operator", "pod": "nvidia-dcgm-exporter-x7k2p"}, "0"),
    )
    values = parse_dcgm_vector(body)
    assert values[("gpuhub-users", "jupyter-alice")] == 87.0
    assert values[("gpuhub-users", "jupyter-bob")] == 0.0
    # a GPU nobody holds shows up under the exporter's own pod; it is nobody's reading
    assert ("gpu-operator", "nvidia-dcgm-exporter-x7k2p") in values  # harmless: no server has that key


def test_several_gpus_of_one_pod_read_as_the_busiest_and_nan_is_no_reading():
    body = answer(
        ({**EXPORTER, "namespace": "u", "pod": "jupyter-carol"}, "3"),
        ({**EXPORTER, "gpu": "1", "namespace": "u", "pod": "jupyter-carol"}, "64"),
        ({**EXPORTER, "gpu": "2", "namespace": "u", "pod": "jupyter-dave"}, "NaN"),
    )
    values = parse_dcgm_vector(body)
    assert values == {("u", "jupyter-carol"): 64.0}


def test_mig_engine_activity_ratio_scaled_to_percent():
    labels = {**EXPORTER, "GPU_I_ID": "3", "GPU_I_PROFILE": "1g.10gb", "namespace": "u", "pod": "jupyter-erin"}
    values = parse_dcgm_vector(answer((labels, "0.42")), metric_scale=100)
    assert values[("u", "jupyter-erin")] == pytest.approx(42.0)


def test_an_error_answer_is_refused():
    with pytest.raises(ValueError):
        parse_dcgm_vector({"status": "error", "errorType": "bad_data", "error": "parse error"})


def test_reader_queries_prometheus_and_unreachable_means_no_reading():
    seen = {}

    class Prometheus(BaseHTTPRequestHandler):
        def do_GET(self):
            seen["query"] = parse_qs(urlparse(self.path).query)["query"][0]
            body = json.dumps(
                answer(
                    (
                        {
                            **EXPORTER,
                            "exported_namespace": "u",
                            "exported_pod": "jupyter-alice",
                            "namespace": "gpu-operator",
                            "pod": "dcgm",
                        },
                        "55",
                    )
                )
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = HTTPServer(("127.0.0.1", 0), Prometheus)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reader = DcgmPrometheusReader(prometheus_url=f"http://127.0.0.1:{server.server_port}")
        got = asyncio.run(reader.read([("u", "jupyter-alice"), ("u", "jupyter-bob")], window=60))
        assert got == {("u", "jupyter-alice"): 55.0}  # bob has no series: no reading (idle)
        assert "DCGM_FI_DEV_GPU_UTIL[60s]" in seen["query"]
    finally:
        server.shutdown()
    dead = DcgmPrometheusReader(prometheus_url="http://127.0.0.1:9", timeout=2)
    assert asyncio.run(dead.read([("u", "jupyter-alice")], window=60)) == {}
