"""A viewer in a real Chromium, in the default configuration (the hub's own MLflow service):
victor (policy ``roles.viewers``, in no team) logs in to the hub, follows the home page's
MLflow button, and opens another team's run in the MLflow UI.

What must be on screen: the run's name and its metric (a viewer reads every team's runs);
not its artifacts (the artifacts tab shows no file name); the UI in the model-training
(classic ML experiment) view, with no telemetry banner and no pop-over over the page.
"""

from __future__ import annotations

import os
import re
import time

import pytest


pytestmark = [pytest.mark.browser, pytest.mark.integration]

API = "/api/2.0/mlflow"
METRIC = "val_accuracy_nlp"
ARTIFACT = "carol-secret-weights.bin"


@pytest.fixture(scope="module")
def carols_run(mlflow_hub):
    """A run of NLP's carol with a metric, a param and an artifact (through the service, as a
    notebook logs it)."""
    hub, mlflow = mlflow_hub
    carol = hub.login("carol")
    mlflow.wait_ready(carol.token)
    s = mlflow.api(carol.token)
    r = s.post(mlflow.direct + API + "/experiments/create", json={"name": "users/carol/ui-viewer"})
    assert r.status_code == 200, r.text
    exp_id = r.json()["experiment_id"]
    r = s.post(
        mlflow.direct + API + "/runs/create",
        json={"experiment_id": exp_id, "start_time": 1_700_000_000_000, "run_name": "carol-bert-finetune"},
    )
    assert r.status_code == 200, r.text
    run = r.json()["run"]["info"]
    r = s.post(
        mlflow.direct + API + "/runs/log-batch",
        json={
            "run_id": run["run_id"],
            "metrics": [{"key": METRIC, "value": 0.8125, "timestamp": 1_700_000_000_000 + i, "step": i} for i in range(3)],
            "params": [{"key": "learning_rate", "value": "0.0003"}],
        },
    )
    assert r.status_code == 200, r.text
    r = s.put(
        f"{mlflow.direct}/api/2.0/mlflow-artifacts/artifacts/{exp_id}/{run['run_id']}/artifacts/{ARTIFACT}",
        data=b"secret weights",
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 200, r.text
    r = s.post(
        mlflow.direct + API + "/runs/update", json={"run_id": run["run_id"], "status": "FINISHED", "end_time": 1_700_000_100_000}
    )
    assert r.status_code == 200, r.text
    return exp_id, run["run_id"], run["run_name"]


def test_a_viewer_opens_another_teams_run_in_the_mlflow_ui(mlflow_hub, carols_run, browser):
    from support.hub import PASSWORD

    hub, mlflow = mlflow_hub
    exp_id, run_id, run_name = carols_run
    ctx = browser.new_context(viewport={"width": 1400, "height": 900})
    page = ctx.new_page()
    page.set_default_timeout(int(os.environ.get("GPUHUB_BROWSER_TIMEOUT_MS", 90_000)))
    failed: list[str] = []

    def on_response(response):
        if response.status >= 400 and "/services/mlflow/" in response.url:
            try:
                body = response.text()[:300]
            except Exception:
                body = ""
            failed.append(f"{response.status} {response.request.method} {response.url} {body}")

    page.on("response", on_response)
    errors: list[str] = []  # the page's own errors and requests that got no answer at all
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"[:500]))
    # Chromium aborts the requests in flight when the machine's addresses change
    # (net::ERR_NETWORK_CHANGED): here, another test's hub bringing up its users' bridge. MLflow's
    # UI does not ask again (seen in a fresh-clone run on 2026-12-06: the runs never came).
    lost: list[str] = []

    def request_failed(r) -> None:
        errors.append(f"request failed: {r.method} {r.url} {r.failure}"[:500])
        if "ERR_NETWORK_CHANGED" in (r.failure or ""):
            lost.append(r.url)

    page.on("requestfailed", request_failed)
    shots = hub.workdir

    try:
        page.goto(hub.url + "/hub/login")
        page.fill("input[name=username]", "victor")
        page.fill("input[name=password]", PASSWORD)
        page.click("[type=submit]")
        page.wait_for_url(re.compile(r".*/hub/(home|spawn|usage|status|gpuhub/usage).*"))  # a viewer lands on usage
        page.goto(hub.url + "/hub/home")
        page.click("#gpuhub-links a.gpuhub-link:has-text('MLflow')")
        page.get_by_text(re.compile(r"^Experiments$")).first.wait_for()
        # MLflow opens on its experiments list, not on its GenAI welcome page (issue 43's polish).
        assert page.url.endswith("/services/mlflow/#/experiments"), page.url
        origin = re.match(r"(https?://[^/]+)", page.url).group(1)
        assert origin == mlflow.origin, (page.url, mlflow.origin)
        # The home page has loaded the experiment list (carol's among them).
        page.get_by_text("users/carol/ui-viewer").first.wait_for()
        page.screenshot(path=str(shots / "viewer-home.png"))

        # No telemetry banner, no pop-over: say nothing the user does not need.
        assert page.get_by_text("Information about UI telemetry").count() == 0
        assert page.get_by_text(re.compile("collects usage data")).count() == 0

        # Carol's experiment, from the experiment list (the viewer reads every team's).
        page.goto(f"{origin}/services/mlflow/#/experiments")
        page.get_by_text("users/carol/ui-viewer").first.click()
        # Once in a fresh-clone run (load ~8, no failed response) MLflow's own UI fell over here
        # instead: its "Something went wrong" page; once its runs' request was lost to a network
        # change (above). Not gpuhub's page: a person reloads it, and so does the test, once,
        # printing the page's errors; a second one fails the test.
        from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

        crashed = page.get_by_text("Something went wrong")
        deadline = time.monotonic() + 90
        while not lost:  # the run's name or the crash on screen, or a request lost: what comes first
            try:
                page.get_by_text(run_name).or_(crashed).first.wait_for(timeout=2_000)
                break
            except PlaywrightTimeoutError:
                assert time.monotonic() < deadline, f"waited 90 s for the run {run_name!r} on screen: {errors}"
        if crashed.count() or lost:
            print("MLflow's UI said 'Something went wrong' or lost a request; reloading once. Errors:", errors)
            page.screenshot(path=str(shots / "viewer-crashed.png"))
            page.reload()
        page.get_by_text(run_name).first.wait_for()
        page.screenshot(path=str(shots / "viewer-experiment.png"))
        # The model-training view: a runs table, not GenAI's traces and "Detect Issues".
        assert "workflowType=genai" not in page.url
        assert page.get_by_role("dialog").count() == 0
        assert page.get_by_text("Detect Issues").count() == 0
        assert page.get_by_text("Experiment load error").count() == 0

        # The run page: its name and its metric on screen.
        page.get_by_text(run_name).first.click()
        page.get_by_text(METRIC).first.wait_for()
        page.screenshot(path=str(shots / "viewer-run.png"))
        body = page.locator("body").inner_text()
        assert run_name in body and METRIC in body and "0.8125" in body, body[:2000]
        # a 403 on screen, not three digits of the run's random id (1 in ~140 ids holds "403")
        assert "Can't load run details" not in body and not re.search(r"\b403\b", body), body[:2000]
        # The run's Traces tab asks MLflow for the run's trace counts (traces/metrics, a
        # read-only aggregate POST): answered, not refused.
        with page.expect_response(lambda r: "/traces/metrics" in r.url) as counted:
            page.get_by_role("tab", name=re.compile("Traces")).first.click(timeout=15_000)
        assert counted.value.status == 200, (counted.value.status, counted.value.text()[:300])
        # Nothing blocks a click: a plain click on the page's Artifacts tab goes through.
        with page.expect_response(lambda r: "artifacts/list" in r.url) as listed:
            page.get_by_role("tab", name=re.compile("Artifacts")).first.click(timeout=15_000)
        assert listed.value.status == 403  # the artifact listing stays refused
        page.get_by_text(re.compile("artifacts are not available to viewers")).first.wait_for()
        page.screenshot(path=str(shots / "viewer-artifacts.png"))
        # The explanation, not MLflow's "Loading artifact failed" above it (issue 43's polish).
        page.get_by_text("Read-only for viewers").first.wait_for()
        assert "Loading artifact failed" not in page.locator("body").inner_text()
        assert ARTIFACT not in page.locator("body").inner_text()
        assert ARTIFACT not in page.content()
    except Exception:
        page.screenshot(path=str(shots / "viewer-failure.png"))
        raise
    finally:
        print("failed responses:\n" + "\n".join(failed))
        print("page errors and failed requests:\n" + "\n".join(errors))
        ctx.close()
    # The artifact listing is the only refusal the viewer's pages meet.
    unexpected = [f for f in failed if "artifact" not in f.split(" ")[2]]
    assert not unexpected, "\n".join(unexpected)


def test_the_ui_page_loads_the_hubs_ui_defaults_from_its_own_origin(mlflow_hub):
    """How the UI opens in the model-training view with telemetry off: MLflow 3.17's UI keeps
    these choices only in the browser's localStorage, so the service's page loads one
    same-origin script before MLflow's own (no inline script, so a ``script-src 'self'``
    policy allows it); a cached copy of the page cannot skip it (no 304 of the old page)."""
    hub, mlflow = mlflow_hub
    s = mlflow.api(hub.login("alice").token)
    mlflow.wait_ready(hub.login("alice").token)
    # What a browser that cached MLflow's own page (before this hub added the script) sends.
    admin = mlflow.admin()
    theirs_etag = admin.get(admin.base + "/").headers["ETag"]
    r = s.get(
        mlflow.direct + "/",
        headers={"If-None-Match": theirs_etag, "Accept-Encoding": "gzip", "If-Modified-Since": "Sat, 01 Jan 2100 00:00:00 GMT"},
    )
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/html"), (r.status_code, r.headers)
    page = r.text
    ours, theirs = page.find('<script src="gpuhub/ui-defaults.js"></script>'), page.find("static-files/static/js/main.")
    assert 0 <= ours < theirs, page
    assert r.headers.get("ETag") != theirs_etag and r.headers.get("Cache-Control") == "no-cache", r.headers
    r = s.get(mlflow.direct + "/gpuhub/ui-defaults.js")
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/javascript"), r.headers
    assert r.headers["X-Content-Type-Options"] == "nosniff"
    for key in (
        "mlflow.workflowType_v1",
        "machine_learning",
        "mlflow.settings.telemetry.enabled_v1",
        "mlflow.telemetry.info.alert.dismissed_v1",
        "mlflow.detectIssues.guidanceShown_v1",
    ):
        assert key in r.text, key
    # Not anonymous: the page and the script need the hub login like everything else here.
    assert mlflow.api(None).get(mlflow.direct + "/gpuhub/ui-defaults.js", allow_redirects=False).status_code in (302, 401)
