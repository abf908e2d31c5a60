"""`gpuhub render kueue`: objects valid against the v0.19.2 CRDs and faithful to the policy."""

from __future__ import annotations

import copy

import pytest
import yaml

from double.schemas import InvalidObject, validate
from double.harness import POLICY
from gpuhub_spawner.kube.render import (
    UNLIMITED_CPU,
    UNLIMITED_EPHEMERAL,
    UNLIMITED_MEMORY,
    localqueue_conflicts,
    main,
    render_objects,
)
from gpuhub_spawner.policy import load_policy, parse_policy

pytestmark = pytest.mark.usefixtures("schemas_dir")  # the v0.19.2 CRDs (skips with the reason without them)


@pytest.fixture(scope="module")
def policy():
    return load_policy(POLICY)


def by_kind(objs, kind):
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def test_every_object_validates_against_the_crds(policy):
    objs = render_objects(policy, "research-hub")
    assert {o["kind"] for o in objs} == {"ResourceFlavor", "WorkloadPriorityClass", "ClusterQueue", "LocalQueue"}
    for obj in objs:
        validate(obj)


def test_validator_rejects_what_the_api_server_would(policy):
    """The check above can fail: unknown fields, wrong types and CEL rules are caught."""
    cq = by_kind(render_objects(policy), "ClusterQueue")["vision"]
    typo = copy.deepcopy(cq)
    typo["spec"]["cohort"] = typo["spec"].pop("cohortName")  # the v1beta1 spelling
    bad_type = copy.deepcopy(cq)
    bad_type["spec"]["queueingStrategy"] = "Random"
    no_cohort = copy.deepcopy(cq)
    del no_cohort["spec"]["cohortName"]  # keeps borrowingLimit: CEL rule
    for obj in (typo, bad_type, no_cohort):
        with pytest.raises(InvalidObject):
            validate(obj)


