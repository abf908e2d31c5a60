"""Fair share over time (docs/fair-share.md): the policy section, the decayed usage, and the
order the one-machine queue admits in because of it."""

import math

import pytest

from gpuhub_spawner.admission import AdmissionQueue, Ticket
from gpuhub_spawner.admission.fairshare import Interval, UsageLedger, use_per_share
from gpuhub_spawner.admission.reclaim import Holder, Request, plan
from gpuhub_spawner.local.devices import DeviceTable
from gpuhub_spawner.policy import PolicyError, parse_policy

HOUR = 3600.0

POLICY = """\
flavors:
  - name: a100
    local: {virtual: 4}
  - name: t4
    local: {virtual: 2}
teams:
  - name: nlp
    displayName: NLP
    groups: [nlp]
    cohort: lab
    weight: 3
    quota: {gpus: {a100: {nominal: 2}}}
  - name: vision
    displayName: Vision Lab
    groups: [vision]
    cohort: lab
    weight: 2
    quota: {gpus: {a100: {nominal: 1}, t4: {nominal: 2}}}
  - name: speech
    groups: [speech]
    cohort: lab
    quota: {gpus: {a100: {nominal: 1}}}
profiles:
  - {slug: g1, displayName: g1, gpu: {count: 1, flavor: a100}, teams: "*"}
  - {slug: t1, displayName: t1, gpu: {count: 1, flavor: t4}, teams: "*"}
"""

FAIR = """\
fairShare:
  halfLife: 1h
  flavorWeights: {a100: 2, t4: 1}
"""


