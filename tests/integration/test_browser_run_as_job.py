"""JupyterLab's "Run as job" (issue 44's "Done when"), in a real Chromium against a real hub
run as root, real JupyterLab, papermill and the real MLflow service.

Alice has her notebook open in JupyterLab on a server holding her team's only GPU. From the Run
menu she runs it as a job: the dialog offers her team's profiles in the spawn page's words (not
another team's), she picks the GPU profile, gives a parameter and ticks "and stop my server". The
job is queued, her server stops at once and the job gets its GPU. A teammate's interactive
server then takes the GPU back: the job is preempted, queued again, and resumes from its
checkpoint when the teammate stops. From the dialog's link she opens the job's page: two
attempts (preempted, succeeded), the executed notebook (the resumed run's output on screen) and
the MLflow run (its name and metric on MLflow's own page). A notebook whose cell fails shows the
cell and its traceback on its job's page. And from the other tenant's seat: carol's own
credentials reach neither alice's relay (nothing is submitted in anyone's name, nothing stopped)
nor alice's job, its executed notebook or page.

GPUs are the policy's virtual ones (no NVML).
"""

from __future__ import annotations

import json
import os
import re
import textwrap
import time
import uuid

import pytest
import requests

from support.browser import CHROMIUM, log_in
from support.hub import running_hub, wait_for
from support.jobs import logs, record, wait_state
from support.notebooks import notebook, put_notebook
from support.policies import jobs_policy

pytestmark = [
    pytest.mark.integration,
    pytest.mark.browser,
    pytest.mark.skipif(os.geteuid() != 0, reason="jobs run as their user's account: needs a hub running as root"),
]

POLICY = jobs_policy(
    teams="""\
  - {name: nlp, displayName: NLP Group, groups: [nlp-group], quota: {gpus: {gpu: 0}}}
""",
    profiles="""\
  - {slug: cpu, displayName: CPU only, teams: "*", default: true, cpu: 500m, memory: 1Gi}
  - {slug: gpu-1, displayName: One GPU, description: For training, gpu: {count: 1, flavor: gpu}, teams: [vision], cpu: 500m, memory: 1Gi}
  - {slug: nlp-big, displayName: NLP only, teams: [nlp], cpu: 500m, memory: 1Gi}
""",
)

# A training loop that checkpoints every step and resumes from the last checkpoint. It runs
# until the test lets it finish (a file in the home), so the preemption never races its end.
TRAIN = notebook(
    ("parameters", 'label = "default"\npause = 0.2'),
    textwrap.dedent("""\
        import json, os, time
        ckpt = os.path.join(os.environ["GPUHUB_CHECKPOINT_DIR"], "state.json")
        finish = os.path.expanduser("~/lab-job/finish")
        state = {"step": 0, "total": 0}
        if os.path.exists(ckpt):
            state = json.load(open(ckpt))
            print(f"resumed from step {state['step']} attempt {os.environ['GPUHUB_ATTEMPT']}", flush=True)
        print(f"label {label} attempt {os.environ['GPUHUB_ATTEMPT']} starts after step {state['step']}", flush=True)"""),
    textwrap.dedent("""\
        for step in range(state["step"] + 1, 3000):
            time.sleep(pause)
            state = {"step": step, "total": state["total"] + step}
            json.dump(state, open(ckpt + ".tmp", "w")); os.replace(ckpt + ".tmp", ckpt)
            print(f"step {step}", flush=True)
            if os.path.exists(finish) and os.environ["GPUHUB_ATTEMPT"] != "1":
                break"""),
    textwrap.dedent("""\
        import mlflow
        with mlflow.start_run(run_name=f"lab-{label}") as run:
            mlflow.log_metric("last_step", state["step"])
        print(f"total {state['total']} run {run.info.run_id}")"""),
)

FAILING = notebook(
    "x = 1\nprint('first cell ran')",
    "raise ValueError(f'learning rate {x} is too large')",
    "print('never printed')",
)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (run-tests.sh installs it as root)")
    with running_hub(tmp_path_factory.mktemp("run-as-job"), POLICY, lab=True, mlflow=True) as h:
        yield h


