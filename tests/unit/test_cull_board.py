"""The hub's culling record: survives restarts, keeps what is still running, counts truthfully."""

import asyncio
import json
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from traitlets.config import Config

from gpuhub_spawner.culling.board import CullBoard, ServerView

EXAMPLE = Path(__file__).resolve().parents[2] / "jupyterhub_config" / "profiles.yaml"


@pytest.fixture
def config(tmp_path):
    c = Config()
    c.PolicyStore.policy_file = str(EXAMPLE)
    c.CullBoard.state_file = str(tmp_path / "data" / "gpuhub-culling.json")
    c.CullBoard.pass_interval = 60
    return c


def gpu_server(board, user="carol", started=0.0, activity=None):
    # a virtual GPU: no trusted reading exists, so it counts as idle
    return ServerView(user, "", board.policy.profile("a100-1"), started, activity, team="nlp", devices=["0"])


def decide(board, views, now, **kw):
    return asyncio.run(board.decide_all(views, now=now, **kw))


def test_a_pending_warning_and_its_snoozes_survive_a_restart_in_a_private_file(config):
    board = CullBoard(config=config)
    d = decide(board, [gpu_server(board)], now=1800.0)["carol/"]
    assert d.action == "warn" and "GPUs were idle for 30m" in d.reason
    ok, _msg, deadline = board.snooze("carol/", board.policy.profile("a100-1"), now=1900.0)
    assert ok
    path = Path(config.CullBoard.state_file)
    assert path.stat().st_mode & 0o777 == 0o600
    again = CullBoard(config=config)  # a restarted hub
    w = again.warnings_for("carol", {"": again.policy.profile("a100-1")})[""]
    assert (w["deadline"], w["snoozes_used"], w["snoozes_left"], w["warned_at"]) == (deadline, 1, 1, 1800.0)


def test_a_person_seen_survives_a_restart_and_spends_one_snooze_where_traffic_spends_none(config):
    board = CullBoard(config=config)
    assert not board.person_seen("carol/", now=1000.0)  # no warning: nothing to spend it on
    # carol's and erin's open tabs poll all along (activity a second before every pass)
    views = lambda b, t: [gpu_server(b, "carol", activity=t - 1), gpu_server(b, "erin", activity=t - 1)]  # noqa: E731
    assert {d.action for d in decide(board, views(board, 1800.0), now=1800.0).values()} == {"warn"}
    assert board.person_seen("carol/", now=2000.0)  # someone clicked in carol's JupyterLab
    assert not board.person_seen("mallory/", now=2000.0)  # no such server: nothing recorded
    again = CullBoard(config=config)  # a restarted hub
    assert again.records["carol/"].state.person_seen == 2000.0
    d = decide(again, views(again, 2700.0), now=2700.0)
    assert d["carol/"].action == "warn" and d["carol/"].deadline == 2700.0 + 3600
    assert again.records["carol/"].state.snoozes == 1
    assert d["erin/"].action == "cull"  # her tab's traffic is not a person: no snooze spent


def test_a_damaged_state_file_is_set_aside_not_fatal(config):
    path = Path(config.CullBoard.state_file)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    board = CullBoard(config=config)
    assert board.records == {} and path.with_name(path.name + ".bad").exists()


def test_servers_not_ready_yet_keep_their_record_and_gone_ones_lose_it(config):
    board = CullBoard(config=config)
    decide(board, [gpu_server(board, "carol"), gpu_server(board, "dave")], now=1800.0)
    # after a restart dave's server is still being re-adopted (running, not ready)
    decide(board, [gpu_server(board, "carol")], now=1860.0, alive={"carol/", "dave/"})
    assert board.records["dave/"].state.deadline == 1800.0 + 900
    decide(board, [gpu_server(board, "carol")], now=1920.0, alive={"carol/"})
    assert "dave/" not in board.records


def test_a_cull_is_recorded_for_the_user_and_counted(config):
    board = CullBoard(config=config)
    before = REGISTRY.get_sample_value("gpuhub_culls_total", {"rule": "gpu-idle"}) or 0
    decide(board, [gpu_server(board, "erin")], now=1800.0)
    assert decide(board, [gpu_server(board, "erin")], now=2700.0)["erin/"].action == "cull"
    assert REGISTRY.get_sample_value("gpuhub_culls_total", {"rule": "gpu-idle"}) == before + 1
    (entry,) = board.culled_for("erin", active=set()).values()
    assert entry["profile"] == "a100-1" and entry["at"] == 2700.0 and "GPUs were idle" in entry["reason"]
    assert board.culled_for("erin", active={""}) == {}  # started again: the notice goes
    saved = json.loads(Path(config.CullBoard.state_file).read_text())
    assert saved["history"]["erin"][0]["rule"] == "gpu-idle"


