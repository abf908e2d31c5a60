"""A GPU that goes bad, seen in the browser (issue 23): its holder is told inside JupyterLab, and
admins drain and uncordon from the status page.

A real hub with the fake ``pynvml`` (tests/support/fake_nvml, the one double, as in
test_gpu_health_hub.py), two fake GPUs, alice and bob each holding one through a real
single-user server. An XID 79 on alice's GPU reaches her JupyterLab in a real Chromium within
5 s through the lab extension's long poll (``gpuhub/culling?wait=25`` on her server, relayed to
``GET /hub/api/gpuhub/culling/alice?gpu_wait=25``): what happened, that her files are kept,
that a restart gets a healthy GPU. bob's answers say nothing of it; alice cannot read bob's;
an uncordon turns her notice into "back in service". On /hub/gpuhub an admin's Drain and
Uncordon buttons act (with the page's XSRF token) and are audited as the CLI's are; a non-admin
gets no buttons and a 403 from the API behind them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.browser import CHROMIUM, chromium, log_in, wait_lab_whole
from support.fake_gpus import FakeGpus, fake_nvml_env, health_policy
from support.hub import running_hub, wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

POLICY = health_policy(2)


@pytest.fixture(scope="module")
def gpus(tmp_path_factory):
    return FakeGpus(tmp_path_factory.mktemp("nvml") / "nvml.json", 2, utilization=50)


@pytest.fixture(scope="module")
def hub(tmp_path_factory, gpus):
    with running_hub(
        tmp_path_factory.mktemp("health-lab"),
        POLICY,
        extra_config="c.PolicyStore.check_interval = 1\n",
        env=fake_nvml_env(gpus.path),
        lab=True,  # the Lab notice and its buttons
    ) as h:
        yield h


@pytest.fixture(scope="module")
def users(hub):
    us = {name: hub.login(name) for name in ("admin", "alice", "bob")}
    for name in ("alice", "bob"):
        assert us[name].start("gpu-1").status_code in (201, 202)
    for name in ("alice", "bob"):
        us[name].wait_ready()
    return us


def held_by(admin, user) -> str:
    r = admin.api.get(admin.url("/gpuhub/gpus"))
    r.raise_for_status()
    return next(g["id"] for g in r.json()["gpus"] if g["user"] == user)


def culling(client, name=None, **params):
    return client.api.get(client.url(f"/gpuhub/culling/{name or client.name}"), params=params, timeout=60)


def test_the_long_poll_is_bounded_and_answers_only_the_users_own(hub, users):
    alice, _bob = users["alice"], users["bob"]
    for bad in ("26", "-1", "nan", "soon"):
        assert culling(alice, gpu_wait=bad).status_code == 400, bad
    assert culling(alice, name="bob").status_code == 404  # no hint that bob exists
    t0 = time.time()
    r = culling(alice, gpu_wait="1")
    assert r.status_code == 200 and 0.9 <= time.time() - t0 < 10
    assert r.json()["gpu_failed"] == {} and r.json()["gpu_wait"] == 1


@pytest.mark.browser
def test_jupyterlab_tells_the_holder_of_a_gpu_gone_bad(hub, users, gpus, tmp_path):
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (run-tests.sh installs it as root)")
    admin, alice, bob = users["admin"], users["alice"], users["bob"]
    mine = held_by(admin, "alice")
    lab = hub.server_url(alice.server()["url"]) + "lab"
    with chromium() as browser:
        page = browser.new_context().new_page()
        page.set_default_timeout(90_000)
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        try:
            log_in(page, hub.url, "alice")
            page.wait_for_load_state()
            # The long poll is in flight once Lab has loaded (no wait on the 30 s poll after this).
            with page.expect_request(lambda r: "/gpuhub/culling?wait=" in r.url, timeout=120_000):
                page.goto(lab)
            wait_lab_whole(page)

            def long_poll_held() -> bool:  # the hub holds one of alice's long polls now (its debug log)
                log = hub.log.read_text(errors="replace")
                return log.count("GPU-failure long poll of alice: held") > log.count("GPU-failure long poll of alice: let go")

            wait_for(long_poll_held, 60, "the hub to hold the relay's long poll for alice")
            t0 = time.time()
            gpus.xid(mine, 79)
            toast = page.locator(".Toastify__toast", has_text="This server's GPU failed")
            toast.wait_for(timeout=5_000)
            told_in = time.time() - t0
            text = toast.inner_text()
            assert re.search(
                r"This server's GPU failed at \d\d:\d\d \(XID 79: GPU has fallen off the bus\)\. "
                r"Files are kept; a restart gets a healthy GPU\.",
                text,
            ), text
            assert told_in <= 5, told_in
            assert toast.get_by_role("button", name="Hub home").count() == 1
            if os.environ.get("GPUHUB_SCREENSHOT_DIR"):
                page.screenshot(path=os.path.join(os.environ["GPUHUB_SCREENSHOT_DIR"], "gpu-failed-lab.png"))
            # Only alice's: bob's entry says nothing of it (his GPU is fine).
            assert culling(bob).json()["gpu_failed"] == {}
            assert list(culling(alice).json()["gpu_failed"]) == [""]
            assert culling(alice).json()["gpu_failed"][""]["devices"] == [mine]

            # An admin uncordons it (the GPU was reset): the long poll brings that at once too.
            env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTERHUB_", "GPUHUB_TOKEN"))}
            r = subprocess.run(
                [sys.executable, "-m", "gpuhub_spawner.cli", "gpu", "--hub", hub.url, "uncordon", mine],
                env=dict(env, GPUHUB_TOKEN=admin.token),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert r.returncode == 0, r.stderr
            # The issue bounds the failure notice (5 s, above); the return to service is only shown. The
            # fresh-clone run saw it later than 5 s once under load: a generous wait, no time asserted.
            page.locator(".Toastify__toast", has_text="The GPU of this server is back in service").wait_for(timeout=60_000)
            assert page.locator(".Toastify__toast", has_text="This server's GPU failed").count() == 0
            assert errors == []
        except Exception:
            page.screenshot(path=str(tmp_path / "lab.png"))
            print("screenshot:", tmp_path / "lab.png")
            raise
        finally:
            browser.close()
    wait_for(lambda: culling(alice).json()["gpu_failed"] == {}, 60, "alice's notice gone after the uncordon")


def gpu(admin, device) -> dict:
    r = admin.api.get(admin.url("/gpuhub/gpus"))
    r.raise_for_status()
    return next(g for g in r.json()["gpus"] if g["id"] == device)


def test_only_admins_drain_or_uncordon_from_the_status_page(hub, users):
    """A non-admin sees no Drain/Uncordon buttons and is refused by the API they post to, with
    the page's own XSRF token; a cookie POST without the XSRF token is refused even for an admin."""
    admin, bob = users["admin"], users["bob"]
    target = held_by(admin, "bob")

    def drains():  # the admin's drain test may have run before this one (any order)
        return admin.api.get(admin.url("/gpuhub/audit"), params={"event": "gpu_drained"}).json()["entries"]

    before = drains()
    page = bob.session.get(hub.url + "/hub/gpuhub")
    assert page.status_code == 200 and "gpuhub-gpu-action" not in page.text.split("<script>")[0]
    xsrf = bob.session.cookies.get("_xsrf", path="/hub/") or bob.session.cookies.get("_xsrf")
    for action in ("drain", "uncordon"):
        r = bob.session.post(f"{hub.url}/hub/api/gpuhub/gpus/{target}/{action}", headers={"X-XSRFToken": xsrf})
        assert r.status_code == 403 and "Only admins" in r.json()["message"], r.text
        assert bob.api.post(bob.url(f"/gpuhub/gpus/{target}/{action}")).status_code == 403
    r = admin.session.post(f"{hub.url}/hub/api/gpuhub/gpus/{target}/drain")  # no XSRF token: forged
    assert r.status_code == 403, r.text
    g = gpu(admin, target)
    assert not g["drained"] and g["usable"]
    assert drains() == before  # nothing drained, nothing audited