@pytest.fixture(scope="module")
def browser(hub, browser):
    """tests/conftest.py's Chromium, started after the hub and so closed before it stops."""
    return browser


@pytest.fixture(scope="module")
def users(hub):
    return {n: hub.login(n) for n in ("alice", "bob", "carol")}


@pytest.fixture(scope="module")
def mlflow(hub):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mlflow"))
    from mlflow_service import MlflowEndpoint

    return MlflowEndpoint(hub, hub.mlflow_port)


def shot(page, hub, name: str) -> None:
    try:
        page.screenshot(path=str(hub.workdir / f"{name}.png"))
    except Exception:  # noqa: BLE001 - a screenshot is evidence, never the failure
        pass


def relay_refuses_another_user(alice, carol, relay: str, rel: str) -> None:
    """Carol, with her own hub token, at alice's server's "Run as job" relay: refused by the
    server's login before anything reaches the hub (alice's profiles unread, no job submitted,
    alice's server not stopped); without a credential, the same. Alice's token gets her list."""
    theirs = {"Authorization": f"token {carol.token}"}
    assert requests.get(relay, headers=theirs, timeout=30).status_code == 403
    r = requests.post(relay, headers=theirs, json={"path": rel, "profile": "cpu", "stop_server": True}, timeout=30)
    assert r.status_code == 403, r.text
    assert requests.post(relay, json={"path": rel, "profile": "cpu"}, timeout=30).status_code == 403
    mine = requests.get(relay, headers={"Authorization": f"token {alice.token}"}, timeout=30).json()
    assert mine["user"] == "alice" and [t["name"] for t in mine["teams"]] == ["vision"]
    # The hub's list for carol is carol's own: her team's profiles only.
    listed = carol.api.get(carol.url("/gpuhub/profiles")).json()
    assert [t["name"] for t in listed["teams"]] == ["nlp"] and "gpu-1" not in json.dumps(listed)
    assert alice.server()["ready"]  # carol's "stop my server" stopped nothing
    assert carol.api.get(carol.url("/gpuhub/jobs")).json()["jobs"] == []


