"""What an open JupyterLab shows a user when the hub warns about or stops their server, read in
a real Chromium (tests/integration/test_browser_lab_stops.py, test_browser_walk.py).

``open_lab`` loads a user's JupyterLab with a watch on the screen (every toast, banner and
dialog with the browser's time it appeared); ``assert_stop_shown`` checks the stop notice came
within 2 s of the hub's stop (the hub's log time, the browser's time of the banner: one
machine's clock), the warning and its countdown are gone, and no JupyterLab dialog ("Server
unavailable or unreachable… Restart?", "Directory not found") nor its "Jupyter news" toast
appeared, even after JupyterLab's own polls met the stopped server.
"""

from __future__ import annotations

import re
from datetime import datetime

from support.browser import log_in, wait_lab_whole
from support.hub import wait_for

# Every toast and dialog JupyterLab shows (``how``: "added"), and every change of a toast's words
# ("changed"), with the browser's time (epoch ms): what is on the screen, so an element the page
# keeps hidden (display: none, visibility: hidden) is not noted. A toast's other changes (its
# exit animation when it is dismissed) are not words on screen changing, so they are not noted
# either.
WATCH_SCREEN = """() => {
    window.__gpuhub_seen = [];
    const said = new WeakMap();
    const note = (kind, el, how) => {
        if (!el.checkVisibility({visibilityProperty: true})) return;
        const text = (el.innerText || '').trim();
        if (said.get(el) === text) return;
        said.set(el, text);
        window.__gpuhub_seen.push({kind, how, at: Date.now(), text});
    };
    new MutationObserver(records => {
        for (const r of records) {
            for (const n of r.addedNodes) {
                if (!(n instanceof HTMLElement)) continue;
                for (const el of [n, ...n.querySelectorAll('.jp-Dialog, .Toastify__toast, .gpuhub-stop-notice')]) {
                    if (el.matches('.jp-Dialog')) note('dialog', el, 'added');
                    else if (el.matches('.Toastify__toast, .gpuhub-stop-notice')) note('toast', el, 'added');
                }
            }
            if (r.type === 'characterData' || r.type === 'childList') {
                const t = r.target instanceof HTMLElement ? r.target : r.target.parentElement;
                const toast = t && t.closest && t.closest('.Toastify__toast');
                if (toast) note('toast', toast, 'changed');
            }
        }
    }).observe(document.body, {childList: true, subtree: true, characterData: true});
}"""


def seen(page) -> list[dict]:
    return page.evaluate("() => window.__gpuhub_seen || []")


def first_seen(page, kind: str, pattern: str) -> dict | None:
    return next((e for e in seen(page) if e["kind"] == kind and re.search(pattern, e["text"])), None)


def log_time(hub, needle: str) -> float:
    """The time of the last hub log line containing ``needle`` (the hub's clock: this machine's)."""
    lines = [line for line in hub.log.read_text(errors="replace").splitlines() if needle in line]
    assert lines, f"no hub log line with {needle!r}"
    m = re.search(r"\[\w (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)", lines[-1])
    assert m, lines[-1]
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()


def watch_lab(page, hub, user: str) -> None:
    """On a page showing ``user``'s loaded JupyterLab: install the screen watch and wait until the
    hub holds the lab extension's long poll (an open JupyterLab's usual state)."""
    # JupyterLab loaded whole, its theme too (a stop while it is still on its way shows
    # JupyterLab's own "Error Loading Theme" dialog, of a page that never finished loading).
    wait_lab_whole(page)
    page.evaluate(WATCH_SCREEN)

    def long_poll_held() -> bool:  # the hub's debug log
        log = hub.log.read_text(errors="replace")
        return log.count(f"long poll of {user}: held") > log.count(f"long poll of {user}: let go")

    wait_for(long_poll_held, 60, f"the hub to hold {user}'s JupyterLab long poll")


def open_lab(browser, hub, client):
    """The user's JupyterLab, loaded and visible, with the screen watch installed: (context, page)."""
    ctx = browser.new_context()
    ctx.set_default_timeout(90_000)
    page = ctx.new_page()
    page._gpuhub_console = []
    page.on("console", lambda m: page._gpuhub_console.append(f"{m.type}: {m.text[:300]}"))
    log_in(page, hub.url, client.name)
    page.wait_for_load_state()
    with page.expect_request(lambda r: "/gpuhub/culling?wait=" in r.url, timeout=120_000):
        page.goto(hub.server_url(client.server()["url"]) + "lab")
    watch_lab(page, hub, client.name)
    return ctx, page


def assert_no_warning_after_stop(page) -> None:
    """After the stop notice no warning was on the screen: none came and none changed its words
    (the countdown's last update reaching the leaving warning and bringing it back: the races of
    2026-12-05 and 06, in gpuhub's lab extension)."""
    stop = first_seen(page, "toast", "This server was stopped")
    assert stop is not None, seen(page)
    after = [e for e in seen(page) if e["at"] >= stop["at"] and "will be stopped" in e["text"]]
    assert after == [], ("a warning on screen after the stop notice", after, seen(page))


def assert_stop_shown(page, hub, stopped_at: float, pattern: str) -> str:
    """The stop notice is on screen, came at most 2 s after ``stopped_at``, the warning (and its
    countdown) is gone, and no JupyterLab dialog came, even after JupyterLab's own polls met
    the stopped server (its kernels poll answered 424 by the hub). Returns the notice's text."""
    toast = page.locator(".gpuhub-stop-notice", has_text="This server was stopped")
    try:
        toast.wait_for()
    except Exception:
        print("on screen:", page.locator(".Toastify__toast").all_inner_texts(), "seen:", seen(page))
        print("console:", getattr(page, "_gpuhub_console", []))
        raise
    text = toast.inner_text()
    assert re.search(pattern, text), text
    assert toast.get_by_role("button", name="Hub home").count() == 1
    came = first_seen(page, "toast", "This server was stopped")
    assert came is not None, seen(page)
    late = came["at"] / 1000 - stopped_at
    print(f"stop notice {late:+.2f} s after the hub's stop: {text!r}")
    assert late <= 2.0, (late, seen(page))
    # The warning (and its countdown) left the screen before the notice came: no wait.
    warning = page.locator(".Toastify__toast:visible", has_text="will be stopped")
    assert warning.count() == 0, ("the warning on screen with the stop notice", warning.all_inner_texts(), seen(page))
    assert_no_warning_after_stop(page)
    # JupyterLab's own polls meet the stopped server (the hub answers 424 for it): where the
    # stock dialog would come.
    with page.expect_response(lambda r: re.search(r"/api/(kernels|sessions|terminals)\b", r.url) and r.status == 424):
        pass
    page.wait_for_function("() => document.readyState === 'complete'")
    assert page.locator(".jp-Dialog").count() == 0, page.locator(".jp-Dialog").all_inner_texts()
    assert [e for e in seen(page) if e["kind"] == "dialog"] == []
    # Nor, for these users new to JupyterLab, its "get notified about official Jupyter news?" toast.
    assert page.locator(".Toastify__toast", has_text="Jupyter news").count() == 0
    assert not [e for e in seen(page) if "Jupyter news" in e["text"]]
    return text
