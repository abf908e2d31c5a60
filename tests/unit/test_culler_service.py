"""The culler service's pass: one hub answer, idle-culler stops exactly what it names."""

import asyncio
import inspect

from gpuhub_spawner.culling.service import GpuHubCuller, PassDecisions


def answer(now=1000.0, **decisions):
    return PassDecisions({"now": now, "servers": 5000, "decisions": decisions})


class Engine:
    """Stands in for idle-culler's cull_idle: offers each listed server to the arbiter."""

    def __init__(self, servers):
        self.servers, self.calls, self.stopped = servers, 0, []

    async def __call__(self, cull_arbiter):
        self.calls += 1
        for name in self.servers:
            verdict = cull_arbiter(inactive=None, inactive_limit=1, server={"full_name": name})
            if inspect.isawaitable(verdict):  # idle-culler accepts both (maybe_future)
                verdict = await verdict
            if verdict:
                self.stopped.append(name)


def run_pass(culler, engine, reply):
    async def fetch():
        await asyncio.sleep(0.01)
        return reply

    culler.fetch_decisions = fetch
    asyncio.run(culler.cull_pass(engine))


def test_nothing_due_means_one_request_and_no_listing():
    culler, engine = GpuHubCuller(cull_every=60), Engine(["a/", "b/"])
    run_pass(culler, engine, answer(**{"a/": {"action": "warn", "deadline": 5000.0}}))
    assert engine.calls == 0 and not culler._expect_stops


def test_only_what_the_hub_named_is_stopped_and_a_near_deadline_is_expected():
    culler, engine = GpuHubCuller(cull_every=60), Engine(["a/", "b/", "c/"])
    run_pass(culler, engine, answer(**{"b/": {"action": "cull"}, "c/": {"action": "warn", "deadline": 1030.0}}))
    assert engine.stopped == ["b/"] and culler._expect_stops  # c/ comes due before the next pass
    # next pass: idle-culler lists while the hub decides; its arbiter waits for the answer
    engine2 = Engine(["a/", "c/"])
    run_pass(culler, engine2, answer(now=1060.0, **{"c/": {"action": "cull"}}))
    assert engine2.calls == 1 and engine2.stopped == ["c/"] and not culler._expect_stops


def test_a_failed_answer_stops_nothing_even_when_listing_already_ran():
    culler, engine = GpuHubCuller(cull_every=60), Engine(["a/"])
    culler._expect_stops = True
    run_pass(culler, engine, None)
    assert engine.calls == 1 and engine.stopped == [] and not culler._expect_stops