def test_idle_gpu_time_accumulates_and_the_team_gauge_returns_to_zero(config):
    board = CullBoard(config=config)
    seconds = lambda: REGISTRY.get_sample_value("gpuhub_idle_gpu_seconds_total", {"team": "vision"}) or 0  # noqa: E731
    start = seconds()
    view = ServerView("bob", "", board.policy.profile("a100-1"), 0.0, None, team="vision", devices=["0"])
    decide(board, [view], now=100.0)
    decide(board, [view], now=160.0)
    assert seconds() == start + 60
    assert REGISTRY.get_sample_value("gpuhub_idle_gpus", {"team": "vision"}) == 1
    decide(board, [], now=220.0)  # bob stopped
    assert REGISTRY.get_sample_value("gpuhub_idle_gpus", {"team": "vision"}) == 0


def test_a_pod_is_read_through_dcgm_and_a_local_server_through_its_devices(config):
    from datetime import datetime
    from types import SimpleNamespace

    from gpuhub_spawner.hub.culling_api import view_of

    orm = SimpleNamespace(started=datetime(2026, 1, 1), last_activity=None)
    pod = SimpleNamespace(
        ready=True,
        orm_spawner=orm,
        user=SimpleNamespace(name="alice"),
        name="",
        pod_name="jupyter-alice",
        namespace="gpuhub-users",
    )
    v = view_of(pod, None)
    assert v.pod == ("gpuhub-users", "jupyter-alice") and v.devices == []
    local = SimpleNamespace(ready=True, orm_spawner=orm, user=SimpleNamespace(name="bob"), name="gpu", devices=["GPU-1"])
    v = view_of(local, None)
    assert v.pod is None and v.devices == ["GPU-1"] and v.key == "bob/gpu"
    waiting = SimpleNamespace(ready=False, orm_spawner=orm, user=SimpleNamespace(name="carol"), name="")
    assert view_of(waiting, None) is None  # a queued server is never culled

    board = CullBoard(config=config)
    seen = {}

    async def dcgm(pods, window):
        seen["pods"], seen["window"] = pods, window
        return {("gpuhub-users", "jupyter-alice"): 97.0}

    board.dcgm.read = dcgm
    busy = ServerView("alice", "", board.policy.profile("a100-1"), 0.0, None, pod=("gpuhub-users", "jupyter-alice"))
    assert decide(board, [busy], now=7200.0)["alice/"].action == "keep"  # 2 h old, GPU busy per DCGM
    assert seen == {"pods": [("gpuhub-users", "jupyter-alice")], "window": 60}


# -- a pass costs what is due: kept servers are not evaluated again before their earliest rule


def cpu_server(board, user="ivan", started=0.0, activity=None):
    return ServerView(user, "", board.policy.profile("cpu"), started, activity, team="nlp")


def rules_of(board, profile="cpu"):
    return board.rules_for(board.policy.profile(profile))


def test_a_kept_server_is_warned_at_the_first_pass_past_its_rule_not_later(config):
    board = CullBoard(config=config)
    timeout = rules_of(board).timeout
    assert decide(board, [cpu_server(board)], now=60.0)["ivan/"].action == "keep"
    # passes before the rule fires keep it; the first one after warns, as without the cache
    assert decide(board, [cpu_server(board)], now=timeout - 1)["ivan/"].action == "keep"
    d = decide(board, [cpu_server(board)], now=timeout + 1)["ivan/"]
    assert d.action == "warn" and "no activity" in d.reason


def test_activity_moves_the_next_warning_later_and_a_restart_starts_over(config):
    board = CullBoard(config=config)
    timeout = rules_of(board).timeout
    decide(board, [cpu_server(board)], now=60.0)
    # the user worked at t=1000: the pass after the old due time keeps the server
    assert decide(board, [cpu_server(board, activity=1000.0)], now=timeout + 1)["ivan/"].action == "keep"
    assert decide(board, [cpu_server(board, activity=1000.0)], now=timeout + 1001)["ivan/"].action == "warn"
    # stopped and started again later: a new server, judged from its own start
    fresh = cpu_server(board, started=timeout + 2000)
    assert decide(board, [fresh], now=timeout + 2060)["ivan/"].action == "keep"
    assert board.records["ivan/"].state.deadline is None


def test_a_policy_change_is_applied_at_the_next_pass_to_servers_kept_before(config, tmp_path):
    policy = tmp_path / "policy.yaml"
    text = EXAMPLE.read_text()
    policy.write_text(text)
    config.PolicyStore.policy_file = str(policy)
    import yaml

    from gpuhub_spawner.policy import PolicyStore

    PolicyStore.clear_instance()
    board = CullBoard(config=config)
    try:
        assert decide(board, [cpu_server(board)], now=3 * 3600.0)["ivan/"].action == "keep"
        # an admin shortens the CPU profile's maxAge to 2h: the next pass warns
        data = yaml.safe_load(text)
        for p in data["profiles"]:
            if p["slug"] == "cpu":
                p.setdefault("idle", {})["maxAge"] = "2h"
        policy.write_text(yaml.safe_dump(data))  # the store sees the file change at the next read
        d = decide(board, [cpu_server(board)], now=3 * 3600.0 + 60)["ivan/"]
        assert d.action == "warn" and "maximum age of 2h" in d.reason
    finally:
        PolicyStore.clear_instance()


