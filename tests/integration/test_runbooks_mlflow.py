"""Issue 28 item 2: the MLflow-down runbook, run against a real hub with its MLflow service whose
``mlflow server`` is stopped (SIGSTOP: a hung MLflow). Every marked block of
docs/runbooks/mlflow-down.md is run as the page shows it (harness: test_runbooks.py). Its own
file so that the pytest workers share the runbook tests (MLflow costs ~450 MiB and a minute).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest

from support.hub import Hub, wait_for
from test_runbooks import blocks, env_of, runbook, steps_run_by
from test_runbooks_gpu import POLICY

pytestmark = [pytest.mark.integration]

PAGES = ("mlflow-down",)


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_a_hung_mlflow_is_found_and_restarted(tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("runbooks-mlflow"), POLICY, mlflow=True)
    h.start()
    try:
        admin = h.login("admin")
        env = env_of(h, admin, MLFLOW_URL=h.url.replace("://", "://mlflow--service.", 1) + "/services/mlflow")
        ok = lambda: (lambda o: o if "mlflow: 200" in o else None)(runbook("mlflow-down", "verify", env))  # noqa: E731
        wait_for(ok, 180, "MLflow to answer", interval=2)
        svc = admin.api.get(admin.url("/services/mlflow")).json()["pid"]
        (child,) = children(svc)  # `mlflow server`, in its own process group
        os.killpg(child, signal.SIGSTOP)
        out = runbook("mlflow-down", "check", env)
        assert "mlflow: 000" in out and f"service pid: {svc}" in out, out
        assert re.search(rf"^child: \s*{child} T", out, re.M), out
        assert "ok" in out.splitlines()[-1], out  # the database is fine: MLflow hangs
        out = runbook("mlflow-down", "restart", env)
        assert f"stopped the MLflow service ({svc})" in out, out
        wait_for(ok, 180, "the restarted MLflow to answer", interval=2)
        assert admin.api.get(admin.url("/services/mlflow")).json()["pid"] != svc
        assert not os.path.exists(f"/proc/{child}"), "the hung mlflow server is gone"
    finally:
        h.stop()


def test_every_marked_block_of_this_page_is_run_by_a_test():
    ran = steps_run_by(__file__)
    missing = sorted(f"runbook:{page}/{step}" for page in PAGES for step in blocks(page) if (page, step) not in ran)
    assert not missing, f"marked blocks no test runs: {missing}"
