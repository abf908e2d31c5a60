"""The spawn form: only the user's team profiles, the policy's default pre-selected."""

import re
from types import SimpleNamespace

from gpuhub_spawner.policy import parse_policy
from gpuhub_spawner.policy_spawner import PolicySpawnerMixin

POLICY = """\
flavors: [{name: gpu, local: {virtual: 1}}]
teams:
  - {name: red, groups: [red], quota: {gpus: {gpu: 1}}}
  - {name: blue, groups: [blue], quota: {gpus: {gpu: 1}}}
profiles:
  - {slug: small, displayName: Small, teams: "*"}
  - {slug: gpu, displayName: "<b>GPU</b>", gpu: {count: 1, flavor: gpu}, teams: [red], default: true}
  - {slug: blue-only, displayName: Blue, teams: [blue]}
"""


class FormOnly(PolicySpawnerMixin):
    def __init__(self, groups):
        self.user = SimpleNamespace(name="u", groups=[SimpleNamespace(name=g) for g in groups])
        self._policy = parse_policy(POLICY)

    @property
    def policy(self):
        return self._policy


def radios(html):
    return re.findall(
        r'<input class="form-check-input" type="radio" name="profile" id="[^"]+" value="([^"]+)" data-team="([^"]+)"( checked)?',
        html,
    )


def test_only_team_profiles_and_default_preselected():
    html = FormOnly(["red"]).render_options_form()
    assert [(v, t, c) for v, t, c in radios(html)] == [("small", "red", ""), ("gpu", "red", " checked")]
    assert "<b>GPU</b>" not in html and "&lt;b&gt;GPU&lt;/b&gt;" in html  # names are escaped


def test_member_of_two_teams_chooses_and_no_team_gets_a_message():
    html = FormOnly(["red", "blue"]).render_options_form()
    assert 'name="team"' in html
    assert {(v, t) for v, t, _ in radios(html)} == {("small", "red"), ("gpu", "red"), ("small", "blue"), ("blue-only", "blue")}
    none = FormOnly(["visitors"]).render_options_form()
    assert "not a member of any team" in none and "radio" not in none


def test_a_viewer_is_sent_to_the_usage_page_not_told_to_find_a_team():
    """Issue 20: victor (viewer, in no team) landed on 'ask an administrator to add you to a team'."""
    policy = parse_policy(POLICY + "roles: {viewers: [auditors]}\n")
    form = FormOnly(["auditors"])
    form._policy = policy
    html = form.render_options_form()
    assert 'id="gpuhub-viewer"' in html and "viewer" in html and "gpuhub/usage" in html
    assert "not a member of any team" not in html and "radio" not in html
