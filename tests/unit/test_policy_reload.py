"""A large policy reloads off the event loop and swaps in whole; a broken edit changes nothing."""

import asyncio
import sys
from pathlib import Path

from gpuhub_spawner.policy import PolicyStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bigpolicy import big_policy  # noqa: E402


async def test_big_policy_reloads_in_a_thread_and_swaps_atomically(tmp_path):
    path = tmp_path / "policy.yaml"
    text = big_policy(teams=200, profiles=800)
    path.write_text(text)
    store = PolicyStore(policy_file=str(path), inline_reload_budget=0.0)  # always off the loop
    old = store.current
    seen = []
    store.on_change(seen.append)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    tick = asyncio.ensure_future(ticker())
    path.write_text(text.replace("Team 7\n", "Team Seven\n"))
    assert store.refresh() is False  # started, not done: the caller is not held
    assert store.current is old  # the old policy serves until the new one is whole
    new = await store.fresh()
    tick.cancel()
    assert ticks > 0  # the loop kept running while the file was read
    assert new is not old and new.team("team-007").display_name == "Team Seven"
    assert seen == [new]

    path.write_text(text.replace("teams:", "teams: [oops", 1))  # a broken edit
    assert await store.fresh() is new
    assert store.status.stale and "YAML syntax error" in store.status.errors[0]
