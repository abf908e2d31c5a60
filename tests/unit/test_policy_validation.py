"""`gpuhub validate` explains every mistake with its YAML path and line:column."""

import subprocess
import sys
from pathlib import Path

import pytest

from gpuhub_spawner.policy import PolicyError, load_policy, parse_policy

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "jupyterhub_config" / "profiles.yaml"

BASE = """\
flavors:
  - name: a100
    local: {virtual: 2}
teams:
  - name: vision
    groups: [vision-lab]
    quota:
      gpus:
        a100: {nominal: 2}
    perUser: {maxGPUs: 2}
profiles:
  - slug: gpu
    displayName: One GPU
    gpu: {count: 1, flavor: a100}
    teams: [vision]
"""


def errors(text):
    with pytest.raises(PolicyError) as e:
        parse_policy(text, "p.yaml")
    return [i.format("p.yaml") for i in e.value.issues]


def test_shipped_example_is_valid():
    policy = load_policy(EXAMPLE)
    assert {t.name for t in policy.teams} == {"vision", "nlp", "students"}
    assert policy.profile("a100-2").gpu.count == 2


def test_base_is_valid():
    assert parse_policy(BASE).team("vision").quota.gpus["a100"].nominal == 2


def test_syntax_error_is_located():
    (msg,) = errors(BASE + "  - slug: [unclosed\n")
    assert msg.startswith("p.yaml:17:1: ") and "YAML syntax error" in msg


def test_unknown_key_suggests_the_right_one():
    msgs = errors(BASE.replace("displayName: One GPU", "displayname: One GPU"))
    assert "p.yaml:13:5: profiles[0].displayname: unknown key 'displayname' (did you mean 'displayName'?)" in msgs
    assert "p.yaml:12:5: profiles[0].displayName: is required" in msgs


def test_wrong_type_negative_and_fractional_gpu_counts():
    assert ":14:18: profiles[0].gpu.count: must be at least 0 (got -1)" in errors(BASE.replace("count: 1", "count: -1"))[0]
    assert "profiles[0].gpu.count: must be a whole number (got 1.5)" in errors(BASE.replace("count: 1", "count: 1.5"))[0]
    assert (
        "teams[0].quota.gpus.a100.nominal: must be a whole number (got 'two')"
        in errors(BASE.replace("nominal: 2", "nominal: two"))[0]
    )


def test_dangling_references():
    msgs = errors(BASE.replace("flavor: a100}", "flavor: a10}").replace("teams: [vision]", "teams: [vison]"))
    joined = "\n".join(msgs)
    assert "profiles[0].teams[0]: unknown team 'vison' (did you mean 'vision'?)" in joined
    assert "profiles[0].gpu.flavor: unknown flavor 'a10' (did you mean 'a100'?)" in joined
    assert ":15:13:" in joined  # the team reference's own position


def test_duplicate_slug_and_duplicate_yaml_key():
    dup = BASE + "  - slug: gpu\n    displayName: Again\n    teams: [vision]\n"
    assert any("profiles[1].slug: slug 'gpu' is already used by profiles[0]" in m for m in errors(dup))
    twice = BASE.replace("    displayName: One GPU\n", "    displayName: One GPU\n    displayName: Two\n")
    assert any("key 'displayName' appears twice" in m and ":14:5:" in m for m in errors(twice))


def test_profile_no_team_can_use():
    msgs = errors(BASE.replace("count: 1", "count: 3").replace("maxGPUs: 2", "maxGPUs: 1"))
    assert any("no team may use profile 'gpu'" in m and "3 a100 GPU(s)" in m for m in msgs)
    assert any("lists no team" in m for m in errors(BASE.replace("teams: [vision]", "teams: []")))


def test_per_user_cap_above_team_quota():
    (msg,) = errors(BASE.replace("maxGPUs: 2", "maxGPUs: 5"))
    assert "teams[0].perUser.maxGPUs: per-user cap of 5 GPUs is above what team 'vision' can ever hold (2)" in msg


def test_borrowing_needs_cohort_and_lending_within_nominal():
    msgs = errors(BASE.replace("{nominal: 2}", "{nominal: 2, borrowingLimit: 1, lendingLimit: 3}"))
    assert any("borrowingLimit needs the team to be in a cohort" in m for m in msgs)
    assert any("lendingLimit 3 is above the nominal quota 2" in m for m in msgs)


def test_quantities_and_durations():
    p = parse_policy(
        BASE.replace(
            "    teams: [vision]\n", "    teams: [vision]\n    cpu: 500m\n    memory: 16Gi\n    idle: {timeout: 1h30m}\n"
        )
    )
    prof = p.profile("gpu")
    assert (prof.cpu, prof.memory, prof.idle.timeout) == (500, 16 * 2**30, 5400.0)
    assert "is not a quantity" in errors(BASE.replace("    teams: [vision]\n", "    teams: [vision]\n    memory: lots\n"))[0]


