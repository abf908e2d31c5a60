"""In a real Chromium: JupyterLab shows the hub's cull warning as a notification, and its Snooze
button goes through the server's relay to the (stand-in) hub and updates the notification."""

from __future__ import annotations

import os
import re

import pytest

from nbside import SERVER_NAME

pytestmark = [pytest.mark.browser]


def test_warning_notification_and_snooze(nb_server, stand_in, browser, tmp_path):
    w = stand_in.warn(SERVER_NAME, minutes=12, reason="GPU idle for 30 min", snoozes_left=1, snooze_seconds=1800)
    first_deadline = w["deadline"]
    ctx = browser.new_context()
    page = ctx.new_page()
    page.set_default_timeout(int(os.environ.get("GPUHUB_BROWSER_TIMEOUT_MS", 60_000)))
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(f"{nb_server.url}lab?token={nb_server.token}")
        toast = page.locator(".Toastify__toast", has_text="This server will be stopped at")
        toast.wait_for()
        text = toast.inner_text()
        assert re.search(
            r"This server will be stopped at \d\d:\d\d \(in 1[12] min\): GPU idle for 30 min\. "
            r"Your files are kept\.",
            text,
        ), text
        # What the extension relies on to tell a shown toast from one the user closed.
        assert toast.evaluate("el => !!el.id && document.getElementById(el.id) === el && !!el.closest('.Toastify')")
        # Same warning, new reading: the toast on screen is updated in place (one toast, not two).
        with stand_in.lock:
            stand_in.warnings[SERVER_NAME]["reason"] = "GPU idle for 31 min"
        page.evaluate("document.dispatchEvent(new Event('visibilitychange'))")
        toast = page.locator(".Toastify__toast", has_text="GPU idle for 31 min")
        toast.wait_for()
        assert page.locator(".Toastify__toast", has_text="This server will be stopped at").count() == 1
        snooze = toast.get_by_role("button", name="Snooze")
        snooze.click()
        # The relay reached the hub, for this server, and the notification says so in place.
        toast = page.locator(".Toastify__toast", has_text="Snoozed. This server will be stopped at")
        toast.wait_for()
        assert re.search(r"\(in (41|42) min\)", toast.inner_text()), toast.inner_text()
        assert [p["body"] for p in stand_in.posts()] == [{"server": SERVER_NAME}]
        assert stand_in.warnings[SERVER_NAME]["deadline"] == first_deadline + 1800
        # That was the last snooze: no Snooze button any more.
        assert toast.get_by_role("button", name="Snooze").count() == 0
        if os.environ.get("GPUHUB_SCREENSHOT_DIR"):
            page.screenshot(path=os.path.join(os.environ["GPUHUB_SCREENSHOT_DIR"], "cull-warning-snoozed.png"))

        # Closed by the user: it stays closed at the next poll (it would come back once, 5 min
        # before the deadline).
        toast.locator(".jp-Notification-Toast-Close").first.click()
        page.locator(".Toastify__toast", has_text="This server will be stopped at").wait_for(state="detached")

        def poll_answered(r):  # the extension's own poll, through the server's relay
            return r.request.method == "GET" and r.url.split("?")[0].endswith("/gpuhub/culling")

        with page.expect_response(poll_answered) as answered:
            page.evaluate("document.dispatchEvent(new Event('visibilitychange'))")
        assert answered.value.json()["warning"], answered.value.json()  # the warning still stands
        page.wait_for_timeout(500)  # the answer is rendered in the same task it is read
        assert page.locator(".Toastify__toast", has_text="This server will be stopped at").count() == 0

        # The hub withdraws the warning (the user got back to work): the notification follows at
        # the next poll; a tab becoming visible again polls at once.
        stand_in.reset()
        page.evaluate("document.dispatchEvent(new Event('visibilitychange'))")
        page.locator(".Toastify__toast", has_text="no longer scheduled to be stopped").wait_for()
        assert page.locator(".Toastify__toast", has_text="This server will be stopped at").count() == 0
        assert errors == []
    except Exception:
        page.screenshot(path=str(tmp_path / "lab.png"))
        print("screenshot:", tmp_path / "lab.png")
        raise
    finally:
        ctx.close()


def test_after_the_stop_the_warning_is_replaced_by_what_happened(fake_nvml, stand_in, browser, tmp_path):
    """The stale "will be stopped (in 0 min)" with its Snooze button must not outlive the server."""
    from nbside import HUB_TOKEN, USER, NotebookServer

    server = NotebookServer(
        tmp_path / "doomed",
        {
            "GPUHUB_FAKE_NVML": str(fake_nvml.path),
            "JUPYTERHUB_API_URL": stand_in.api_url,
            "JUPYTERHUB_API_TOKEN": HUB_TOKEN,
            "JUPYTERHUB_USER": USER,
            "JUPYTERHUB_SERVER_NAME": SERVER_NAME,
        },
        base_url=f"/user/{USER}/{SERVER_NAME}/",
    ).start()
    stand_in.warn(SERVER_NAME, minutes=0.05, reason="its GPUs were idle for 30m", snoozes_left=0)
    ctx = browser.new_context()
    page = ctx.new_page()
    page.set_default_timeout(int(os.environ.get("GPUHUB_BROWSER_TIMEOUT_MS", 60_000)))
    try:
        page.goto(f"{server.url}lab?token={server.token}")
        page.locator(".Toastify__toast", has_text="This server will be stopped").wait_for()
        server.stop()  # the culler stopped it
        for _ in range(2):  # two polls that get no answer (a visible tab polls at once)
            page.evaluate("document.dispatchEvent(new Event('visibilitychange'))")
            page.wait_for_timeout(1000)
        # the page's own banner (issue 43 item 1: a JupyterLab toast needs code from the going server)
        toast = page.locator(".gpuhub-stop-notice", has_text="This server was stopped")
        toast.wait_for()
        text = toast.inner_text()
        assert re.search(
            r"This server was stopped at \d\d:\d\d: its GPUs were idle for 30m\. Your files are kept; "
            r"start it again from the hub home page\.",
            text,
        ), text
        assert toast.get_by_role("button", name="Hub home").count() == 1
        # the stale warning (and its Snooze) is gone, not left beside the notice
        page.locator(".Toastify__toast", has_text="will be stopped").wait_for(state="detached")
        assert page.get_by_role("button", name="Snooze").count() == 0
        if os.environ.get("GPUHUB_SCREENSHOT_DIR"):
            page.screenshot(path=os.path.join(os.environ["GPUHUB_SCREENSHOT_DIR"], "culled-notice.png"))
    except Exception:
        page.screenshot(path=str(tmp_path / "lab.png"))
        print("screenshot:", tmp_path / "lab.png")
        raise
    finally:
        ctx.close()
        server.stop()
