"""In a real Chromium, a viewer (the policy's roles.viewers, in no team; issue 43 item 5): victor
logs in and lands on the usage page, not on a spawn form whose Start would refuse him; his home
page has no Start or Add New Server controls and links the usage page. A researcher's home is
unchanged (her Start button is there)."""

import shutil

import pytest

from support.browser import CHROMIUM, log_in
from support.hub import REPO, Hub

pytestmark = [pytest.mark.integration, pytest.mark.browser]

POLICY = (REPO / "jupyterhub_config" / "profiles.yaml").read_text()  # the demo's: victor is a viewer


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    if not shutil.which(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (run-tests.sh installs it as root)")
    h = Hub(tmp_path_factory.mktemp("browser-viewer"), POLICY)
    h.start()
    yield h
    h.stop()


def login(browser, hub, name):
    page = browser.new_context().new_page()
    log_in(page, hub.url, name)
    page.wait_for_load_state()
    return page


def test_a_viewer_lands_on_usage_and_has_no_start_controls(hub, browser):
    victor = login(browser, hub, "victor")
    victor.wait_for_url("**/hub/gpuhub/usage**", timeout=15_000)
    assert "Server Options" not in victor.content()
    victor.goto(hub.url + "/hub/home")
    panel = victor.locator("#gpuhub-viewer-home")
    panel.wait_for(timeout=15_000)
    assert "You are a viewer" in panel.inner_text()
    assert victor.locator("#start").count() == 0, "a Start My Server button for a viewer"
    assert victor.get_by_text("Add New Server").count() == 0
    victor.click("#gpuhub-usage-link")
    victor.wait_for_url("**/hub/gpuhub/usage**", timeout=15_000)


def test_a_researchers_home_keeps_its_start_button(hub, browser):
    erin = login(browser, hub, "erin")
    erin.goto(hub.url + "/hub/home")
    erin.locator("#start").wait_for(timeout=15_000)
    assert erin.locator("#gpuhub-viewer-home").count() == 0


def test_a_lead_previews_her_own_teams_quota_in_a_shared_cohort(hub):
    """Issue 43 item 4, on the demo policy (Vision Lab and NLP share the cohort 'research'): lena,
    Vision Lab's lead, previews lowering her own team's A100 quota; that is her team's edit (not
    refused because NLP shares the cohort), and she sees what it does to NLP, read-only."""
    import yaml

    lena = hub.login("lena")
    data = yaml.safe_load(lena.api.get(lena.url("/gpuhub/policy")).json()["text"])  # (env values masked)
    teams = {t["name"]: t for t in data["teams"]}
    teams["vision"]["quota"]["gpus"]["a100"] = {"nominal": 1, "borrowingLimit": 1}
    r = lena.api.post(lena.url("/gpuhub/policy/preview"), json={"yaml": yaml.safe_dump(data, sort_keys=False)})
    assert r.status_code == 200, r.text
    shown = r.json()["text"]
    assert "Vision Lab: A100 80GB GPUs quota 2 → 1 (-1)" in shown, shown
    # Lending nothing to the cohort any more: what NLP may borrow, shown to her read-only.
    teams["vision"]["quota"]["gpus"]["a100"] = {"nominal": 2, "borrowingLimit": 1, "lendingLimit": 0}
    r = lena.api.post(lena.url("/gpuhub/policy/preview"), json={"yaml": yaml.safe_dump(data, sort_keys=False)})
    assert r.status_code == 200, r.text
    shown = r.json()["text"]
    assert "NLP Group (cohort research, read-only here): may borrow up to 0 A100 80GB GPUs from its cohort (was 1)" in shown
    teams["vision"]["quota"]["gpus"]["a100"] = {"nominal": 2, "borrowingLimit": 1, "lendingLimit": 1}
    teams["nlp"]["quota"]["gpus"]["l4"] = {"nominal": 2}  # and an edit of NLP's own entry is still refused
    r = lena.api.post(lena.url("/gpuhub/policy/preview"), json={"yaml": yaml.safe_dump(data, sort_keys=False)})
    assert r.status_code == 403 and "you do not lead: nlp" in r.json()["message"], r.text
