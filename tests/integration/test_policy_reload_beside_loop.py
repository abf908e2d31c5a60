"""A large policy reloaded beside the hub's loop (issue 29): the child's answer is built a team, a
profile, ... at a time into the same policy and data a plain load gives; replaced policies are
freed although the store hides live objects from the cyclic collector; an edit's audit diff made in
a child process is the diff made here."""

import gc
import sys
import weakref
from pathlib import Path

import pytest

from gpuhub_spawner.policy import PolicyStore
from gpuhub_spawner.policy.loader import PolicyError, load_policy_data
from gpuhub_spawner.policy.store import _load_beside_the_loop
from gpuhub_spawner.usage import policy_text
from gpuhub_spawner.usage.policy_text import diff_beside, policy_diff

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "benchmarks"))
from bigpolicy import big_policy  # noqa: E402

EXAMPLE = REPO / "jupyterhub_config" / "profiles.yaml"

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("which", ["example", "big"])
async def test_built_beside_the_loop_it_is_the_policy_and_data_a_load_gives(tmp_path, which):
    path = EXAMPLE if which == "example" else tmp_path / "big.yaml"
    if which == "big":
        path.write_text(big_policy(teams=60, profiles=240))
    policy, data, error, _ = await _load_beside_the_loop(path)
    assert error is None
    want_policy, want_data = load_policy_data(path)
    assert policy == want_policy
    assert data == want_data and list(data) == list(want_data)  # the audit's text follows the file's order
    assert [t.name for t in policy.teams] == [t.name for t in want_policy.teams]
    assert policy.team(want_policy.teams[-1].name) == want_policy.teams[-1]  # its look-ups work


async def test_a_broken_file_read_beside_the_loop_says_what_a_load_says(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(big_policy(teams=20, profiles=40).replace("displayName: Team 3\n", "displayNme: Team 3\n", 1))
    _, _, error, _ = await _load_beside_the_loop(path)
    with pytest.raises(PolicyError) as direct:
        load_policy_data(path)
    assert error is not None and error.issues == direct.value.issues
    assert any("unknown key 'displayNme'" in i.message for i in error.issues)


class _Cycle:
    def __init__(self, holds):
        self.me, self.holds = self, holds


async def test_replaced_policies_are_freed_though_new_ones_are_frozen(tmp_path):
    """The store moves a new policy out of the collector's sight (gc.freeze); what it replaces
    must still go when nothing refers to it any more, reload after reload, also when a garbage
    cycle that died before the reload (a finished request's) still held it."""
    path = tmp_path / "p.yaml"
    text = big_policy(teams=40, profiles=160)
    path.write_text(text)
    store = PolicyStore(policy_file=str(path), inline_reload_budget=0.0)  # always beside the loop
    gone, frozen = [], []
    try:
        for i in range(4):
            old = weakref.ref(store.current)
            _Cycle(store.current)  # dead at once: only the collector frees it
            path.write_text(text.replace("Team 7\n", f"Team 7 (edit {i})\n"))
            store.refresh()
            new = await store.fresh()
            assert new.team("team-007").display_name == f"Team 7 (edit {i})"
            del new
            gc.collect()
            gone.append(old() is None)
            frozen.append(gc.get_freeze_count())
        assert gone == [True] * 4
        assert frozen[-1] - frozen[1] < 1000, frozen  # not a policy's worth more per reload
    finally:
        gc.unfreeze()  # leave the test process as it was


SECRET = "s3cr3t-token-value"


def _with_env(text: str, value: str) -> str:
    return text.replace(
        "profiles:\n", f"profiles:\n- slug: with-env\n  displayName: Env\n  teams: '*'\n  env:\n    API_TOKEN: {value}\n", 1
    )


def test_a_large_policys_diff_made_in_a_child_is_the_diff_made_here():
    before = _with_env(big_policy(teams=60, profiles=240), SECRET)
    after = _with_env(before.replace("displayName: Team 7\n", "displayName: Team Seven\n"), SECRET + "-2")
    assert len(before) + len(after) >= policy_text.BESIDE_FROM  # the child's path
    diff = diff_beside(before, after)
    assert diff == policy_diff(before, after)
    assert "+  displayName: Team Seven" in diff and SECRET not in diff
    assert diff_beside(before, "teams: [") == policy_diff(before, "teams: [")  # not YAML: not shown


def test_a_small_policys_diff_is_made_here(monkeypatch):
    calls = []
    monkeypatch.setattr(policy_text.subprocess, "run", lambda *a, **k: calls.append(a))
    text = EXAMPLE.read_text()
    assert diff_beside(text, text + "\n# a comment\n") == ""
    assert calls == []


def test_a_large_policys_reload_diff_made_in_a_child_is_the_one_made_here():
    import yaml

    from gpuhub_spawner.usage.policy_text import data_text, text_and_diff_beside, text_diff

    before = yaml.safe_load(_with_env(big_policy(teams=60, profiles=240), SECRET))
    after = yaml.safe_load(
        _with_env(big_policy(teams=60, profiles=240).replace("displayName: Team 7\n", "displayName: Team Seven\n"), SECRET + "-2")
    )
    old, new = data_text(before), data_text(after)
    assert SECRET not in old + new
    for known in (None, old):
        text, diff = text_and_diff_beside(known, before, after)
        assert text == new and diff == text_diff(old, new)
        assert "+  displayName: Team Seven" in diff and SECRET not in diff
    assert text_and_diff_beside(None, None, after) == (new, text_diff("", new))  # the first one
    assert text_and_diff_beside(new, after, after) == (new, None)  # nothing changed: no entry


def test_an_edit_on_disks_summary_and_diff_made_in_a_child_are_the_ones_made_here():
    from gpuhub_spawner.usage.policy_versions import _summary_and_diff, _what_changed

    before = _with_env(big_policy(teams=60, profiles=240), SECRET)
    after = _with_env(
        before.replace("gpus: {nominal: 2", "gpus: {nominal: 3").replace("displayName: Team 7\n", "displayName: Team Seven\n"),
        SECRET + "-2",
    )
    summary, diff = _summary_and_diff(before, after)
    assert (summary, diff) == (_what_changed(before, after), policy_diff(before, after))
    assert summary.startswith("edited on disk") and "+  displayName: Team Seven" in diff and SECRET not in diff
