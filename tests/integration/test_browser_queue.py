"""In a real Chromium: a user sees only their team's profiles and the queue in plain words."""

import shutil

import pytest

from support.hub import PASSWORD, Hub
from test_local_hub import POLICY

pytestmark = [pytest.mark.integration, pytest.mark.browser]

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    if not shutil.which(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (run-tests.sh installs it as root)")
    h = Hub(tmp_path_factory.mktemp("browser"), POLICY)
    h.start()
    yield h
    h.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def login(browser, hub, name):
    page = browser.new_context().new_page()
    page.goto(hub.url + "/hub/login")
    page.fill("#username_input", name)
    page.fill("#password_input", PASSWORD)
    page.click("#login_submit")
    page.wait_for_url("**/hub/spawn**")
    return page


def test_queue_message_on_the_spawn_page(hub, browser, tmp_path):
    alice = login(browser, hub, "alice")
    labels = alice.locator("#gpuhub-profiles input[name=profile]")
    assert sorted(labels.evaluate_all("els => els.map(e => e.value)")) == ["cpu", "gpu-1"]
    alice.check("input[value=gpu-1]")
    alice.click("form button[type=submit], form input[type=submit]")
    alice.wait_for_url("**/user/alice/**", timeout=90_000)

    bob = login(browser, hub, "bob")
    bob.check("input[value=gpu-1]")
    bob.click("form button[type=submit], form input[type=submit]")
    message = bob.locator("#progress-message")
    message.filter(has_text="position 1 of 1").wait_for(timeout=30_000)
    text = message.inner_text()
    assert "Vision Lab's queue" in text and "needs 1 Tesla GPU: your team Vision Lab is using 1 of the 1 it may hold" in text
    bob.screenshot(path=str(tmp_path / "queued.png"))

    # alice stops: bob's page moves on by itself to the running server
    hub.login("alice").stop()
    bob.wait_for_url("**/user/bob/**", timeout=90_000)
    hub.login("bob").stop()