def test_a_notebook_run_as_a_job_from_jupyterlab_survives_a_preemption_and_opens_from_the_jobs_page(hub, users, mlflow, browser):
    alice, bob, carol = users["alice"], users["bob"], users["carol"]
    mlflow.wait_ready(alice.token)
    rel = put_notebook(hub, "alice", f"lab-job/train-{uuid.uuid4().hex[:6]}.ipynb", TRAIN)
    assert alice.start("gpu-1").status_code in (201, 202)
    server_url = hub.server_url(alice.wait_ready()["url"])
    relay_refuses_another_user(alice, carol, server_url + "gpuhub/jobs", rel)

    ctx = browser.new_context(viewport={"width": 1400, "height": 900})
    ctx.set_default_timeout(90_000)
    page = ctx.new_page()
    try:
        log_in(page, hub.url, "alice")
        page.wait_for_load_state()
        page.goto(f"{server_url}lab/tree/{rel}")
        page.locator(".jp-Notebook .jp-Cell").first.wait_for()
        # As after working in it: the notebook's kernel is up (the status bar says Idle).
        page.locator(".jp-StatusBar-Widget", has_text=re.compile(r"\| Idle")).first.wait_for()

        # The Run menu's "Run as Job…": the spawn page's profiles for her team, in its words.
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-itemLabel", has_text="Run as Job").click()
        dialog = page.locator("#gpuhub-run-as-job")
        dialog.locator("#gpuhub-job-profile-vision-gpu-1").wait_for()
        text = dialog.inner_text()
        assert "One GPU" in text and "0.5 CPU, 1Gi memory, 1\u00d7 Tesla GPU" in text and "For training" in text, text
        assert "CPU only" in text and "NLP only" not in text, text  # another team's profile is not offered
        assert rel in text
        assert dialog.locator("#gpuhub-job-profile-vision-cpu").is_checked()  # the spawn page's default
        dialog.locator("#gpuhub-job-profile-vision-gpu-1").check()
        dialog.locator("#gpuhub-job-stop-server").check()
        # A mistake is named in the form, and nothing typed is lost.
        params = dialog.locator("#gpuhub-job-parameters")
        params.fill("label = from-lab\npause 0.2")
        dialog.get_by_role("button", name="Submit job").click()
        error = dialog.locator("#gpuhub-job-error")
        error.get_by_text("parameters, line 2: give a parameter as name=value").wait_for()
        assert params.input_value() == "label = from-lab\npause 0.2"
        assert dialog.locator("#gpuhub-job-profile-vision-gpu-1").is_checked()
        assert dialog.locator("#gpuhub-job-stop-server").is_checked()
        params.fill("label = from-lab\npause=0.2")
        clicked = time.monotonic()
        dialog.get_by_role("button", name="Submit job").click()

        # Submitted: the job's id and status, and this server stopping to free its GPU.
        dialog.locator("#gpuhub-job-id").wait_for()
        m = re.search(r"Job (job-[0-9a-f]{10}): (\w+)", dialog.locator("#gpuhub-job-id").inner_text())
        assert m and m.group(2) in ("queued", "running"), dialog.inner_text()
        job_id = m.group(1)
        assert "This server is stopping" in dialog.locator("#gpuhub-job-server").inner_text()
        alice.wait_gone(timeout=60)
        print(f"[run-as-job] submit clicked -> server gone (its GPU free): {time.monotonic() - clicked:.1f} s")
        page.locator(".gpuhub-stop-notice").wait_for()  # the open Lab says its server stopped
        shot(page, hub, "submitted")

        rec = record(alice, job_id)
        assert rec["kind"] == "notebook" and rec["user"] == "alice" and rec["profile"]["slug"] == "gpu-1"
        assert rec["notebook"] == {"path": rel, "parameters": {"label": "from-lab", "pause": 0.2}}

        # It runs on the GPU the server held; a teammate's server takes it back.
        wait_for(lambda: "step 2\n" in logs(alice, job_id), 120, "the job to reach step 2")
        assert bob.start("gpu-1").status_code in (201, 202)
        rec = wait_state(alice, job_id, "queued", timeout=120)
        assert rec["attempts"][0]["reason"] == "preempted"
        bob.wait_ready()
        bob.stop()
        bob.wait_gone()
        wait_for(lambda: "resumed from step" in logs(alice, job_id), 120, "the job to resume from its checkpoint")
        finish = hub.data / "home" / "alice" / "lab-job" / "finish"
        finish.write_text("")
        owner = os.stat(finish.parent)
        os.chown(finish, owner.st_uid, owner.st_gid)
        rec = wait_state(alice, job_id, "succeeded", "failed", timeout=180)
        out = logs(alice, job_id)
        assert rec["state"] == "succeeded", out
        assert [a["reason"] for a in rec["attempts"]] == ["preempted", "succeeded"], out
        resumed_at = int(out.split("resumed from step")[1].split()[0])
        assert resumed_at >= 2 and f"attempt 2 starts after step {resumed_at}" in out
        total, run_id = re.findall(r"total (\d+) run ([0-9a-f]{32})", out)[-1]
        assert rec["attempts"][1]["mlflow_run_ids"] == [run_id]

        # The dialog's link opens the job's page on the hub: what alice sees there.
        with ctx.expect_page() as opened:
            dialog.locator("#gpuhub-job-link").click()
        jobs = opened.value
        jobs.locator("#gpuhub-job-status").wait_for()
        assert jobs.locator("#gpuhub-job-status").inner_text().startswith("succeeded")
        rows = jobs.locator("#gpuhub-job-attempts tbody tr")
        assert rows.count() == 2
        assert "preempted" in rows.nth(0).inner_text() and "succeeded" in rows.nth(1).inner_text()
        assert f"~/{rel}" in jobs.locator("#gpuhub-job-record").inner_text()
        shot(jobs, hub, "job-page")

        # The executed notebook of the resumed attempt: its cells and outputs on screen.
        rows.nth(1).locator("a.gpuhub-executed-notebook").click()
        jobs.get_by_text(re.compile(r"resumed from step \d+ attempt 2")).first.wait_for()
        body = jobs.locator("body").inner_text()
        assert 'label = "from-lab"' in body or "label = 'from-lab'" in body, body[:2000]
        assert f"total {total} run {run_id}" in body and "injected parameters" in body
        assert "step 1\n" not in body.split("resumed from step")[1]  # nothing before the checkpoint ran again
        shot(jobs, hub, "executed-notebook")
        jobs.go_back()

        # The MLflow run of the resumed attempt, on MLflow's own page (its origin, the hub login).
        link = jobs.locator("#gpuhub-job-attempts tbody tr").nth(1).locator("a.gpuhub-mlflow-run")
        assert link.inner_text() == run_id[:8]
        link.click()
        jobs.get_by_text("lab-from-lab").first.wait_for()
        assert jobs.url.startswith(mlflow.origin), jobs.url
        jobs.get_by_text("last_step").first.wait_for()
        shot(jobs, hub, "mlflow-run")

        assert job_id in jobs.locator("body").inner_text()  # the run's gpuhub.job.id tag, on screen

        # From the other tenant's seat: carol sees none of it, and nothing ran in her name.
        assert carol.api.get(carol.url(f"/gpuhub/jobs/{job_id}")).status_code == 404
        assert carol.api.get(carol.url(f"/gpuhub/jobs/{job_id}/notebook")).status_code == 404
        assert carol.session.get(f"{hub.url}/hub/gpuhub/jobs/{job_id}").status_code == 404
        assert carol.session.get(f"{hub.url}/hub/gpuhub/jobs/{job_id}/notebook?attempt=2").status_code == 404
        assert carol.api.get(carol.url("/gpuhub/jobs")).json()["jobs"] == []
        mine = [
            j["id"] for j in alice.api.get(alice.url("/gpuhub/jobs")).json()["jobs"] if j.get("notebook", {}).get("path") == rel
        ]
        assert mine == [job_id]  # only what alice submitted from her JupyterLab
    except Exception:
        shot(page, hub, "failure-lab")
        raise
    finally:
        ctx.close()


