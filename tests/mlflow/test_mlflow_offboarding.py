"""Off-boarding and MLflow (issue 42 item 4): a leaver's experiments go to their team's lead, or
stay read-only, as the policy's ``offboarding.mlflow`` says. A real hub with the real MLflow
service (its own hub per module, tests/mlflow/conftest.py); the handover goes through MLflow's
own permissions API as MLflow's admin (spawner/gpuhub_spawner/mlflow/handover.py), and what is
asserted is what the lead and the leaver see through the service."""

from __future__ import annotations

import pytest

from support.hub import wait_for

pytestmark = pytest.mark.integration

API = "/api/2.0/mlflow"


@pytest.fixture(scope="module")
def users(hub, mlflow):
    clients = {name: hub.login(name) for name in ("alice", "bob", "lena", "admin")}
    mlflow.wait_ready(clients["alice"].token)
    return clients


def create_experiment(mlflow, user, name: str) -> str:
    r = mlflow.api(user.token).post(mlflow.direct + API + "/experiments/create", json={"name": name})
    assert r.status_code == 200, r.text
    return r.json()["experiment_id"]


def new_run(mlflow, user, experiment_id: str) -> int:
    return (
        mlflow.api(user.token)
        .post(mlflow.direct + API + "/runs/create", json={"experiment_id": experiment_id, "start_time": 0})
        .status_code
    )


def offboard(hub, admin, name: str) -> dict:
    r = admin.api.post(admin.url(f"/gpuhub/users/{name}/offboard"))
    assert r.status_code == 200, r.text
    return r.json()


def test_a_leavers_experiments_go_to_the_team_lead(hub, mlflow, users):
    alice, lena, admin = users["alice"], users["lena"], users["admin"]
    exp = create_experiment(mlflow, alice, "users/alice/thesis")
    assert new_run(mlflow, alice, exp) == 200
    assert new_run(mlflow, lena, exp) == 403  # a teammate (and lead) reads, never writes
    try:
        rep = offboard(hub, admin, "alice")
        (step,) = [s for s in rep["steps"] if s["step"] == "mlflow"]
        assert step.get("done") == f"handed 1 experiment(s) ({exp}) to their lead(s) lena: MANAGE", step
        assert new_run(mlflow, lena, exp) == 200  # the lead now runs, edits and shares it
        # Her token is gone; the service checks a token with the hub at most every 10 s
        # (HubOAuth's cache, mlflow/service.py), so MLflow refuses it within that.
        wait_for(lambda: new_run(mlflow, alice, exp) in (401, 403), 30, "MLflow to refuse alice's revoked token")
        # Twice: the same grants, no error.
        again = [s for s in offboard(hub, admin, "alice")["steps"] if s["step"] == "mlflow"]
        assert again[0].get("done", "").startswith("handed 1 experiment(s)"), again
    finally:
        admin.api.post(admin.url("/gpuhub/users/alice/reinstate"))


def test_read_only_keeps_a_leavers_experiments_as_they_are_and_nobody_writes_as_them(hub, mlflow, users):
    bob, lena, admin = users["bob"], users["lena"], users["admin"]
    exp = create_experiment(mlflow, bob, "users/bob/baseline")
    before = hub.policy.read_text()
    hub.policy.write_text(before + "offboarding:\n  mlflow: read-only\n")
    try:
        rep = offboard(hub, admin, "bob")
        (step,) = [s for s in rep["steps"] if s["step"] == "mlflow"]
        assert step.get("done") == f"kept 1 experiment(s) ({exp}) read-only", step
        adm = mlflow.admin()
        perm = adm.get(
            adm.base + "/api/3.0/mlflow/users/permissions/get",
            params={"username": "bob", "resource_type": "experiment", "resource_id": exp},
        )
        assert perm.status_code == 200 and perm.json()["permission"] == "READ", perm.text
        assert new_run(mlflow, lena, exp) == 403
        r = mlflow.api(lena.token).get(mlflow.direct + API + "/experiments/get", params={"experiment_id": exp})
        assert r.status_code == 200  # still readable by the team
    finally:
        hub.policy.write_text(before)
        admin.api.post(admin.url("/gpuhub/users/bob/reinstate"))