class Clock:
    def __init__(self, t=1_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


def errors(text):
    with pytest.raises(PolicyError) as e:
        parse_policy(text, "p.yaml")
    return [i.format("p.yaml") for i in e.value.issues]


def ticket(key, team, flavor="a100", n=1, created=0.0, priority=0):
    return Ticket(
        key=key, user=key.split("/")[0], team=team, profile="g1", demand={f"gpu/{flavor}": n}, created=created, priority=priority
    )


def queue_for(policy, clock):
    q = AdmissionQueue(lambda: policy, DeviceTable(lambda: policy, discover=lambda: []), clock=clock)
    q.fair.configure(policy)  # the hub's recorder does this before seeding (usage/recorder.py)
    return q


# -- policy ----------------------------------------------------------------------------------


def test_a_policy_that_says_nothing_keeps_fifo():
    policy = parse_policy(POLICY.replace("    weight: 3\n", "").replace("    weight: 2\n", ""))
    assert policy.fair is None and all(t.weight == 1 for t in policy.teams)


def test_defaults_and_shares():
    policy = parse_policy(POLICY + "fairShare: {}\n")
    fs = policy.fair
    assert fs.half_life == 24 * HOUR and fs.min_runtime == 0 and fs.users is False
    assert fs.flavor_weight("a100") == 1.0
    assert [round(policy.share_of(t) * 100) for t in policy.teams] == [50, 33, 17]
    assert parse_policy(POLICY + "fairShare: {enabled: false}\n").fair is None


def test_located_errors():
    bad = POLICY + "fairShare:\n  halfLife: 10s\n  flavorWeights: {a10: 2}\n  minRuntime: 2h\n  userz: true\n"
    msgs = "\n".join(errors(bad))
    assert "fairShare.halfLife: must be between 1m and 365d" in msgs
    assert "fairShare.userz: unknown key 'userz' (did you mean 'users'?)" in msgs
    bad = POLICY + "fairShare:\n  flavorWeights: {a10: 2}\n  minRuntime: 2h\n"
    msgs = "\n".join(errors(bad))
    assert "fairShare.flavorWeights.a10: unknown flavor 'a10' (did you mean 'a100'?)" in msgs
    assert (
        "fairShare.minRuntime: minRuntime (2h) plus the reclaim notice (10m) must be shorter than defaults.queueTimeout (1h)"
        in msgs
    )
    # a weight without fair share would silently do nothing: said, at the weight's line
    (msg,) = errors(POLICY)
    assert msg.startswith("p.yaml:11:13: teams[0].weight: a weight only counts with fair share on")
    assert "p.yaml:11:13: teams[0].weight: must be at least 0.0 (got -1)" in "\n".join(
        errors(POLICY.replace("weight: 3", "weight: -1") + FAIR)
    )


# -- decayed usage ---------------------------------------------------------------------------


def test_usage_decays_by_half_life_and_weights_flavors():
    clock = Clock()
    policy = parse_policy(POLICY + FAIR)
    ledger = UsageLedger(clock, half_life=HOUR)
    ledger.admit("a/", "nlp", "a", {"gpu/a100": 1, "cpu": 1000}, policy)
    clock.t += HOUR
    held = 2 * HOUR / math.log(2) * 0.5  # integral of 2 (a100 weight) over one half-life
    assert ledger.team("nlp") == pytest.approx(held)
    ledger.release("a/")
    clock.t += HOUR
    assert ledger.team("nlp") == pytest.approx(held / 2)
    assert ledger.user("nlp", "a") == pytest.approx(held / 2)
    assert ledger.team("vision") == 0


def test_seed_from_history_equals_what_was_counted_live():
    clock = Clock()
    policy = parse_policy(POLICY + FAIR)
    live = UsageLedger(clock, half_life=HOUR)
    t0 = clock.t
    live.admit("a/", "nlp", "a", {"gpu/a100": 2}, policy)
    live.admit("b/", "vision", "b", {"gpu/t4": 1}, policy)
    clock.t += 2 * HOUR
    live.release("a/")
    clock.t += 0.5 * HOUR
    # a restart: a new ledger reads the same allocations from the history (b still held)
    seeded = UsageLedger(clock, half_life=HOUR)
    seeded.seed([Interval("nlp", "a", "a100", 2, t0, t0 + 2 * HOUR), Interval("vision", "b", "t4", 1, t0, None)], policy)
    seeded.admit("b/", "vision", "b", {"gpu/t4": 1}, policy)
    for team in ("nlp", "vision"):
        assert seeded.team(team) == pytest.approx(live.team(team))
    clock.t += HOUR
    assert seeded.team("vision") == pytest.approx(live.team("vision"))


# -- the queue's order -----------------------------------------------------------------------


def fill(q, clock, n=4):
    """Every a100 taken by speech (borrowing), so the next requests wait."""
    for i in range(n):
        q.submit(ticket(f"s{i}/", "speech", created=clock.t))
    assert sum(q.usage()["speech"].values()) == n


def test_without_fair_share_arrival_decides():
    clock = Clock()
    policy = parse_policy(POLICY.replace("    weight: 3\n", "").replace("    weight: 2\n", ""))
    q = queue_for(policy, clock)
    q.fair.admit("old/", "nlp", "x", {"gpu/a100": 4}, policy)  # heavy history for nlp
    clock.t += 2 * HOUR
    fill(q, clock)
    q.submit(ticket("n/", "nlp", created=clock.t))
    q.submit(ticket("v/", "vision", created=clock.t + 1))
    q.release("s0/")
    assert "n/" in q.admitted and "v/" not in q.admitted


def test_team_with_less_recent_use_is_admitted_first_and_told_why():
    clock = Clock()
    policy = parse_policy(POLICY.replace("weight: 2", "weight: 3") + FAIR)
    q = queue_for(policy, clock)
    q.fair.admit("old/", "nlp", "x", {"gpu/a100": 2}, policy)  # nlp held 2 GPUs for 3 hours
    clock.t += 3 * HOUR
    q.fair.release("old/")
    fill(q, clock)
    q.submit(ticket("n/", "nlp", created=clock.t))  # nlp asks first
    q.submit(ticket("v/", "vision", created=clock.t + 1))
    words = q.ticket("n/").status.message
    assert "Fair share: NLP used" in words and "against a share of 43%" in words
    assert "NLP used 5 GPU-hours lately (usage halves every 1h)" in words  # 2 GPUs (weight 2) x 3 h, decayed
    assert "Vision Lab no GPU time against 43%: Vision Lab goes first" in words
    assert "no team waiting beside it used less" in q.ticket("v/").status.message
    q.release("s0/")
    assert "v/" in q.admitted and "n/" not in q.admitted


def test_weight_counts_usage_per_unit_of_weight():
    clock = Clock()
    policy = parse_policy(POLICY + FAIR)  # nlp weight 3, vision 2
    q = queue_for(policy, clock)
    q.fair.admit("a/", "nlp", "a", {"gpu/a100": 1}, policy)
    q.fair.admit("b/", "vision", "b", {"gpu/a100": 1}, policy)
    clock.t += HOUR
    q.fair.release("a/")
    q.fair.release("b/")
    # equal usage: nlp's is smaller per unit of weight
    fill(q, clock)
    q.submit(ticket("v/", "vision", created=clock.t))
    q.submit(ticket("n/", "nlp", created=clock.t + 1))
    q.release("s0/")
    assert "n/" in q.admitted


def test_borrowed_capacity_is_shared_by_weight():
    clock = Clock()
    policy = parse_policy(POLICY + FAIR)  # 4 a100s; nominal nlp 2 (weight 3), vision 1 (weight 2), speech 1
    q = queue_for(policy, clock)
    for key, team in [("n0/", "nlp"), ("n1/", "nlp"), ("v0/", "vision"), ("s0/", "speech")]:
        q.submit(ticket(key, team, created=clock.t))
    # both want more than their nominal: vision asks first, twice; nlp after
    q.submit(ticket("v1/", "vision", created=clock.t + 1))
    q.submit(ticket("v2/", "vision", created=clock.t + 2))
    q.submit(ticket("n2/", "nlp", created=clock.t + 3))
    q.submit(ticket("n3/", "nlp", created=clock.t + 4))
    q.release("s0/")  # one idle GPU to lend: borrowing 1 is 2/3 of nlp's weight, 2/2 of vision's
    assert "n2/" in q.admitted and "v1/" not in q.admitted
    q.release("n0/")  # nlp is back at its nominal: borrowing 1 is again 2/3 per weight against vision's 2/2
    assert "n3/" in q.admitted
    q.release("n1/")  # nlp has nothing waiting: vision borrows
    assert "v1/" in q.admitted


def test_users_inside_a_team_by_recent_use():
    clock = Clock()
    policy = parse_policy(POLICY + FAIR + "  users: true\n")
    q = queue_for(policy, clock)
    q.fair.admit("old/", "nlp", "greedy", {"gpu/a100": 2}, policy)
    clock.t += HOUR
    q.fair.release("old/")
    fill(q, clock)
    for i in range(3):
        q.submit(ticket(f"greedy/{i}", "nlp", created=clock.t + i))
    q.submit(ticket("quiet/", "nlp", created=clock.t + 10))
    st = q.ticket("quiet/").status
    assert st.position == 1 and "Within NLP, you used no GPU time lately" in st.message
    assert q.ticket("greedy/0").status.position == 2
    q.release("s0/")
    assert "quiet/" in q.admitted


def test_minimum_runtime_protects_a_young_borrower():
    policy = parse_policy(POLICY + FAIR + "  minRuntime: 20m\n")
    now = 10_000.0
    holders = [Holder("s/", "speech", {"gpu/a100": 3}, admitted=now - 60)]
    usage = {"speech": {"gpu/a100": 3}, "nlp": {"gpu/a100": 1}}
    req = [Request("n/", "nlp", {"gpu/a100": 1})]
    p = plan(policy, usage, holders, req, {"gpu/a100": 0}, now=now, min_runtime=1200)
    assert p.reclaim == {} and p.protected == {"n/": now - 60 + 1200}
    p = plan(policy, usage, holders, req, {"gpu/a100": 0}, now=now + 1200, min_runtime=1200)
    assert p.reclaim == {"s/": ("nlp", "n/")}


@pytest.mark.parametrize("fair", [True, False])
def test_freed_gpus_wait_for_the_bigger_request_of_the_team_ahead(fair):
    clock = Clock()
    text = POLICY + (FAIR if fair else "")
    if not fair:
        text = text.replace("    weight: 3\n", "").replace("    weight: 2\n", "")
    policy = parse_policy(text)
    q = queue_for(policy, clock)
    for i in range(3):
        q.submit(ticket(f"s{i}/", "speech", created=clock.t))  # speech borrows nlp's idle quota
    q.submit(ticket("v/", "vision", created=clock.t))
    q.submit(ticket("n/", "nlp", n=2, created=clock.t + 1))  # nlp wants its own 2 back
    q.submit(ticket("s3/", "speech", created=clock.t + 2))  # and speech wants one more
    q.release("s0/")  # one GPU frees: not enough for nlp's two
    if fair:
        assert "s3/" not in q.admitted and len(q.admitted) == 3  # kept for nlp, not lent again
        assert "what frees is kept for a larger request of NLP, ahead of yours in fair-share order" in (
            q.ticket("s3/").status.message
        )
        q.release("s1/")
        assert "n/" in q.admitted
    else:
        assert "s3/" in q.admitted  # FIFO as today: the small request takes it, nlp waits on
        q.release("s1/")
        assert "n/" not in q.admitted


def test_replay_benchmark_is_fairer_than_fifo():
    """tests/benchmarks/fair_share.py on a smaller machine: fair share tracks the weights, FIFO does not."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "fair_share.py"
    spec = importlib.util.spec_from_file_location("gpuhub_fair_share_bench", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    try:
        spec.loader.exec_module(bench)
        assert bench.water_fill(12, {"a": 10, "b": 1, "c": 10}, {"a": 3, "b": 2, "c": 1}) == pytest.approx(
            {"a": 8.25, "b": 1, "c": 2.75}
        )
        results = bench.run(bench.parse_args(["--gpus", "6", "--greedy", "6", "--seed", "2"]))
        fair, fifo = results["fair share"], results["FIFO"]
        assert fair.contended_minutes > 0 and fair.deviation() < fifo.deviation()
        assert fair.deviation() <= 5
    finally:
        sys.modules.pop(spec.name, None)


def test_use_per_share_over_time_for_the_usage_page():
    policy = parse_policy(POLICY + FAIR)  # a100 weighs 2, t4 1; shares 50 / 33 / 17 %
    t0 = 1_000_000.0
    rows = [
        Interval("nlp", "a", "a100", 1, t0, t0 + HOUR),  # weighted 2 per hour
        Interval("vision", "b", "t4", 2, t0, None),  # weighted 2 per hour, still held
    ]
    series = use_per_share(policy, rows, [t0, t0 + HOUR], teams={"nlp", "vision"})
    assert set(series) == {"nlp", "vision"}
    assert series["nlp"][0] == (t0, 0.0)  # nothing used yet
    # one hour in: equal use, so half each: nlp at 0.5 / 0.5 = 1, vision at 0.5 / (1/3) = 1.5
    assert series["nlp"][1][1] == pytest.approx(1.0, abs=1e-3)
    assert series["vision"][1][1] == pytest.approx(1.5, abs=1e-3)
    assert use_per_share(parse_policy(POLICY.replace("    weight: 3\n", "").replace("    weight: 2\n", "")), rows, [t0]) == {}


def test_no_capacity_is_kept_for_a_request_the_usable_devices_cannot_hold():
    """2 t4 on the machine, one drained: vision's 2-GPU t4 request cannot start until it is back,
    and must not hold the flavor meanwhile (speech's 1-GPU request goes)."""
    clock = Clock()
    policy = parse_policy(POLICY + FAIR)
    q = queue_for(policy, clock)
    q.allocator.health.drain(q.allocator.devices[-1].id, by="admin")
    assert [d.flavor for d in q.allocator.devices].count("t4") == 2 and q.allocator.devices[-1].flavor == "t4"
    q.submit(Ticket("v/", "v", "vision", "t1", {"gpu/t4": 2}, created=clock.t))
    q.submit(Ticket("s/", "s", "speech", "t1", {"gpu/t4": 1}, created=clock.t + 1))
    assert "s/" in q.admitted and "v/" not in q.admitted