def test_a_failed_cell_shows_the_cell_and_its_traceback_on_the_jobs_page(hub, users, browser):
    alice = users["alice"]
    rel = put_notebook(hub, "alice", f"lab-job/failing-{uuid.uuid4().hex[:6]}.ipynb", FAILING)
    r = alice.api.post(alice.url("/gpuhub/jobs"), json={"spec": json.dumps({"profile": "cpu", "notebook": rel})})
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    assert wait_state(alice, job_id, "failed", "succeeded", timeout=120)["state"] == "failed"
    ctx = browser.new_context()
    ctx.set_default_timeout(60_000)
    page = ctx.new_page()
    try:
        log_in(page, hub.url, "alice")
        page.wait_for_load_state()
        page.goto(f"{hub.url}/hub/gpuhub/jobs/{job_id}")
        status = page.locator("#gpuhub-job-status")
        assert status.inner_text().startswith("failed: cell 2 failed: ValueError: learning rate 1 is too large")
        cell = page.locator("#gpuhub-failed-cell-1")
        assert cell.is_visible()
        assert cell.locator("h2").inner_text() == "Attempt 1: cell 2 failed"
        assert cell.locator(".gpuhub-failed-cell-source").inner_text().strip() == (
            "raise ValueError(f'learning rate {x} is too large')"
        )
        tb = cell.locator(".gpuhub-failed-cell-traceback")
        assert tb.is_visible() and "ValueError: learning rate 1 is too large" in tb.inner_text()
        shot(page, hub, "failed-cell")
    finally:
        ctx.close()
