"""MIG slices as flavors (issue 25, docs/mig.md): the policy, quota words, one machine's devices."""

import pytest

from gpuhub_spawner.admission.quota import check_fit, demand_for, describe
from gpuhub_spawner.policy import PolicyError, parse_policy

MIG = """\
flavors:
  - name: a100
    displayName: A100
    local: {{match: A100}}
  - name: a100-1g
    displayName: A100 1g.10gb
    mig: {{profile: 1g.10gb{strategy}}}
{labels}    local: {{match: A100, virtual: 7}}
teams:
  - name: students
    groups: [students]
    quota: {{gpus: {{a100-1g: 7, a100: 1}}}}
profiles:
  - slug: mig-1g
    displayName: One slice
    gpu: {{count: {count}, flavor: a100-1g}}
    teams: [students]
"""


def policy(strategy="", labels="", count=1):
    return parse_policy(MIG.format(strategy=strategy, labels=labels, count=count), "p.yaml")


def errors(**kw):
    with pytest.raises(PolicyError) as e:
        policy(**kw)
    return [i.format("p.yaml") for i in e.value.issues]


def test_a_mixed_strategy_slice_is_its_own_resource_and_quota_counts_slices():
    p = policy()
    f = p.flavor("a100-1g")
    assert f.resource == "nvidia.com/mig-1g.10gb" and f.mig.strategy == "mixed"
    assert p.flavor("a100").resource == "nvidia.com/gpu"
    team = p.team("students")
    demand = demand_for(p, p.profile("mig-1g"))
    assert demand["gpu/a100-1g"] == 1
    assert check_fit(p, {"students": {"gpu/a100-1g": 6}}, team, demand).fits
    fit = check_fit(p, {"students": {"gpu/a100-1g": 7}}, team, demand)
    assert not fit.fits and "needs 1 A100 1g.10gb slice:" in fit.shortages[0].reason
    assert describe("gpu/a100-1g", 7, p) == "7 A100 1g.10gb slices"
    assert describe("gpu/a100", 2, p) == "2 A100 GPUs"


def test_two_slices_in_one_server_are_refused_with_the_reason_and_place():
    errs = [e for e in errors(count=2) if "MIG" in e]
    assert len(errs) == 1
    assert errs[0].startswith("p.yaml:16:18: profiles[0].gpu.count: asks for 2 1g.10gb slices")
    assert "a CUDA process uses only the first MIG device it sees" in errs[0]


def test_a_single_strategy_slice_is_nvidia_gpu_keyed_on_the_product_label():
    labels = "    nodeLabels: {nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB-MIG-1g.10gb}\n"
    p = policy(strategy=", strategy: single", labels=labels)
    assert p.flavor("a100-1g").resource == "nvidia.com/gpu"
    errs = errors(strategy=", strategy: single")
    assert len(errs) == 1 and "flavors[1]" in errs[0] and "nvidia.com/gpu.product tells shapes apart" in errs[0]
    wrong = "    nodeLabels: {nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB}\n"
    errs = errors(strategy=", strategy: single", labels=wrong)
    assert len(errs) == 1 and "p.yaml:8:42: flavors[1].nodeLabels.nvidia.com/gpu.product" in errs[0] and "is not a 1g.10gb node" in errs[0]


def test_mig_names_and_resources_are_checked():
    errs = errors(strategy=", strategy: both")
    assert len(errs) == 1 and "flavors[1].mig.strategy" in errs[0]
    bad = MIG.format(strategy="", labels="    resource: nvidia.com/gpu\n", count=1)
    with pytest.raises(PolicyError) as e:
        parse_policy(bad, "p.yaml")
    [issue] = e.value.issues
    assert issue.path == "flavors[1].resource" and "advertises a 1g.10gb slice as nvidia.com/mig-1g.10gb" in issue.message
    with pytest.raises(PolicyError) as e:
        parse_policy(MIG.format(strategy="", labels="", count=1).replace("1g.10gb}", "1g10gb}"), "p.yaml")
    assert "is not a MIG profile name" in e.value.issues[0].message