def test_objects_match_the_policy(policy):
    objs = render_objects(policy, "research-hub")
    flavors = by_kind(objs, "ResourceFlavor")
    assert set(flavors) == {"gpuhub-default", "a100", "l4", "a100-1g"}
    assert flavors["a100"]["spec"]["nodeLabels"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert flavors["a100"]["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    classes = by_kind(objs, "WorkloadPriorityClass")
    assert {n: c["value"] for n, c in classes.items()} == {"interactive": 1000, "batch": 100}

    cqs = by_kind(objs, "ClusterQueue")
    assert set(cqs) == {"vision", "nlp", "students"}
    vision = cqs["vision"]["spec"]
    assert vision["cohortName"] == "research"
    assert "cohortName" not in cqs["students"]["spec"]
    assert vision["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "research-hub"}}
    cpu_group, gpu_group = vision["resourceGroups"]
    assert cpu_group["coveredResources"] == ["cpu", "memory", "ephemeral-storage"]
    assert cpu_group["flavors"][0]["resources"] == [
        {"name": "cpu", "nominalQuota": "16"},
        {"name": "memory", "nominalQuota": "64Gi"},
        {"name": "ephemeral-storage", "nominalQuota": UNLIMITED_EPHEMERAL, "lendingLimit": "0"},
    ]
    assert vision["queueingStrategy"] == "BestEffortFIFO"
    assert gpu_group == {
        "coveredResources": ["nvidia.com/gpu"],
        "flavors": [
            {
                "name": "a100",
                "resources": [{"name": "nvidia.com/gpu", "nominalQuota": "2", "borrowingLimit": "1", "lendingLimit": "1"}],
            }
        ],
    }
    nlp_gpu = cqs["nlp"]["spec"]["resourceGroups"][1]
    assert [f["name"] for f in nlp_gpu["flavors"]] == ["a100", "l4"]
    # Interactive (top priority) servers are never preempted: only strictly lower priority is.
    assert vision["preemption"] == {
        "withinClusterQueue": "LowerPriority",
        "reclaimWithinCohort": "LowerPriority",
        "borrowWithinCohort": {"policy": "LowerPriority", "maxPriorityThreshold": 100},
    }

    lqs = by_kind(objs, "LocalQueue")
    assert {n: (q["metadata"]["namespace"], q["spec"]["clusterQueue"]) for n, q in lqs.items()} == {
        "vision": ("research-hub", "vision"),
        "nlp": ("research-hub", "nlp"),
        "students": ("research-hub", "students"),
    }


def test_team_without_cpu_memory_quota_is_still_covered():
    text = (
        POLICY.read_text()
        .replace("      cpu: 8\n      memory: 32Gi\n", "")
        .replace(
            "    quota:\n      cpu: 16\n      memory: 64Gi\n      gpus:\n        a100: {nominal: 2",
            "    quota:\n      gpus:\n        a100: {nominal: 2",
        )
    )
    policy = parse_policy(text)
    assert policy.team("students").quota.cpu is None and policy.team("vision").quota.cpu is None
    cqs = by_kind(render_objects(policy), "ClusterQueue")
    for obj in cqs.values():
        validate(obj)
    students = cqs["students"]["spec"]["resourceGroups"][0]["flavors"][0]["resources"]
    assert students == [
        {"name": "cpu", "nominalQuota": UNLIMITED_CPU},
        {"name": "memory", "nominalQuota": UNLIMITED_MEMORY},
        {"name": "ephemeral-storage", "nominalQuota": UNLIMITED_EPHEMERAL},
    ]
    vision = cqs["vision"]["spec"]["resourceGroups"][0]["flavors"][0]["resources"]
    assert vision == [  # in a cohort, the placeholder quota never lends
        {"name": "cpu", "nominalQuota": UNLIMITED_CPU, "lendingLimit": "0"},
        {"name": "memory", "nominalQuota": UNLIMITED_MEMORY, "lendingLimit": "0"},
        {"name": "ephemeral-storage", "nominalQuota": UNLIMITED_EPHEMERAL, "lendingLimit": "0"},
    ]


def test_strict_fifo_from_the_policy_is_rendered():
    text = POLICY.read_text().replace("  - name: students\n", "  - name: students\n    queueingStrategy: StrictFIFO\n", 1)
    cqs = by_kind(render_objects(parse_policy(text)), "ClusterQueue")
    assert cqs["students"]["spec"]["queueingStrategy"] == "StrictFIFO"
    assert cqs["vision"]["spec"]["queueingStrategy"] == "BestEffortFIFO"
    validate(cqs["students"])


def test_localqueue_cluster_queue_is_immutable_in_kueue(schemas_dir):
    """The CRD says so; the renderer's check is there because of it."""
    crd = yaml.safe_load((schemas_dir / "kueue-v0.19.2" / "localqueues.yaml").read_text())
    v1beta2 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1beta2")
    field = v1beta2["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["clusterQueue"]
    assert {"rule": "self == oldSelf", "message": "field is immutable"} in field["x-kubernetes-validations"]


def test_renaming_a_team_with_a_fixed_queue_name_is_detected_and_explained(capsys, tmp_path, policy):
    live = render_objects(policy)
    renamed = POLICY.read_text().replace("  - name: students\n", "  - name: learners\n    queue: students\n", 1)
    renamed = renamed.replace("teams: [nlp, students]", "teams: [nlp, learners]")
    renamed = renamed.replace("teams: [students]", "teams: [learners]")
    path = tmp_path / "renamed.yaml"
    path.write_text(renamed)
    [problem] = localqueue_conflicts(render_objects(parse_policy(renamed)), live)
    assert "LocalQueue gpuhub-users/students points at ClusterQueue 'students'" in problem
    assert "'learners'" in problem and "field is immutable" in problem and "kubectl delete localqueue" in problem
    live_file = tmp_path / "live.yaml"
    live_file.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": live}))
    assert main(["kueue", str(path), "--live", str(live_file)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "field is immutable" in captured.err
    assert main(["kueue", str(POLICY), "--live", str(live_file)]) == 0  # unchanged names: fine


def test_single_priority_class_never_preempts_borrowed_capacity():
    text = POLICY.read_text().replace("  - name: batch\n    value: 100\n    description: Background jobs that can wait.\n", "")
    text = text.replace("defaultPriority: batch", "defaultPriority: interactive")
    text = "\n".join(l for l in text.splitlines() if "jobPriority: batch" not in l) + "\n"
    cq = by_kind(render_objects(parse_policy(text)), "ClusterQueue")["vision"]
    validate(cq)
    assert cq["spec"]["preemption"]["borrowWithinCohort"] == {"policy": "Never"}


def test_cli_output_is_deterministic_yaml(capsys, tmp_path):
    assert main(["kueue", str(POLICY), "--namespace", "ml"]) == 0
    first = capsys.readouterr().out
    # Same policy, teams listed in another order: same bytes.
    data = yaml.safe_load(POLICY.read_text())
    data["teams"].reverse()
    data["flavors"].reverse()
    shuffled = tmp_path / "p.yaml"
    shuffled.write_text(yaml.safe_dump(data))
    assert main(["kueue", str(shuffled), "-n", "ml"]) == 0
    second = capsys.readouterr().out
    docs = list(yaml.safe_load_all(first))
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [
        ("ResourceFlavor", "a100"),
        ("ResourceFlavor", "a100-1g"),
        ("ResourceFlavor", "gpuhub-default"),
        ("ResourceFlavor", "l4"),
        ("WorkloadPriorityClass", "batch"),
        ("WorkloadPriorityClass", "interactive"),
        ("ClusterQueue", "nlp"),
        ("ClusterQueue", "students"),
        ("ClusterQueue", "vision"),
        ("LocalQueue", "nlp"),
        ("LocalQueue", "students"),
        ("LocalQueue", "vision"),
    ]
    assert all(d["metadata"].get("namespace") in (None, "ml") for d in docs)

    # GPU flavor order inside a ClusterQueue is Kueue's try-order, so it follows the policy file.
    def strip(text):
        return [d for d in yaml.safe_load_all(text) if d["kind"] != "ClusterQueue"]

    assert strip(first) == strip(second)
    assert main(["kueue", str(POLICY), "--namespace", "ml"]) == 0
    assert capsys.readouterr().out == first


def test_cli_reports_located_errors(capsys, tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text(POLICY.read_text().replace("gpu: {count: 2, flavor: a100}", "gpu: {count: 2, flavor: a10}"))
    assert main(["kueue", str(broken)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"{broken}:" in captured.err and "unknown flavor 'a10'" in captured.err
    assert main(["kueue", str(tmp_path / "missing.yaml")]) == 1
    assert "cannot read file" in capsys.readouterr().err


def test_cli_refuses_a_flavor_named_like_the_cpu_flavor(capsys, tmp_path):
    clash = tmp_path / "clash.yaml"
    clash.write_text(POLICY.read_text())
    assert main(["kueue", str(clash), "--cpu-flavor", "a100"]) == 1
    assert "reserved for CPU and memory" in capsys.readouterr().err


def test_a_flavor_placed_by_topology_renders_kueue_tas_objects(policy):
    """Issue 44: where the policy names a topology, a Kueue ``Topology`` (its levels, broadest
    first) and ``topologyName`` on the flavor's ResourceFlavor; validated against the v0.19.2
    CRDs (Topology's from the Kueue module the real plane installs; skipped without it).
    Nothing changes for a policy without one, nor for a declared topology no flavor names."""
    from double.schemas import kueue_module_crds

    data = yaml.safe_load(POLICY.read_text())
    data["topologies"] = [
        {"name": "dc", "levels": ["example.com/block", "example.com/rack", "kubernetes.io/hostname"]},
        {"name": "unused", "levels": ["example.com/row"]},
    ]
    next(f for f in data["flavors"] if f["name"] == "a100")["topology"] = {"name": "dc", "level": "example.com/rack"}
    objs = render_objects(parse_policy(yaml.safe_dump(data)), "research-hub")
    topologies = by_kind(objs, "Topology")
    assert list(topologies) == ["dc"]
    assert topologies["dc"]["spec"]["levels"] == [
        {"nodeLabel": "example.com/block"},
        {"nodeLabel": "example.com/rack"},
        {"nodeLabel": "kubernetes.io/hostname"},
    ]
    assert objs[0]["kind"] == "Topology"  # applied before the flavor naming it
    flavors = by_kind(objs, "ResourceFlavor")
    assert flavors["a100"]["spec"]["topologyName"] == "dc"
    assert all("topologyName" not in f["spec"] for name, f in flavors.items() if name != "a100")
    validate(flavors["a100"])
    # Kueue v0.19.2 gives a pod set asking for a topology one topology flavor for all it requests:
    # a team holding a100 has one group for CPU, memory and devices (the plain flavor first).
    for cq in by_kind(objs, "ClusterQueue").values():
        validate(cq)
        groups = cq["spec"]["resourceGroups"]
        if any(f["name"] == "a100" for g in groups for f in g["flavors"]):
            [group] = groups
            assert group["coveredResources"][:3] == ["cpu", "memory", "ephemeral-storage"], group["coveredResources"]
            names = [f["name"] for f in group["flavors"]]
            assert names[0] == "gpuhub-default" and "a100" in names, names
            a100 = next(f for f in group["flavors"] if f["name"] == "a100")
            assert [r["name"] for r in a100["resources"]] == group["coveredResources"]
            plain = group["flavors"][0]
            assert {r["name"]: r["nominalQuota"] for r in plain["resources"]}.get("nvidia.com/gpu") == "0"
        else:
            assert len(groups) > 1 or groups[0]["coveredResources"][0] == "cpu"
    if kueue_module_crds() is None:
        pytest.skip("the Topology CRD comes from the Kueue v0.19.2 module (tests/cluster/build.sh); not fetched here")
    validate(topologies["dc"])
    bad = copy.deepcopy(topologies["dc"])
    bad["spec"]["levels"].reverse()
    with pytest.raises(InvalidObject, match="hostname"):
        validate(bad)
    # Without topologies the policy renders exactly what it did.
    assert "Topology" not in {o["kind"] for o in render_objects(policy, "research-hub")}