def test_cli_exit_codes_and_output(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "gpuhub_spawner.cli", "validate", str(EXAMPLE)], capture_output=True, text=True)
    assert ok.returncode == 0 and "OK" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(BASE.replace("count: 1", "count: -1").replace("perUser", "perUzer"))
    out = subprocess.run([sys.executable, "-m", "gpuhub_spawner.cli", "validate", str(bad)], capture_output=True, text=True)
    assert out.returncode == 1
    assert f"{bad}:10:5: teams[0].perUzer: unknown key 'perUzer' (did you mean 'perUser'?)" in out.stderr
    assert f"{bad}:14:18: profiles[0].gpu.count: must be at least 0 (got -1)" in out.stderr


@pytest.mark.parametrize(
    "text",
    [
        EXAMPLE.read_text(),
        BASE,
        # what the direct build hands to PyYAML's constructor: anchors, merge keys, int keys, dates
        BASE + "defaults: &d {queueTimeout: 1h}\nx: *d\n",
        "a: &m {b: 1}\nc:\n  <<: *m\n  d: 2\n",
        "a: {1: one, 2.5: two}\nb: 2026-01-02\nc: [~, true, 0x1F, 1e3, .inf, '1', \"x\"]\n",
        "a: 1\nb: {c: 1, c: 2}\na: [3]\n",
    ],
)
def test_the_direct_build_gives_what_pyyamls_constructor_gives(text):
    """The loader builds a policy's data straight from libyaml's nodes (docs/benchmarks.md)
    and finds duplicate keys in the same walk; it must give what yaml.safe_load gives, and
    name the same duplicates as a walk of the node tree."""
    import yaml

    from gpuhub_spawner.policy.loader import _compose_and_construct, _Positions

    root, data, duplicates = _compose_and_construct(text)
    assert data == yaml.safe_load(text)
    assert [loc for loc, _ in duplicates] == [loc for loc, _ in _Positions(root).duplicate_keys()]


def test_offboarding_rules_default_to_keeping_the_home_and_a_bad_value_is_located():
    policy = parse_policy(BASE, "p.yaml")
    assert (policy.offboarding.home, policy.offboarding.mlflow) == ("keep", "lead")
    policy = parse_policy(BASE + "offboarding: {home: archive, mlflow: read-only}\n", "p.yaml")
    assert (policy.offboarding.home, policy.offboarding.mlflow) == ("archive", "read-only")
    (err,) = errors(BASE + "offboarding:\n  home: delete\n")
    assert err.startswith("p.yaml:17:9: offboarding.home:") and "'keep' or 'archive'" in err, err


TOPOLOGY_BASE = """\
topologies:
  - name: dc
    levels: [example.com/block, example.com/rack, kubernetes.io/hostname]
flavors:
  - name: a100
    nodeLabels: {nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB}
    topology: {name: dc, level: example.com/rack}
    local: {virtual: 2}
teams:
  - name: vision
    groups: [vision-lab]
    quota: {gpus: {a100: {nominal: 2}}}
profiles:
  - {slug: gpu, displayName: One GPU, gpu: {count: 1, flavor: a100}, teams: [vision]}
"""


def test_a_flavor_placed_by_a_declared_topology_is_valid():
    policy = parse_policy(TOPOLOGY_BASE)
    topo = policy.flavor("a100").topology
    assert (topo.name, topo.level, topo.mode) == ("dc", "example.com/rack", "preferred")


@pytest.mark.parametrize(
    "old, new, expected",
    [
        (
            "topology: {name: dc,",
            "topology: {name: racks,",
            "p.yaml:7:22: flavors[0].topology.name: unknown topology 'racks' (topologies: dc)",
        ),
        (
            "level: example.com/rack}",
            "level: example.com/row}",
            "p.yaml:7:33: flavors[0].topology.level: 'example.com/row' is not a level of topology 'dc' "
            "(levels: example.com/block, example.com/rack, kubernetes.io/hostname)",
        ),
        (
            "    nodeLabels: {nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB}\n",
            "",
            "p.yaml:5:5: flavors[0].nodeLabels: a flavor with a topology needs at least one node label",
        ),
        (
            "[example.com/block, example.com/rack, kubernetes.io/hostname]",
            "[kubernetes.io/hostname, example.com/rack]",
            "p.yaml:3:13: topologies[0].levels: kubernetes.io/hostname can only be the last (lowest) level",
        ),
        (
            "[example.com/block, example.com/rack,",
            "[example.com/rack, example.com/rack,",
            "each level once (example.com/rack repeated)",
        ),
        ("[example.com/block,", "['not a label!',", "is not a node label key"),
        ("level: example.com/rack}", "level: example.com/rack, mode: always}", "flavors[0].topology.mode"),
    ],
)
def test_topology_mistakes_are_located(old, new, expected):
    """A topology only where the policy declares it; every mistake says where (issue 44)."""
    assert old in TOPOLOGY_BASE
    found = errors(TOPOLOGY_BASE.replace(old, new))
    assert any(expected in e for e in found), found


def test_a_topology_without_a_flavor_naming_it_is_allowed_and_a_flavor_without_one_is_unchanged():
    policy = parse_policy(TOPOLOGY_BASE.replace("    topology: {name: dc, level: example.com/rack}\n", ""))
    assert policy.flavor("a100").topology is None and [t.name for t in policy.topologies] == ["dc"]
