"""A viewer (policy ``roles.viewers``) reads every run's metrics through the hub's MLflow,
read-only, and gets no artifact and no write — against a real hub and a real MLflow.

victor is in ``department-heads`` (a viewer, in no team); carol (NLP) owns the run; mallory
(no team, no role) is the control: without the viewer role the same reads are refused.
"""

from __future__ import annotations

import http.client
from urllib.parse import urlsplit

import pytest

pytestmark = pytest.mark.integration

API = "/api/2.0/mlflow"
PREFIX = "/services/mlflow"


@pytest.fixture(scope="module")
def carols_run(mlflow_hub):
    hub, mlflow = mlflow_hub
    carol = hub.login("carol")
    mlflow.wait_ready(carol.token)
    s = mlflow.api(carol.token)
    r = s.post(mlflow.direct + API + "/experiments/create", json={"name": "users/carol/viewer-demo"})
    assert r.status_code == 200, r.text
    exp_id = r.json()["experiment_id"]
    r = s.post(mlflow.direct + API + "/runs/create", json={"experiment_id": exp_id, "start_time": 0})
    run_id = r.json()["run"]["info"]["run_id"]
    r = s.post(mlflow.direct + API + "/runs/log-metric", json={"run_id": run_id, "key": "loss", "value": 0.25,
                                                               "timestamp": 0, "step": 1})
    assert r.status_code == 200, r.text
    r = s.put(f"{mlflow.direct}/api/2.0/mlflow-artifacts/artifacts/{exp_id}/{run_id}/artifacts/weights.txt",
              data=b"secret weights", headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    return exp_id, run_id


def raw_get(base: str, path: str, token: str) -> tuple[int, bytes]:
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
    r = conn.getresponse()
    body = r.read()
    conn.close()
    return r.status, body


def test_a_viewer_reads_metrics_but_no_artifacts_and_changes_nothing(mlflow_hub, carols_run):
    hub, mlflow = mlflow_hub
    exp_id, run_id = carols_run
    victor, mallory = hub.login("victor"), hub.login("mallory")
    v = mlflow.api(victor.token)
    # Reads: the run, its metrics, searches (MLflow's searches are POSTs).
    r = v.get(mlflow.direct + API + "/runs/get", params={"run_id": run_id})
    assert r.status_code == 200, r.text
    assert [(m["key"], m["value"]) for m in r.json()["run"]["data"]["metrics"]] == [("loss", 0.25)]
    r = v.get(mlflow.direct + API + "/metrics/get-history", params={"run_id": run_id, "metric_key": "loss"})
    assert r.status_code == 200 and r.json()["metrics"][0]["value"] == 0.25
    r = v.post(mlflow.direct + API + "/runs/search", json={"experiment_ids": [exp_id]})
    assert r.status_code == 200 and [x["info"]["run_id"] for x in r.json()["runs"]] == [run_id]
    # No artifact, by any route, however spelt.
    base = mlflow.direct.rsplit(PREFIX, 1)[0]
    for path in (
        f"{PREFIX}/api/2.0/mlflow-artifacts/artifacts/{exp_id}/{run_id}/artifacts/weights.txt",
        f"{PREFIX}/api/2.0/mlflow-%61rtifacts/artifacts/{exp_id}/{run_id}/artifacts/weights.txt",
        f"{PREFIX}{API}/artifacts/list?run_id={run_id}",
        f"{PREFIX}/get-artifact?path=weights.txt&run_uuid={run_id}",
        f"{PREFIX}/ajax-api/2.0/mlflow/get-artifact?path=weights.txt&run_uuid={run_id}",
    ):
        status, body = raw_get(base, path, victor.token)
        assert status in (400, 403) and b"secret weights" not in body, (path, status, body[:200])
    # No writes: metrics, new experiments, deletions.
    assert v.post(mlflow.direct + API + "/runs/log-metric", json={"run_id": run_id, "key": "loss", "value": 9,
                                                                  "timestamp": 0}).status_code == 403
    assert v.post(mlflow.direct + API + "/experiments/create", json={"name": "victors"}).status_code == 403
    assert v.post(mlflow.direct + API + "/runs/delete", json={"run_id": run_id}).status_code == 403
    s = mlflow.api(hub.login("carol").token)
    r = s.get(mlflow.direct + API + "/metrics/get-history", params={"run_id": run_id, "metric_key": "loss"})
    assert [m["value"] for m in r.json()["metrics"]] == [0.25]
    # Control: someone in no team and no role reads nothing of carol's.
    r = mlflow.api(mallory.token).get(mlflow.direct + API + "/runs/get", params={"run_id": run_id})
    assert r.status_code == 403, r.text
