"""The culling decision: busy GPUs are kept, idle GPUs are freed, users are warned first."""

from gpuhub_spawner.culling.rules import CullState, Signals, decide, snooze
from gpuhub_spawner.policy.model import IdleRules

RULES = IdleRules(timeout=3600, gpu_idle_timeout=900, gpu_busy_threshold=5, max_age=86400, warning=300, snooze=600, max_snoozes=2)


def run(signals, state=None, now=10_000.0, has_gpus=True, rules=RULES):
    state = state or CullState()
    return decide(now, rules, signals, state, has_gpus), state


def test_busy_gpu_is_kept_even_with_no_browser_or_kernel_activity():
    d, _ = run(Signals(inactive=50_000, kernels_idle=50_000, gpu_idle=0, age=60_000))
    assert d.action == "keep"


def test_idle_gpu_with_open_browser_tab_is_warned_then_culled():
    state = CullState()
    # browser keeps hub activity fresh; GPUs and kernels idle past gpuIdleTimeout - warning
    d, state = run(Signals(inactive=5, kernels_idle=700, gpu_idle=700, age=3000), state, now=1000)
    assert d.action == "warn" and d.deadline == 1000 + 300 and "GPUs and kernels were idle" in d.reason
    d, state = run(Signals(inactive=5, kernels_idle=900, gpu_idle=900, age=3200), state, now=1200)
    assert d.action == "warn"  # never before the announced deadline
    d, state = run(Signals(inactive=5, kernels_idle=1000, gpu_idle=1000, age=3300), state, now=1300)
    assert d.action == "cull"


def test_activity_clears_the_warning():
    d, state = run(Signals(inactive=3400, kernels_idle=3400, gpu_idle=None, age=4000), has_gpus=False)
    assert d.action == "warn"
    d, state = run(Signals(inactive=10, kernels_idle=10, gpu_idle=None, age=4100), state, has_gpus=False)
    assert d.action == "keep" and state.deadline is None


def test_cpu_profile_follows_its_own_longer_timeout():
    cpu = IdleRules(timeout=8 * 3600, warning=300, max_snoozes=0)
    d, _ = run(Signals(inactive=7200, kernels_idle=7200, gpu_idle=None, age=7200), has_gpus=False, rules=cpu)
    assert d.action == "keep"
    d, _ = run(Signals(inactive=8 * 3600, kernels_idle=8 * 3600, gpu_idle=None, age=9 * 3600), has_gpus=False, rules=cpu)
    assert d.action == "warn"


def test_snooze_postpones_and_is_limited():
    state = CullState()
    d, state = run(Signals(inactive=5, kernels_idle=800, gpu_idle=800, age=3000), state, now=1000)
    assert d.action == "warn"
    ok, msg = snooze(1000, RULES, state)
    assert ok and "snooze 1 of 2" in msg
    # at the old deadline it is not culled
    d, state = run(Signals(inactive=5, kernels_idle=1100, gpu_idle=1100, age=3300), state, now=1300)
    assert d.action in ("keep", "warn") and d.action != "cull"
    assert snooze(1300, RULES, state)[0]
    ok, msg = snooze(1301, RULES, state)
    assert not ok and "No snoozes left" in msg


def test_max_age_applies_even_when_busy_and_ignores_snooze():
    state = CullState()
    d, state = run(Signals(inactive=0, kernels_idle=0, gpu_idle=0, age=86400 - 100), state, now=0)
    assert d.action == "warn" and "maximum age" in d.reason
    ok, msg = snooze(0, RULES, state)
    assert not ok and "maximum age" in msg
    d, state = run(Signals(inactive=0, kernels_idle=0, gpu_idle=0, age=86400 + 300), state, now=400)
    assert d.action == "cull"


def test_a_quiet_phase_in_a_detached_training_run_is_not_a_stop():
    # browser closed hours ago; the GPU dipped for one reading (checkpoint, evaluation)
    state = CullState()
    d, state = run(Signals(inactive=20_000, kernels_idle=20_000, gpu_idle=0, age=20_000), state, now=0)
    assert d.action == "keep"
    d, state = run(Signals(inactive=20_060, kernels_idle=20_060, gpu_idle=60, age=20_060), state, now=60)
    assert d.action == "keep" and state.deadline is None