@pytest.mark.browser
def test_an_admin_drains_and_uncordons_from_the_status_page(hub, users, tmp_path):
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (run-tests.sh installs it as root)")
    admin = users["admin"]
    target = held_by(admin, "bob")
    with chromium() as browser:
        page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
        page.set_default_timeout(60_000)
        try:
            log_in(page, hub.url, "admin")
            page.wait_for_load_state()
            page.goto(hub.url + "/hub/gpuhub")
            page.uncheck("#gpuhub-autorefresh")  # no reload between the click and its answer
            page.click(f'button.gpuhub-gpu-action[data-device="{target}"][data-action="drain"]')
            page.wait_for_function("document.getElementById('gpuhub-action-result').dataset.status === '200'")
            result = page.locator("#gpuhub-action-result").inner_text()
            assert result.startswith(f"{target} drained: bob/ keeps it until it stops"), result  # words, no HTTP code
            g = gpu(admin, target)
            assert g["drained"] == "admin" and g["user"] == "bob" and not g["usable"]
            page.reload()
            row = page.locator("#gpuhub-devices tr", has_text=target)
            assert row.locator(".gpuhub-health").inner_text() == "drained"
            # Why, on the page itself (not only in the badge's tooltip).
            reason = row.locator(".gpuhub-health-reason")
            assert reason.is_visible() and reason.inner_text() == row.locator(".gpuhub-health").get_attribute("title")
            assert row.locator('button[data-action="drain"]').count() == 0
            if os.environ.get("GPUHUB_SCREENSHOT_DIR"):
                page.screenshot(path=os.path.join(os.environ["GPUHUB_SCREENSHOT_DIR"], "status-drained.png"))
            page.uncheck("#gpuhub-autorefresh")
            row.locator('button[data-action="uncordon"]').click()
            page.wait_for_function("document.getElementById('gpuhub-action-result').dataset.status === '200'")
            assert f"{target} is back in service" in page.locator("#gpuhub-action-result").inner_text()
            g = gpu(admin, target)
            assert not g["drained"] and g["usable"]
        except Exception:
            page.screenshot(path=str(tmp_path / "status.png"))
            print("screenshot:", tmp_path / "status.png")
            raise
        finally:
            browser.close()
    # Audited like the CLI: who, which GPU, whose it was.
    drained = admin.api.get(admin.url("/gpuhub/audit"), params={"event": "gpu_drained"}).json()["entries"]
    assert [(e["device"], e["by"], e.get("key")) for e in drained] == [(target, "admin", "bob/")]
    uncordoned = admin.api.get(admin.url("/gpuhub/audit"), params={"event": "gpu_uncordoned"}).json()["entries"]
    assert (target, "admin") in [(e["device"], e["by"]) for e in uncordoned]
