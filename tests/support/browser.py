"""The real Chromium every browser test drives (Debian's, through Playwright; never a
downloaded one): where it is and the flags that keep it quiet and local.

Headless, no sandbox (the tests run as root), no GPU, no QUIC, and none of the background
traffic a browser makes on its own (component updates, sync, safe-browsing lists): nothing
leaves the machine.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@contextmanager
def chromium(extra_args: list[str] = ()):
    """Debian's Chromium, launched through Playwright with ``ARGS`` (and ``extra_args``) and closed
    afterwards. A test that needs it is skipped where it is not installed (run-tests.sh installs
    it as root)."""
    import pytest

    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no {CHROMIUM} (run-tests.sh installs Debian's chromium as root)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[*ARGS, *extra_args], headless=True)
        try:
            yield browser
        finally:
            browser.close()


def log_in(page, hub_url: str, name: str, password: str | None = None) -> None:
    """Log in on the hub's login form, as a user does (the caller waits for what it expects next)."""
    page.goto(hub_url + "/hub/login")
    fill_login_form(page, name, password)


def fill_login_form(page, name: str, password: str | None = None) -> None:
    """Fill and send the hub's login form on the page that shows it."""
    from support.hub import PASSWORD

    page.fill("#username_input", name)
    page.fill("#password_input", PASSWORD if password is None else password)
    page.click("#login_submit")


THEME_ERROR = ".jp-Dialog[aria-label^='Error Loading Theme']"


def wait_lab_whole(page) -> None:
    """JupyterLab on ``page`` loaded whole: its main area and its theme.

    Twice in fresh-clone runs under load (CI, load ~8) JupyterLab 4.6 showed its own "Error
    Loading Theme" dialog over an unstyled page instead, with nothing in the hub's, proxy's or
    server's log (once its text said the theme's stylesheet failed to load; JupyterLab asks for
    it once and never again, and also gives up if the theme plugin has not registered 1.6 s after
    the settings came). Not gpuhub's page: a person reloads it, and so does the test, once,
    printing JupyterLab's words; a second failure fails the test with them. Checked by aborting
    the stylesheet's first request through Playwright: the dialog came, the reload loaded the theme.
    """
    for attempt in (1, 2):
        page.locator("#jp-main-dock-panel").wait_for()
        page.locator(f"body[data-jp-theme-name], {THEME_ERROR}").first.wait_for(state="attached")
        error = page.locator(THEME_ERROR)
        if not error.count():
            return
        said = " ".join(error.first.inner_text().split())
        assert attempt == 1, f"JupyterLab's theme failed to load twice, after a reload: {said!r}"
        print(f"JupyterLab said {said!r}; reloading the page once")
        page.reload()
