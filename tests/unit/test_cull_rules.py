"""The culling decision: warned at the timeout, stopped after the warning, never against the user.

Times are epoch seconds; a server started at t=0. Only hub-recorded times go in:
start, last activity, last trusted busy GPU reading, when the hub heard of a person on the
open JupyterLab (``CullState.person_seen``).
"""

from gpuhub_spawner.culling.rules import GPU_IDLE, MAX_AGE, TIMEOUT, CullState, Signals, decide, snooze
from gpuhub_spawner.policy.model import IdleRules

GPU = IdleRules(
    timeout=3600, gpu_idle_timeout=1800, gpu_busy_threshold=5, max_age=7 * 86400, warning=900, snooze=3600, max_snoozes=2
)
CPU = IdleRules(timeout=8 * 3600, warning=900, max_snoozes=0)


def step(now, rules, state, *, activity=None, gpu_busy=None, gpus=True):
    return decide(now, rules, Signals(started=0.0, last_activity=activity, gpu_last_busy=gpu_busy, has_gpus=gpus), state)


def test_untouched_cpu_server_is_warned_at_its_timeout_and_stopped_after_the_warning():
    s = CullState()
    assert step(CPU.timeout - 1, CPU, s, gpus=False).action == "keep"
    d = step(CPU.timeout, CPU, s, gpus=False)
    assert d.action == "warn" and d.rule == TIMEOUT and d.deadline == CPU.timeout + 900
    assert step(CPU.timeout + 899, CPU, s, gpus=False).action == "warn"
    assert step(CPU.timeout + 900, CPU, s, gpus=False).action == "cull"


def test_a_user_who_comes_back_before_the_deadline_is_never_stopped_whatever_the_warning_length():
    long_warning = IdleRules(timeout=120, warning=110)  # the alice case, within what the validator accepts
    s = CullState()
    assert step(120, long_warning, s, gpus=False).action == "warn"
    # she types at t=200 (activity recorded after the idle period began): the warning goes
    d = step(229, long_warning, s, activity=200, gpus=False)
    assert d.action == "keep" and s.deadline is None
    # and the next stop is a full timeout after her activity, with a fresh warning
    assert step(319, long_warning, s, activity=200, gpus=False).action == "keep"
    assert step(320, long_warning, s, activity=200, gpus=False).action == "warn"


def test_an_idle_gpu_is_released_after_gpu_idle_timeout_plus_warning_whatever_the_browser_does():
    s = CullState()
    # an open, untouched JupyterLab keeps the hub's activity fresh (it polls every few seconds);
    # the GPU never reads busy: that traffic is nobody coming back, so no snooze is spent
    d = step(1800, GPU, s, activity=1799)
    assert d.action == "warn" and d.rule == GPU_IDLE and "GPUs were idle" in d.reason
    assert step(2699, GPU, s, activity=2698).action == "warn"
    d = step(2700, GPU, s, activity=2699)
    assert d.action == "cull" and s.snoozes == 0 and s.returned == 0
    assert 2700 == GPU.gpu_idle_timeout + GPU.warning


def test_a_person_seen_after_the_warning_spends_one_snooze_each_deadline_until_none_are_left():
    s = CullState()
    assert step(1800, GPU, s, activity=1799).action == "warn"
    # someone clicked in the open JupyterLab after the warning (the hub's time of the report)
    s.person_seen = 2000.0
    d = step(2700, GPU, s, activity=2699)
    assert d.action == "warn" and s.snoozes == 1 and s.returned == 1 and d.deadline == 2700 + 3600
    # the same report does not count twice: the fresh warning needs a fresh sign of a person
    assert s.warned_at == 2700
    d = step(6300, GPU, s, activity=6299)
    assert d.action == "cull" and s.snoozes == 1


def test_a_person_there_all_along_is_kept_at_most_max_snoozes_times():
    s = CullState()
    assert step(1800, GPU, s).action == "warn"
    for deadline in (2700, 6300):
        s.person_seen = deadline - 1.0
        assert step(deadline, GPU, s).action == "warn"
    assert s.snoozes == 2
    s.person_seen = 9899.0
    # ... and when they are used up the GPU goes, as the last warning said
    assert step(9900, GPU, s).action == "cull"
    assert 9900 == GPU.gpu_idle_timeout + GPU.warning + GPU.max_snoozes * GPU.snooze