def test_the_state_file_keeps_what_a_restart_needs_not_every_quiet_server(config):
    board = CullBoard(config=config)
    quiet = [cpu_server(board, user=f"q{i}", activity=50.0) for i in range(200)]
    decide(board, [gpu_server(board, "carol"), *quiet], now=1800.0)  # carol warned, the rest kept
    board.save(force=True)
    saved = json.loads(Path(config.CullBoard.state_file).read_text())
    assert set(saved["records"]) == {"carol/"}
    again = CullBoard(config=config)  # after a restart the quiet servers are judged as before
    d = decide(again, [cpu_server(again, user="q0", activity=50.0)], now=50.0 + rules_of(again).timeout + 1)
    assert d["q0/"].action == "warn"


def test_an_open_lab_is_woken_by_a_cull_and_told_why_the_run_stopped(config):
    """The long poll's wake-up and words (hub/culling_api.py): a cull decided wakes waiters at
    once, and ``stopped_for`` says why this run stops; a later run of the server is not told."""
    board = CullBoard(config=config)

    async def scenario():
        waiting = asyncio.ensure_future(board.wait_change(30))
        await asyncio.sleep(0)
        await board.decide_all([gpu_server(board)], now=1800.0)  # warned: a change
        assert await asyncio.wait_for(waiting, 5) is True
        assert await board.wait_change(0.05) is False  # nothing new: times out
        waiting = asyncio.ensure_future(board.wait_change(30))
        await asyncio.sleep(0)
        await board.decide_all([gpu_server(board)], now=1800.0 + 900)  # the deadline: culled
        assert await asyncio.wait_for(waiting, 5) is True

    asyncio.run(scenario())
    why = board.stopped_for("carol", {"": 0.0})[""]
    assert why["rule"] == "gpu-idle" and "GPUs were idle for 30m" in why["reason"] and why["at"] == 2700.0
    assert board.stopped_for("carol", {"": 3000.0}) == {}  # started again since: not news to it
    # started again within a second of the cull (a quick restart): the new run is not told either
    assert board.stopped_for("carol", {"": 2700.5}) == {}


def test_a_stop_from_the_hub_waits_for_the_open_labs_answer_and_keeps_a_culls_words(config):
    board = CullBoard(config=config)
    written = []

    async def lab_poll():  # what CullWarningsHandler does around its wait
        held = board.answering("carol")
        try:
            await board.wait_change(30)
            written.append(board.stopped_for("carol", {"": 100.0}))
        finally:
            board.answered("carol", held)

    async def scenario():
        poll = asyncio.ensure_future(lab_poll())
        await asyncio.sleep(0)
        await board.stopping("carol/", 100.0, "from the hub", wait=5)
        assert written and written[0][""]["rule"] == "stop", written  # answered before the stop went on
        await poll
        assert board._answering == {}
        # A cull of the same run keeps its words when the culler's stop arrives.
        await board.decide_all([gpu_server(board, "dave", started=200.0)], now=2000.0)
        await board.decide_all([gpu_server(board, "dave", started=200.0)], now=2900.0)
        await board.stopping("dave/", 200.0, "from the hub", wait=0.1)

    asyncio.run(scenario())
    assert board.stopped_for("dave", {"": 200.0})[""]["rule"] == "gpu-idle"
    # a new run of carol's, started within a second of the last stop's notice: not told of it
    assert board.stopped_for("carol", {"": 100.0})[""]["rule"] == "stop"
    assert board.stopped_for("carol", {"": board.stops["carol/"]["at"] + 0.5}) == {}


def test_a_stop_waits_for_the_poll_on_its_way_from_an_open_lab(config):
    """Between two long polls of a visible JupyterLab (one answered, the next on its way), a stop
    waits for the next one to come and be answered, not for nothing; a user with no JupyterLab
    polling is not waited for."""
    board = CullBoard(config=config)

    async def scenario():
        first = board.answering("carol")  # a poll came and was answered: carol's Lab is open
        board.answered("carol", first)
        told = []

        async def next_poll():
            await asyncio.sleep(0.05)  # on its way
            held = board.answering("carol")
            told.append(board.stopped_for("carol", {"": 100.0}))
            board.answered("carol", held)

        poll = asyncio.ensure_future(next_poll())
        await asyncio.wait_for(board.stopping("carol/", 100.0, "from the hub", wait=5), 4)
        assert told and told[0][""]["rule"] == "stop"
        await poll
        t0 = asyncio.get_running_loop().time()
        await board.stopping("dave/", 100.0, "from the hub", wait=5)  # dave has no Lab open
        assert asyncio.get_running_loop().time() - t0 < 1

    asyncio.run(scenario())
