"""A viewer (policy ``roles.viewers``) reads every run's metrics through the hub's MLflow,
read-only, and gets no artifact and no write — against a real hub and a real MLflow.

victor is in ``department-heads`` (a viewer, in no team); carol (NLP) owns the run; mallory
(no team, no role) is the control: without the viewer role the same reads are refused.
Last (it edits the policy, and restores it): the viewer's MLflow grant follows the policy.
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
    r = s.post(
        mlflow.direct + API + "/runs/log-metric", json={"run_id": run_id, "key": "loss", "value": 0.25, "timestamp": 0, "step": 1}
    )
    assert r.status_code == 200, r.text
    r = s.put(
        f"{mlflow.direct}/api/2.0/mlflow-artifacts/artifacts/{exp_id}/{run_id}/artifacts/weights.txt",
        data=b"secret weights",
        headers={"Content-Type": "application/octet-stream"},
    )
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
    assert (
        v.post(
            mlflow.direct + API + "/runs/log-metric", json={"run_id": run_id, "key": "loss", "value": 9, "timestamp": 0}
        ).status_code
        == 403
    )
    assert v.post(mlflow.direct + API + "/experiments/create", json={"name": "victors"}).status_code == 403
    assert v.post(mlflow.direct + API + "/runs/delete", json={"run_id": run_id}).status_code == 403
    s = mlflow.api(hub.login("carol").token)
    r = s.get(mlflow.direct + API + "/metrics/get-history", params={"run_id": run_id, "metric_key": "loss"})
    assert [m["value"] for m in r.json()["metrics"]] == [0.25]
    # Control: someone in no team and no role reads nothing of carol's.
    r = mlflow.api(mallory.token).get(mlflow.direct + API + "/runs/get", params={"run_id": run_id})
    assert r.status_code == 403, r.text


def test_a_viewer_gets_the_ui_trace_aggregates_but_no_trace_write(mlflow_hub, carols_run):
    """The MLflow UI's run page and experiment overview POST ``traces/metrics`` (trace counts,
    latency, tokens: read-only aggregates). A viewer got 403 on every one (the UI's Traces tab
    stayed a skeleton, GenAI's overview charts empty); now they are answered, while the trace
    routes that change something stay refused, and the aggregate is a read only as a POST."""
    hub, mlflow = mlflow_hub
    exp_id, run_id = carols_run
    v = mlflow.api(hub.login("victor").token)
    query = {
        "experiment_ids": [exp_id],
        "view_type": "TRACES",
        "metric_name": "trace_count",
        "aggregations": [{"aggregation_type": "COUNT"}],
        "filters": [f'trace.metadata.`mlflow.sourceRun` = "{run_id}"'],
    }
    for api in ("/api/3.0/mlflow", "/ajax-api/3.0/mlflow"):
        r = v.post(mlflow.direct + api + "/traces/metrics", json=query)
        assert r.status_code == 200, (api, r.status_code, r.text)
        assert "data_points" in r.json() or r.json() == {}, r.text
    for method, path in (
        ("DELETE", "/traces/metrics"),
        ("PUT", "/traces/metrics"),
        ("POST", "/traces/delete-traces"),
        ("POST", "/traces/link-to-run"),
    ):
        r = v.request(
            method,
            mlflow.direct + "/api/3.0/mlflow" + path,
            json={"experiment_id": exp_id, "max_traces": 10, "request_ids": ["x"], "run_id": run_id},
        )
        assert r.status_code == 403, (method, path, r.status_code, r.text)
    # mallory (no team, no role) is refused by MLflow itself: no read-everything grant.
    r = mlflow.api(hub.login("mallory").token).post(mlflow.direct + "/api/3.0/mlflow/traces/metrics", json=query)
    assert r.status_code == 403, r.text


# -- standing changes: the grant follows the policy --------------------------------------------
VIEWER_ROLE = "gpuhub-viewers"  # accounts.VIEWER_ROLE, spelt out: the test names what MLflow holds


def log_run_with_artifact(mlflow, token: str, experiment: str, content: bytes) -> tuple[str, str]:
    s = mlflow.api(token)
    r = s.post(mlflow.direct + API + "/experiments/create", json={"name": experiment})
    assert r.status_code == 200, r.text
    exp_id = r.json()["experiment_id"]
    run_id = s.post(mlflow.direct + API + "/runs/create", json={"experiment_id": exp_id, "start_time": 0}).json()["run"]["info"][
        "run_id"
    ]
    r = s.put(
        f"{mlflow.direct}/api/2.0/mlflow-artifacts/artifacts/{exp_id}/{run_id}/artifacts/weights.txt",
        data=content,
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 200, r.text
    return exp_id, run_id


def mlflow_roles(mlflow, username: str) -> set[str]:
    """The MLflow roles ``username`` holds, as MLflow's own admin sees them."""
    admin = mlflow.admin()
    r = admin.get(admin.base + "/api/3.0/mlflow/users/roles/list", params={"username": username})
    assert r.status_code == 200, r.text
    return {role["name"] for role in r.json()["roles"]}


def edit_policy(hub, text: str) -> None:
    """Write the policy and wait until the hub has re-read it (its check interval, 2 s)."""
    from support.hub import wait_for

    loaded = hub.log.read_text(errors="replace").count("Loaded policy")
    hub.policy.write_text(text)
    wait_for(
        lambda: hub.log.read_text(errors="replace").count("Loaded policy") > loaded,
        30,
        "the hub to reload the policy",
        interval=0.3,
    )


def test_a_viewer_moved_into_a_team_keeps_no_read_everything_grant_and_back(mlflow_hub, carols_run):
    """The attack: victor is a viewer (MLflow READ on every experiment, the proxy keeps him off
    artifacts); the policy moves his group from ``roles.viewers`` into Vision Lab. Without
    revocation the proxy stops guarding him (he is no longer viewer-only) while MLflow still
    grants READ on everything, artifacts included: NLP's weights. With the same token, his
    next request must see Vision's experiments only. And back: viewer-only again, he loses
    the team role and the viewer rules return."""
    hub, mlflow = mlflow_hub
    carol_exp, carol_run = carols_run
    alice_exp, alice_run = log_run_with_artifact(mlflow, hub.login("alice").token, "users/alice/revocation", b"alice weights")
    victor = hub.login("victor")  # one login: the same token throughout
    base = mlflow.direct.rsplit(PREFIX, 1)[0]

    def artifact(exp_id, run_id):
        return f"{PREFIX}/api/2.0/mlflow-artifacts/artifacts/{exp_id}/{run_id}/artifacts/weights.txt"

    carols = (
        artifact(carol_exp, carol_run),
        f"{PREFIX}{API}/artifacts/list?run_id={carol_run}",
        f"{PREFIX}/get-artifact?path=weights.txt&run_uuid={carol_run}",
        f"{PREFIX}{API}/runs/get?run_id={carol_run}",
    )
    # A viewer: carol's metrics yes, her artifact no; MLflow holds the read-everything role.
    assert raw_get(base, carols[3], victor.token)[0] == 200
    status, body = raw_get(base, carols[0], victor.token)
    assert status == 403 and b"secret weights" not in body
    assert VIEWER_ROLE in mlflow_roles(mlflow, "victor")

    original = hub.policy.read_text()
    moved = original.replace("viewers: [department-heads]", "viewers: []").replace(
        "groups: [vision-lab]", "groups: [vision-lab, department-heads]"
    )
    assert moved.count("department-heads") == 1
    try:
        edit_policy(hub, moved)
        # Now a Vision researcher: Vision's artifacts (the team's READ grant) ...
        status, body = raw_get(base, artifact(alice_exp, alice_run), victor.token)
        assert (status, body) == (200, b"alice weights"), (status, body[:200])
        # ... and nothing of NLP's, by any route: MLflow itself refuses now.
        for path in carols:
            status, body = raw_get(base, path, victor.token)
            assert status in (403, 404) and b"secret weights" not in body, (path, status, body[:200])
        roles = mlflow_roles(mlflow, "victor")
        assert VIEWER_ROLE not in roles and "team-vision" in roles, roles

        # Back to viewer-only: the team role goes, the viewer's rules return.
        edit_policy(hub, original)
        status, body = raw_get(base, artifact(alice_exp, alice_run), victor.token)
        assert status == 403 and b"alice weights" not in body, (status, body[:200])
        assert raw_get(base, carols[3], victor.token)[0] == 200
        roles = mlflow_roles(mlflow, "victor")
        assert VIEWER_ROLE in roles and "team-vision" not in roles, roles
    finally:
        if hub.policy.read_text() != original:
            edit_policy(hub, original)
