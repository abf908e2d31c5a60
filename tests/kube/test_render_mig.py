"""MIG slices rendered for both device-plugin strategies (issue 25, docs/mig.md), from the example
policy, checked against the Kueue v0.19.2 CRDs."""

from __future__ import annotations

from pathlib import Path

import pytest

from double.schemas import validate
from gpuhub_spawner.kube.render import render_objects
from gpuhub_spawner.policy import parse_policy

pytestmark = pytest.mark.usefixtures("schemas_dir")

EXAMPLE = (Path(__file__).resolve().parents[2] / "jupyterhub_config" / "profiles.yaml").read_text()
MIXED = "mig: {profile: 1g.10gb, strategy: mixed}"
SINGLE = "mig: {profile: 1g.10gb, strategy: single}\n    nodeLabels: {nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB-MIG-1g.10gb}"


def objects(text):
    objs = render_objects(parse_policy(text, "profiles.yaml"), "research-hub")
    for obj in objs:
        validate(obj)
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def gpu_groups(cq):
    return {
        tuple(g["coveredResources"]): [
            (f["name"], [(r["name"], r["nominalQuota"]) for r in f["resources"]]) for f in g["flavors"]
        ]
        for g in cq["spec"]["resourceGroups"]
        if "cpu" not in g["coveredResources"]
    }


def test_mixed_strategy_slices_are_their_own_covered_resource():
    assert MIXED in EXAMPLE
    objs = objects(EXAMPLE)
    students = objs["ClusterQueue", "students"]
    assert gpu_groups(students) == {
        ("nvidia.com/gpu",): [("l4", [("nvidia.com/gpu", "1")])],
        ("nvidia.com/mig-1g.10gb",): [("a100-1g", [("nvidia.com/mig-1g.10gb", "7")])],
    }
    assert "nodeLabels" not in objs["ResourceFlavor", "a100-1g"]["spec"]  # the resource name tells the shape


def test_single_strategy_slices_are_nvidia_gpu_on_a_flavor_keyed_on_the_product_label():
    objs = objects(EXAMPLE.replace(MIXED, SINGLE))
    students = objs["ClusterQueue", "students"]
    assert gpu_groups(students) == {
        ("nvidia.com/gpu",): [("l4", [("nvidia.com/gpu", "1")]), ("a100-1g", [("nvidia.com/gpu", "7")])],
    }
    assert objs["ResourceFlavor", "a100-1g"]["spec"]["nodeLabels"] == {
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb"
    }
    # a whole A100 and a slice never share a flavor: different product labels
    assert objs["ResourceFlavor", "a100"]["spec"]["nodeLabels"]["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"


# -- a team counting mixed shapes in GPU memory: Kueue's resource transformations ---------------------
import subprocess  # noqa: E402
import sys  # noqa: E402

import yaml  # noqa: E402

from gpuhub_spawner.kube.render import kueue_config  # noqa: E402

MIXED_SHAPES = """\
flavors:
  - {name: a100, displayName: A100, nodeLabels: {nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB}}
  - {name: a100-1g, displayName: A100 1g.10gb, mig: {profile: 1g.10gb}}
  - {name: a100-3g, displayName: A100 3g.40gb, mig: {profile: 3g.40gb}}
teams:
  - name: lab
    groups: [lab]
    cohort: research
    quota: {gpus: {a100: 1}, gpuMemory: {nominal: 60Gi, lendingLimit: 20Gi, flavors: [a100-1g, a100-3g]}}
  - name: students
    groups: [students]
    cohort: research
    quota: {gpus: {a100-1g: 3}}
  - name: vision
    groups: [vision]
    quota: {gpus: {a100: 2}}
profiles:
  - {slug: small, displayName: small, gpu: {count: 1, flavor: a100-1g}, teams: [lab, students]}
  - {slug: large, displayName: large, gpu: {count: 1, flavor: a100-3g}, teams: [lab]}
  - {slug: whole, displayName: whole, gpu: {count: 1, flavor: a100}, teams: [lab, vision]}
"""


def cpu_group(cq):
    [g] = [g for g in cq["spec"]["resourceGroups"] if "cpu" in g["coveredResources"]]
    [f] = g["flavors"]
    return g["coveredResources"], {r["name"]: {k: v for k, v in r.items() if k != "name"} for r in f["resources"]}


def test_memory_counted_slices_render_a_transformation_and_both_queues_cover_both_resources():
    policy = parse_policy(MIXED_SHAPES, "profiles.yaml")
    assert kueue_config(policy) == {
        "resources": {
            "transformations": [
                {"input": "nvidia.com/mig-1g.10gb", "strategy": "Retain", "outputs": {"gpuhub.io/mig-memory": "10Gi"}},
                {"input": "nvidia.com/mig-3g.40gb", "strategy": "Retain", "outputs": {"gpuhub.io/mig-memory": "40Gi"}},
            ]
        }
    }
    objs = objects(MIXED_SHAPES)  # every object against the v0.19.2 CRDs
    lab, students, vision = (objs["ClusterQueue", n] for n in ("lab", "students", "vision"))
    covered, res = cpu_group(lab)
    assert covered == ["cpu", "memory", "ephemeral-storage", "gpuhub.io/mig-memory"]
    assert res["gpuhub.io/mig-memory"] == {"nominalQuota": "60Gi", "lendingLimit": "20Gi"}
    # the slices themselves: seen, not counted (the memory is), never lent
    assert gpu_groups(lab) == {
        ("nvidia.com/gpu",): [("a100", [("nvidia.com/gpu", "1")])],
        ("nvidia.com/mig-1g.10gb",): [("a100-1g", [("nvidia.com/mig-1g.10gb", "10k")])],
        ("nvidia.com/mig-3g.40gb",): [("a100-3g", [("nvidia.com/mig-3g.40gb", "10k")])],
    }
    assert all(
        r.get("lendingLimit") == "0"
        for g in lab["spec"]["resourceGroups"]
        for f in g["flavors"]
        for r in f["resources"]
        if r["name"].startswith("nvidia.com/mig-")
    )
    # the students count 1g slices: the memory Kueue adds to their workloads is covered, never limited nor lent
    covered, res = cpu_group(students)
    assert covered[-1] == "gpuhub.io/mig-memory" and res["gpuhub.io/mig-memory"] == {"nominalQuota": "1Pi", "lendingLimit": "0"}
    assert gpu_groups(students) == {("nvidia.com/mig-1g.10gb",): [("a100-1g", [("nvidia.com/mig-1g.10gb", "3")])]}
    # a team holding no slice is as before
    assert cpu_group(vision)[0] == ["cpu", "memory", "ephemeral-storage"]


def test_the_example_policy_needs_no_kueue_configuration_and_the_command_says_so(tmp_path):
    assert kueue_config(parse_policy(EXAMPLE, "profiles.yaml")) == {}
    f = tmp_path / "p.yaml"
    f.write_text(MIXED_SHAPES)
    out = subprocess.run(
        [sys.executable, "-m", "gpuhub_spawner.cli", "render", "kueue-config", str(f)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout) == kueue_config(parse_policy(MIXED_SHAPES, "p.yaml"))
    f.write_text(EXAMPLE)
    out = subprocess.run(
        [sys.executable, "-m", "gpuhub_spawner.cli", "render", "kueue-config", str(f)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout == "" and "needs nothing" in out.stderr
