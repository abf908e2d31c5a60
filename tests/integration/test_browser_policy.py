"""In a real Chromium, the policy page (issue 26): a lead previews an edit of their team and sees
who it hits and the errors at their lines, an admin applies it, a researcher is refused —
asserted on what is on screen."""

import shutil

import pytest

from support.hub import Hub
from support.browser import CHROMIUM, log_in
from test_policy_changes import EDIT, IMPOSSIBLE, LEAD_EDIT, POLICY

pytestmark = [pytest.mark.integration, pytest.mark.browser]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    if not shutil.which(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (run-tests.sh installs it as root)")
    h = Hub(tmp_path_factory.mktemp("browser-policy"), POLICY)
    h.start()
    alice = h.login("alice")
    assert alice.start("a100-2").status_code in (201, 202)
    alice.wait_ready()
    yield h
    alice.stop()
    h.stop()


def policy_page(browser, hub, name):
    page = browser.new_context().new_page()
    log_in(page, hub.url, name)
    page.wait_for_load_state()
    response = page.goto(hub.url + "/hub/gpuhub/policy")
    return page, response


def test_a_lead_previews_an_admin_applies_a_researcher_is_refused(hub, browser, tmp_path):
    lena, r = policy_page(browser, hub, "lena")
    assert r.status == 200
    lena.locator("#gpuhub-policy-current").filter(has_text="In force: version 1").wait_for(timeout=15_000)
    assert "You lead vision" in lena.inner_text("#gpuhub-policy-role")
    assert lena.locator("#gpuhub-policy-apply").count() == 0  # leads have no Apply
    assert "nominal: 2" in lena.input_value("#gpuhub-policy-text")
    # The admin's comments and layout, as written (issue 43 item 4): only environment values masked.
    assert lena.input_value("#gpuhub-policy-text") == POLICY.replace("hf-secret-123", "'***'")

    # a broken edit: the error at its line, with the line itself
    lena.fill(
        "#gpuhub-policy-text",
        EDIT.replace("a100: {nominal: 1}}}\n    perUser", "a100: {nominal: 1, lendingLimit: 3}}}\n    perUser"),
    )
    lena.click("#gpuhub-policy-preview")
    err = lena.locator(".gpuhub-policy-error").first
    err.wait_for(timeout=15_000)
    text = err.inner_text()
    assert "line 13, column" in text and "lendingLimit 3 is above the nominal quota 1" in text
    assert "13 |     quota: {gpus: {a100: {nominal: 1, lendingLimit: 3}}}" in text

    lena.fill("#gpuhub-policy-text", LEAD_EDIT)  # a lead sends environment values masked
    lena.click("#gpuhub-policy-preview")
    impact = lena.locator("#gpuhub-policy-impact")
    impact.locator(".gpuhub-impact-line").first.wait_for(timeout=15_000)
    shown = impact.inner_text()
    assert "Vision Lab holds 2 A100 GPUs and its new quota is 1 (1 over): alice's server" in shown
    assert "alice's server runs profile 2× A100 (a100-2), which the new policy removes: it keeps running" in shown
    assert "Vision Lab: A100 GPUs quota 2 → 1 (-1)" in shown
    assert "An admin applies it." in lena.inner_text("#gpuhub-policy-result")
    lena.screenshot(path=str(tmp_path / "lead-preview.png"), full_page=True)
    assert hub.policy.read_text() == POLICY

    admin, r = policy_page(browser, hub, "admin")
    assert r.status == 200
    admin.locator("#gpuhub-policy-current").filter(has_text="In force: version 1").wait_for(timeout=15_000)
    assert admin.locator("#gpuhub-policy-apply").is_disabled()  # preview first
    admin.fill("#gpuhub-policy-text", EDIT)
    admin.click("#gpuhub-policy-preview")
    admin.locator("#gpuhub-policy-impact .gpuhub-impact-line").first.wait_for(timeout=15_000)
    admin.click("#gpuhub-policy-apply")
    admin.locator("#gpuhub-policy-result").filter(has_text="Applied: version 2").wait_for(timeout=15_000)
    admin.locator("#gpuhub-policy-current").filter(has_text="In force: version 2").wait_for(timeout=15_000)
    row = admin.locator("#gpuhub-policy-history tr.gpuhub-policy-version").first
    assert "applied" in row.inner_text() and "admin" in row.inner_text() and "Vision Lab" in row.inner_text()
    assert hub.policy.read_text() == EDIT
    admin.screenshot(path=str(tmp_path / "admin-applied.png"), full_page=True)

    # "Roll back to this" previews (issue 43 item 6): nothing changes until it is confirmed.
    admin.locator("#gpuhub-policy-history tr.gpuhub-policy-version[data-n='1'] .gpuhub-rollback").click()
    preview = admin.locator("#gpuhub-policy-rollback-preview")
    preview.wait_for(timeout=15_000)
    assert "Preview of rolling back to version 1" in preview.inner_text() and "nothing is applied yet" in preview.inner_text()
    admin.locator("#gpuhub-policy-impact .gpuhub-impact-line").first.wait_for(timeout=15_000)
    assert "Vision Lab: A100 GPUs quota 1 → 2 (+1)" in admin.inner_text("#gpuhub-policy-impact")
    assert hub.policy.read_text() == EDIT, "a rollback was applied before it was confirmed"
    admin.click("#gpuhub-policy-rollback-confirm")
    admin.locator("#gpuhub-policy-result").filter(has_text="Rolled back: version 3").wait_for(timeout=15_000)
    admin.locator("#gpuhub-policy-current").filter(has_text="In force: version 3").wait_for(timeout=15_000)
    assert hub.policy.read_text() == POLICY

    # An impossible quota (issue 43 item 3): `gpuhub validate`'s warning next to the Apply button.
    admin.fill("#gpuhub-policy-text", IMPOSSIBLE)
    admin.click("#gpuhub-policy-preview")
    box = admin.locator("#gpuhub-policy-confirm")
    box.locator(".gpuhub-policy-warning").first.wait_for(timeout=15_000)
    assert "promises what this hub cannot keep" in box.inner_text() and "8" in box.inner_text()
    assert admin.inner_text("#gpuhub-policy-apply") == "Apply anyway"
    assert admin.locator("#gpuhub-impact-section, .gpuhub-impact-section[data-section=warnings]").count() == 1
    assert hub.policy.read_text() == POLICY

    # A profile-only edit names the change (issue 43 item 4), not "No change for anyone".
    admin.fill("#gpuhub-policy-text", POLICY.replace("teams: [vision]}", "teams: [vision], memory: 8Gi}"))
    admin.click("#gpuhub-policy-preview")
    line = admin.locator("#gpuhub-policy-impact .gpuhub-impact-line", has_text="Profile 2× A100 (a100-2) changes")
    line.wait_for(timeout=15_000)
    # (the people the hub knows: those who have logged in here)
    assert "changes: memory (default) -> 8Gi (for Vision Lab: alice, lena)." in line.inner_text(), line.inner_text()
    assert "No change for anyone" not in admin.inner_text("#gpuhub-policy-impact")
    assert hub.policy.read_text() == POLICY

    carol, r = policy_page(browser, hub, "carol")
    assert r.status == 403
    assert "Only admins and team leads may see and preview policy changes" in carol.inner_text("body")
    assert carol.locator("#gpuhub-policy-text").count() == 0
