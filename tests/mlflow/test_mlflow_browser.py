"""A researcher in a real Chromium: log in to the hub, run a notebook cell in
JupyterLab that logs to MLflow with no setup, then find the run in the MLflow UI
reached from the hub's home page (no second password)."""

from __future__ import annotations

import os
import re

import pytest


pytestmark = [pytest.mark.browser, pytest.mark.integration]
JUPYTERLAB = True  # the notebook opens in JupyterLab (tests/mlflow/conftest.py)


CELL = "import mlflow\nwith mlflow.start_run() as run:\n    mlflow.log_metric('loss', 0.1)\nprint('RUN', run.info.run_id)"


def test_notebook_run_appears_in_mlflow_ui(mlflow_hub, browser):
    from support.hub import PASSWORD

    hub, mlflow = mlflow_hub
    user = hub.login("dave")  # API client for the same user: starts the server, writes the notebook
    mlflow.wait_ready(user.token)
    r = user.start("cpu", team="vision")
    assert r.status_code in (201, 202), r.text
    server = user.wait_ready()
    notebook = {
        "cells": [{"cell_type": "code", "source": CELL, "metadata": {}, "outputs": [], "execution_count": None}],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    server_url = hub.server_url(server["url"])  # its own origin (<user>.localhost) with subdomains
    r = user.api.put(f"{server_url}api/contents/log-run.ipynb", json={"type": "notebook", "format": "json", "content": notebook})
    assert r.status_code in (200, 201), r.text

    ctx = browser.new_context()
    # On the context, not the page: the run's page below opens in a tab of its own, which would
    # otherwise wait Playwright's 30 s for MLflow's UI (a large bundle; run 44 ran out there).
    ctx.set_default_timeout(int(os.environ.get("GPUHUB_BROWSER_TIMEOUT_MS", 90_000)))
    page = ctx.new_page()
    page.goto(hub.url + "/hub/login")
    page.fill("input[name=username]", "dave")
    page.fill("input[name=password]", PASSWORD)
    page.click("[type=submit]")
    page.wait_for_url(re.compile(r".*/(hub/home|hub/spawn|user/dave/).*"))

    page.goto(f"{server_url}lab/tree/log-run.ipynb")
    editor = page.locator(".jp-Notebook .jp-Cell .cm-content").first
    editor.wait_for()
    # The status bar says "Idle" once the kernel is connected and ready for requests.
    page.locator(".jp-StatusBar-Widget", has_text=re.compile(r"\| Idle")).first.wait_for()
    editor.click()
    page.keyboard.press("Shift+Enter")
    output = page.locator(".jp-OutputArea-output", has_text="RUN ").first
    try:
        output.wait_for()
    except Exception:
        page.screenshot(path=str(hub.workdir / "notebook.png"))
        raise
    run_id = re.search(r"RUN ([0-9a-f]{32})", output.inner_text()).group(1)
    # MLflow's INFO lines (a new experiment, ...) went to stderr: red in every cell. Only
    # warnings and errors may show there.
    red = page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
    assert red.count() == 0, red.all_inner_texts()

    run = mlflow.api(user.token).get(mlflow.direct + "/api/2.0/mlflow/runs/get", params={"run_id": run_id}).json()["run"]
    assert run["info"]["user_id"] == "dave"
    run_name = run["info"]["run_name"]

    # The link MLflow printed in the notebook ("View run ... at: ...") opens the run too.
    printed = page.locator(".jp-OutputArea-output a", has_text=re.compile(r"/#/experiments/.*/runs/" + run_id)).first
    printed.wait_for()
    href = printed.get_attribute("href")
    assert "127.0.0.1" not in href and href.startswith(hub.url.replace("://", "://mlflow--service.")), href
    with ctx.expect_page() as opened:
        printed.click()
    tab = opened.value
    try:
        tab.get_by_text(run_name).first.wait_for()
    except Exception:
        tab.screenshot(path=str(hub.workdir / "mlflow-run-tab.png"))
        raise
    assert "lots of moons" not in tab.content()

    # From the hub's home page, follow the MLflow button: hub OAuth, no password prompt, and
    # MLflow's UI on screen (not JupyterHub's 404 "Jupyter has lots of moons").
    def assert_mlflow_ui_on_screen(what: str) -> str:
        page.get_by_text(re.compile(r"^Experiments$")).first.wait_for()
        body = page.content()
        assert "lots of moons" not in body and "403" not in page.title(), (what, page.url, page.title())
        return re.match(r"(https?://[^/]+)", page.url).group(1)

    page.goto(hub.url + "/hub/home")
    page.click("#gpuhub-links a.gpuhub-link:has-text('MLflow')")
    origin = assert_mlflow_ui_on_screen("home page button")
    # ... and in that UI, the run (the same origin the button led to)
    page.goto(f"{origin}/services/mlflow/#/experiments/{run['info']['experiment_id']}/runs/{run_id}")
    page.get_by_text(run_name).first.wait_for()
    page.screenshot(path=str(hub.workdir / "mlflow-ui.png"))
    assert run_name in page.content()

    # The Services menu of every hub page opens it too (JupyterHub's own link dropped the port).
    page.goto(hub.url + "/hub/home")
    page.get_by_role("button", name="Services").or_(page.locator("a.dropdown-toggle", has_text="Services")).first.click()
    page.locator(".dropdown-menu a.dropdown-item", has_text="mlflow").first.click()
    assert_mlflow_ui_on_screen("Services menu")

    ctx.close()
