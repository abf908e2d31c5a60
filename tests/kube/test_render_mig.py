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
SINGLE = ("mig: {profile: 1g.10gb, strategy: single}\n"
          "    nodeLabels: {nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB-MIG-1g.10gb}")


def objects(text):
    objs = render_objects(parse_policy(text, "profiles.yaml"), "research-hub")
    for obj in objs:
        validate(obj)
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def gpu_groups(cq):
    return {tuple(g["coveredResources"]): [(f["name"], [(r["name"], r["nominalQuota"]) for r in f["resources"]])
                                           for f in g["flavors"]]
            for g in cq["spec"]["resourceGroups"] if "cpu" not in g["coveredResources"]}


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
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb"}
    # a whole A100 and a slice never share a flavor: different product labels
    assert objs["ResourceFlavor", "a100"]["spec"]["nodeLabels"]["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
