"""Which borrowed GPUs come back, and for whom (admission/reclaim.py: Kueue's order)."""

import pytest

from gpuhub_spawner.admission.reclaim import Holder, Request, plan
from gpuhub_spawner.policy import parse_policy
from gpuhub_spawner.policy.loader import PolicyError

BASE = """\
flavors: [{{name: a100, local: {{virtual: 4}}}}]
priorityClasses: [{{name: interactive, value: 1000}}, {{name: batch, value: 100}}]
teams:
  - {{name: vision, groups: [v], cohort: lab, quota: {{gpus: {{a100: 2}}}}}}
  - {{name: nlp, groups: [n], cohort: lab, displayName: NLP Group, quota: {{gpus: {{a100: 2}}}}{nlp_extra}}}
  - {{name: solo, groups: [s], quota: {{gpus: {{a100: 0}}}}}}
profiles:
  - {{slug: g1, displayName: G, gpu: {{count: 1, flavor: a100}}, teams: "*"}}
{defaults}"""

K = "gpu/a100"


def policy(nlp_extra="", defaults=""):
    return parse_policy(BASE.format(nlp_extra=nlp_extra, defaults=defaults))


def H(key, team, n=1, priority=1000, admitted=0.0, job=False):
    return Holder(key, team, {K: n}, priority, admitted, job)


def test_lender_within_nominal_takes_back_from_the_borrower():
    # vision holds 3 (nominal 2: borrows 1 of nlp's); nlp holds 1 and asks for its 2nd.
    p = policy()
    usage = {"vision": {K: 3}, "nlp": {K: 1}}
    holders = [H("v/a", "vision", admitted=1), H("v/b", "vision", admitted=2), H("v/c", "vision", admitted=3), H("n/a", "nlp")]
    out = plan(p, usage, holders, [Request("n/b", "nlp", {K: 1})], free_devices={K: 0})
    assert out.reclaim == {"v/c": ("nlp", "n/b")}  # the most recently admitted
    assert out.covered == {"n/b": ["v/c"]}


def test_lowest_priority_first_then_most_recent():
    p = policy()
    usage = {"vision": {K: 4}}
    holders = [
        H("v/job-old", "vision", priority=100, admitted=1, job=True),
        H("v/job-new", "vision", priority=100, admitted=5, job=True),
        H("v/srv-newest", "vision", priority=1000, admitted=9),
        H("v/srv", "vision", admitted=2),
    ]
    out = plan(p, usage, holders, [Request("n/a", "nlp", {K: 1})], free_devices={K: 0})
    assert list(out.reclaim) == ["v/job-new"]
    out = plan(p, usage, holders, [Request("n/a", "nlp", {K: 2})], free_devices={K: 0})
    assert sorted(out.reclaim) == ["v/job-new", "v/job-old"]


def test_never_below_the_borrowers_own_nominal():
    # vision borrows 1: only one of its holders may be taken, even for a bigger request.
    p = policy()
    usage = {"vision": {K: 3}, "nlp": {K: 0}}
    holders = [H("v/a", "vision", admitted=1), H("v/b", "vision", admitted=2), H("v/c", "vision", admitted=3)]
    out = plan(p, usage, holders, [Request("n/a", "nlp", {K: 2})], free_devices={K: 1})
    assert out.reclaim == {"v/c": ("nlp", "n/a")}  # 1 free + 1 back = 2
    out = plan(p, usage, holders, [Request("n/a", "nlp", {K: 2})], free_devices={K: 0})
    assert out.reclaim == {}  # would need vision below its own quota: nothing is taken


def test_request_that_borrows_itself_takes_nothing():
    p = policy()
    usage = {"vision": {K: 3}, "nlp": {K: 2}}
    out = plan(p, usage, [H("v/c", "vision")], [Request("n/c", "nlp", {K: 1})], free_devices={K: 0})
    assert out.reclaim == {}


def test_no_reclaim_when_it_fits_or_nobody_borrows():
    p = policy()
    out = plan(p, {"vision": {K: 3}}, [H("v/c", "vision")], [Request("n/a", "nlp", {K: 1})], free_devices={K: 1})
    assert out.reclaim == {}  # a free device: no one is disturbed
    out = plan(p, {"vision": {K: 2}, "nlp": {K: 1}}, [H("v/c", "vision")], [Request("n/a", "nlp", {K: 1})], free_devices={K: 0})
    assert out.reclaim == {}  # vision is within its quota: the device is not on loan


def test_holder_under_notice_goes_first_and_is_not_doubled():
    p = policy()
    usage = {"vision": {K: 4}}
    holders = [H("v/old", "vision", admitted=1), H("v/new", "vision", admitted=9)]
    out = plan(p, usage, holders, [Request("n/a", "nlp", {K: 1})], free_devices={K: 0}, under_notice={"v/old"})
    assert list(out.reclaim) == ["v/old"]
    # Two waiting requests: each gets its own holder, in queue order.
    out = plan(p, usage, holders, [Request("n/a", "nlp", {K: 1}), Request("n/b", "nlp", {K: 1})], free_devices={K: 0})
    assert out.reclaim == {"v/new": ("nlp", "n/a"), "v/old": ("nlp", "n/b")}


def test_unneeded_picks_are_put_back():
    p = policy()
    usage = {"vision": {K: 4}}
    holders = [H("v/one", "vision", admitted=9, priority=100), H("v/two", "vision", n=2, admitted=5, priority=1000)]
    # Needs 2: the 1-GPU job goes first but is not enough; the 2-GPU server alone is.
    out = plan(p, usage, holders, [Request("n/a", "nlp", {K: 2})], free_devices={K: 0})
    assert list(out.reclaim) == ["v/two"]


def test_reclaim_disabled_for_the_lender():
    p = policy(nlp_extra=", reclaim: {enabled: false}")
    out = plan(p, {"vision": {K: 4}}, [H("v/c", "vision")], [Request("n/a", "nlp", {K: 1})], free_devices={K: 0})
    assert out.reclaim == {}


def test_kubernetes_has_no_device_count():
    p = policy()
    out = plan(p, {"vision": {K: 3}, "nlp": {K: 1}}, [H("v/c", "vision")], [Request("n/b", "nlp", {K: 1})], free_devices=None)
    assert out.reclaim == {"v/c": ("nlp", "n/b")}


def test_policy_notice_is_checked_where_it_is_written():
    with pytest.raises(PolicyError) as e:
        policy(nlp_extra=", reclaim: {notice: 2h}")
    assert "teams[1].reclaim.notice" in str(e.value) or "teams.1.reclaim.notice" in str(e.value)
    assert "queueTimeout" in str(e.value)
    with pytest.raises(PolicyError) as e:
        policy(nlp_extra=", reclaim: {noticePeriod: 1m}")
    assert "noticePeriod" in str(e.value)
    p = policy(defaults="defaults: {reclaim: {notice: 5m}}\n", nlp_extra=", reclaim: {interactiveBorrowing: false}")
    assert p.reclaim_rules(p.team("nlp")).notice == 300 and not p.reclaim_rules(p.team("nlp")).interactive_borrowing
    assert p.reclaim_rules(p.team("vision")).enabled and p.reclaim_rules(p.team("vision")).interactive_borrowing
