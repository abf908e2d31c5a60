"""The culler service's pass: one hub answer, then only what it names as due is stopped.

The stop of one server against a real hub (the look before, 202/404, named servers, the
audit) is tests/integration/test_culler_stops.py; here, what a pass does with an answer.
"""

import asyncio

from gpuhub_spawner.culling.service import FAILED, STOPPED, GpuHubCuller, PassDecisions


def answer(now=1000.0, **decisions):
    return PassDecisions({"now": now, "servers": 5000, "decisions": decisions})


class Recorder(GpuHubCuller):
    """The service with the hub's answer given and each stop recorded instead of sent."""

    def __init__(self, reply, fail=(), **kw):
        super().__init__(**kw)
        self.reply, self.fail, self.stopped, self.running, self.most = reply, set(fail), [], 0, 0

    async def fetch_decisions(self):
        await asyncio.sleep(0.01)
        return self.reply

    async def stop_one(self, key, decision):
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.sleep(0.01)
            if key in self.fail:
                raise OSError("connection refused")
            self.stopped.append((key, decision.get("started")))
            return STOPPED
        finally:
            self.running -= 1


def test_nothing_due_means_one_request_and_no_stop():
    culler = Recorder(answer(**{"a/": {"action": "warn", "deadline": 5000.0}}))
    assert asyncio.run(culler.cull_pass()) == {} and culler.stopped == []


def test_only_what_the_hub_named_is_stopped_with_the_start_it_decided_about():
    culler = Recorder(
        answer(
            **{
                "b/": {"action": "cull", "started": 10.0},
                "c/": {"action": "warn", "deadline": 1030.0},
                "d/x": {"action": "cull", "started": 20.0},
            }
        )
    )
    assert asyncio.run(culler.cull_pass()) == {STOPPED: 2}
    assert sorted(culler.stopped) == [("b/", 10.0), ("d/x", 20.0)]


def test_stops_run_a_few_at_a_time_and_one_failure_does_not_keep_the_others():
    due = {f"u{i}/": {"action": "cull", "started": 1.0} for i in range(30)}
    culler = Recorder(answer(**due), fail={"u3/"}, concurrency=5)
    counts = asyncio.run(culler.cull_pass())
    assert counts == {STOPPED: 29, FAILED: 1}
    assert 1 < culler.most <= 5


def test_a_failed_answer_stops_nothing():
    culler = Recorder(None)
    assert asyncio.run(culler.cull_pass()) is None and culler.stopped == []