def test_a_person_seen_before_the_warning_spends_nothing():
    s = CullState(person_seen=1700.0)
    assert step(1800, GPU, s).action == "warn"
    assert step(2700, GPU, s).action == "cull"


def test_a_person_seen_does_not_keep_a_server_warned_for_no_activity():
    """The ``timeout`` rule is about activity (it withdraws its warning); a report adds nothing."""
    s = CullState()
    assert step(CPU.timeout, CPU, s, gpus=False).action == "warn"
    s.person_seen = CPU.timeout + 10.0
    assert step(CPU.timeout + 900, CPU, s, gpus=False).action == "cull"


def test_a_busy_gpu_keeps_the_server_with_no_browser_and_ends_a_warning():
    s = CullState()
    assert step(30_000, GPU, s, activity=10, gpu_busy=29_990).action == "keep"
    s = CullState()
    assert step(1800, GPU, s).action == "warn"
    d = step(2000, GPU, s, gpu_busy=1950)  # training started
    assert d.action == "keep" and s.deadline is None and s.snoozes == 0


def test_unknown_gpu_counts_as_idle():
    # no trusted reading ever (virtual GPU, no NVML, no DCGM series): idle since start
    s = CullState()
    assert step(1800, GPU, s, activity=1790).action == "warn"


def test_user_snooze_postpones_and_is_limited():
    s = CullState()
    step(1800, GPU, s)
    ok, msg = snooze(1900, GPU, s)
    assert ok and "snooze 1 of 2" in msg and s.deadline == 2700 + 3600
    assert step(2700, GPU, s).action == "warn"  # not at the old deadline
    assert snooze(2800, GPU, s)[0]
    ok, msg = snooze(2801, GPU, s)
    assert not ok and "No snoozes left" in msg
    assert step(2700 + 7200, GPU, s).action == "cull"


def test_no_pending_stop_no_snooze():
    ok, msg = snooze(10, GPU, CullState())
    assert not ok and "no pending stop" in msg


def test_max_age_applies_even_when_busy_and_ignores_snoozes():
    s = CullState()
    age = GPU.max_age
    d = step(age, GPU, s, activity=age, gpu_busy=age)
    assert d.action == "warn" and d.rule == MAX_AGE
    ok, msg = snooze(age + 1, GPU, s)
    assert not ok and "maximum age" in msg
    assert step(age + 900, GPU, s, activity=age + 899, gpu_busy=age + 899).action == "cull"


def test_cpu_profile_follows_its_own_longer_timeout():
    s = CullState()
    assert step(7200, CPU, s, activity=0, gpus=False).action == "keep"


def test_a_quiet_phase_in_a_detached_training_run_is_not_a_stop():
    s = CullState()
    assert step(20_000, GPU, s, activity=0, gpu_busy=20_000).action == "keep"
    assert step(20_060, GPU, s, activity=0, gpu_busy=20_000).action == "keep" and s.deadline is None


def test_kernel_activity_cannot_keep_an_idle_gpu():
    # the server reports activity every few seconds (what a user's server can forge):
    # it keeps the *timeout* rule away, never the GPU rule
    s = CullState()
    for t in range(0, 1800, 60):
        assert step(t, GPU, s, activity=t).action == "keep"
    assert step(1800, GPU, s, activity=1800).action == "warn"


def test_the_snooze_message_says_what_keeps_the_server_for_its_rule():
    """A GPU-idle warning is not lifted by using the server (only by a busy GPU): the snooze
    answer the home page shows said 'unless it becomes active' for every rule."""
    from gpuhub_spawner.culling.rules import CullState, snooze
    from gpuhub_spawner.policy.model import IdleRules

    rules = IdleRules(snooze=600, max_snoozes=2)
    gpu = CullState(deadline=1000.0, rule="gpu-idle", reason="its GPUs were idle for 30m")
    ok, message = snooze(900.0, rules, gpu)
    assert ok and message.endswith("unless its GPUs are used."), message
    idle = CullState(deadline=1000.0, rule="idle", reason="inactive for 1h")
    ok, message = snooze(900.0, rules, idle)
    assert ok and message.endswith("unless it is used."), message
