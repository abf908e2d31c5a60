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


# What the browser knew of the theme's stylesheet requests (Resource Timing: a failed load has
# responseStatus 0), for the failure message: the server's log never showed these requests.
THEME_REQUESTS_JS = """() => performance.getEntriesByType('resource')
  .filter(e => e.name.includes('/api/themes/'))
  .map(e => `${e.name.split('/api/themes/')[1]} status=${e.responseStatus} ${Math.round(e.duration)}ms ${e.transferSize}B`)"""


def wait_lab_whole(page, loads: int = 3) -> None:
    """JupyterLab on ``page`` loaded whole: its main area and its theme.

    In fresh-clone runs under load (CI, load ~8; run 39 with 6 workers, both cores ~100%
    busy, twice in a row) JupyterLab 4.6 showed its own "Error Loading Theme" dialog over an
    unstyled page instead, with nothing in the hub's, proxy's or server's log (its text says
    the theme's stylesheet failed to load; JupyterLab asks for it once and never again, and
    also gives up if the theme plugin has not registered 1.6 s after the settings came). Not
    gpuhub's page: a person reloads it, and so does the test, up to ``loads`` loads in all,
    printing JupyterLab's words and what the browser knew of the stylesheet's request; the
    last failure fails the test with them. Checked by aborting the stylesheet's first request
    through Playwright: the dialog came, the reload loaded the theme.
    """
    failed: list[str] = []

    def note(request) -> None:
        if "/api/themes/" in request.url:
            failed.append(f"{request.url} {request.failure}")

    page.on("requestfailed", note)
    try:
        for attempt in range(1, loads + 1):
            page.locator("#jp-main-dock-panel").wait_for()
            page.locator(f"body[data-jp-theme-name], {THEME_ERROR}").first.wait_for(state="attached")
            error = page.locator(THEME_ERROR)
            if not error.count():
                return
            said = " ".join(error.first.inner_text().split())
            seen = f"{said!r}; the browser's requests for it: {page.evaluate(THEME_REQUESTS_JS)}, failed: {failed}"
            assert attempt < loads, f"JupyterLab's theme failed to load {loads} times, reloaded in between: {seen}"
            print(f"JupyterLab said {seen}; reloading the page")
            page.reload()
    finally:
        page.remove_listener("requestfailed", note)
