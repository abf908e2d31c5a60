"""Fair share rendered to Kueue v0.19.2's own mechanisms (docs/fair-share.md), the objects
validated against the v0.19.2 CRDs in shared/schemas (skipped, with the reason, without them).

The field names come from Kueue v0.19.2's source: ``ClusterQueue.spec.fairSharing.weight``,
``ClusterQueue.spec.admissionScope.admissionMode: UsageBasedAdmissionFairSharing``,
``LocalQueue.spec.fairSharing.weight`` (CRDs), and in the Configuration (apis/config/v1beta2,
not a CRD) ``fairSharing.preemptionStrategies`` and ``admissionFairSharing.{usageHalfLifeTime,
usageSamplingInterval, resourceWeights}``, whose validation (pkg/config/validation.go) is
restated in ``check_config`` below.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

from gpuhub_spawner.kube.render import (
    FAIR_PREEMPTION_STRATEGIES,
    kueue_config,
    main,
    queue_for,
    render_objects,
    user_local_queue,
    user_queue_name,
)
from gpuhub_spawner.policy import parse_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kube"))
from double.schemas import shared_schemas, validate_kueue  # noqa: E402  (tests/kube/double, read only)

POLICY = """\
flavors:
  - name: a100
  - name: h100
    nodeLabels: {gpu: h100}
  - name: t4
    resource: nvidia.com/t4
teams:
  - name: nlp
    displayName: NLP
    groups: [nlp]
    cohort: lab
    weight: 3
    quota: {gpus: {a100: 4}}
  - name: vision
    groups: [vision]
    cohort: lab
    weight: 0.5
    quota: {gpus: {a100: 2, t4: 2}}
profiles:
  - {slug: g1, displayName: g1, gpu: {count: 1, flavor: a100}, teams: "*"}
"""
FAIR = "fairShare:\n  halfLife: 36h\n  flavorWeights: {a100: 2, h100: 2, t4: 0.5}\n  minRuntime: 10m\n"


@pytest.fixture(scope="module", autouse=True)
def crds():
    try:
        return shared_schemas()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def by_kind(objs, kind):
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def check_config(cfg: dict) -> None:
    """Kueue v0.19.2's validation of these two sections (pkg/config/validation.go)."""
    valid = [["LessThanOrEqualToFinalShare"], ["LessThanInitialShare"], ["LessThanOrEqualToFinalShare", "LessThanInitialShare"]]
    assert cfg["fairSharing"]["preemptionStrategies"] in valid
    afs = cfg["admissionFairSharing"]
    assert set(afs) <= {"usageHalfLifeTime", "usageSamplingInterval", "resourceWeights"}
    go_duration = re.compile(r"^([0-9]+h)?([0-9]+m)?([0-9]+s)?$")
    assert go_duration.match(afs["usageHalfLifeTime"]) and go_duration.match(afs["usageSamplingInterval"])
    assert afs["usageSamplingInterval"] != "0s"
    assert all(isinstance(w, float) and w >= 0 for w in afs["resourceWeights"].values())


def test_weights_and_user_fairness_render_and_validate():
    policy = parse_policy(POLICY + FAIR + "  users: true\n")
    objs = render_objects(policy)
    for obj in objs:
        validate_kueue(obj)
    cqs = by_kind(objs, "ClusterQueue")
    assert cqs["nlp"]["spec"]["fairSharing"] == {"weight": "3"}
    assert cqs["vision"]["spec"]["fairSharing"] == {"weight": "0.5"}
    assert cqs["nlp"]["spec"]["admissionScope"] == {"admissionMode": "UsageBasedAdmissionFairSharing"}
    lq = user_local_queue(policy.team("nlp"), "Alice.Smith@example.org")
    validate_kueue(lq)
    assert lq["spec"] == {"clusterQueue": "nlp", "fairSharing": {"weight": "1"}}
    assert lq["metadata"]["name"].startswith("nlp-u-alice-smith-example-org-")
    # names that clean up alike stay apart; a long one still fits a DNS label
    team = policy.team("nlp")
    assert user_queue_name(team, "a.b") != user_queue_name(team, "a-b")
    assert len(user_queue_name(team, "x" * 300)) <= 63
    validate_kueue(user_local_queue(team, "x" * 300))


def test_without_fair_share_nothing_changes():
    policy = parse_policy(POLICY.replace("    weight: 3\n", "").replace("    weight: 0.5\n", ""))
    for obj in render_objects(policy):
        validate_kueue(obj)
        assert "fairSharing" not in obj["spec"] and "admissionScope" not in obj["spec"]
    assert kueue_config(policy) == {}


def test_without_user_fairness_no_admission_scope():
    cqs = by_kind(render_objects(parse_policy(POLICY + FAIR)), "ClusterQueue")
    assert "admissionScope" not in cqs["nlp"]["spec"] and cqs["nlp"]["spec"]["fairSharing"] == {"weight": "3"}


def test_kueue_configuration_half_life_and_resource_weights():
    cfg = kueue_config(parse_policy(POLICY + FAIR))
    check_config(cfg)
    assert cfg["fairSharing"]["preemptionStrategies"] == FAIR_PREEMPTION_STRATEGIES
    afs = cfg["admissionFairSharing"]
    assert afs["usageHalfLifeTime"] == "36h"
    # GPUs by their device resource; CPU and memory count nothing (the hub counts GPU time only)
    assert afs["resourceWeights"] == {
        "nvidia.com/gpu": 2.0,
        "nvidia.com/t4": 0.5,
        "cpu": 0.0,
        "memory": 0.0,
        "ephemeral-storage": 0.0,
    }


def test_flavors_of_one_resource_with_different_weights_are_explained(tmp_path, capsys):
    text = POLICY + FAIR.replace("h100: 2", "h100: 3")
    with pytest.raises(ValueError, match="flavors a100: 2, h100: 3 share the device resource nvidia.com/gpu"):
        kueue_config(parse_policy(text))
    path = tmp_path / "p.yaml"
    path.write_text(text)
    assert main(["kueue-config", str(path)]) == 1
    assert "give them one weight" in capsys.readouterr().err


def test_cli_prints_the_configuration_fragment(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text(POLICY + FAIR)
    assert main(["kueue-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# merge into controller_manager_config.yaml")
    check_config(yaml.safe_load(out))


def test_kueue_samples_usage_often_enough_for_the_half_life():
    """Kueue's default sampling (5m) for a half-life of an hour or more; a shorter half-life is
    sampled 12 times per half-life, so a server that ran between two samples is not missed."""

    def sampling(half_life: str) -> str:
        return kueue_config(parse_policy(POLICY + f"fairShare: {{halfLife: {half_life}}}\n"))["admissionFairSharing"][
            "usageSamplingInterval"
        ]

    assert [sampling(h) for h in ("36h", "1h", "30m", "1m")] == ["5m", "5m", "2m30s", "5s"]


def test_each_user_has_a_queue_of_their_own_per_team_only_with_user_fairness():
    policy = parse_policy(POLICY + "fairShare: {users: true}\n")
    nlp, vision = policy.team("nlp"), policy.team("vision")
    assert queue_for(policy, nlp, "alice") == user_queue_name(nlp, "alice") != queue_for(policy, vision, "alice")
    assert queue_for(parse_policy(POLICY + FAIR), nlp, "alice") == nlp.local_queue  # users: false: the team's queue
    # Named after the ClusterQueue (whose name a LocalQueue can never change), with 64 bits of
    # hash over team and user: a name chosen to land in another user's queue is not found by trying.
    renamed = parse_policy(
        (POLICY + "fairShare: {users: true}\n").replace("    weight: 3\n", "    weight: 3\n    queue: nlp-q\n")
    )
    name = user_queue_name(renamed.team("nlp"), "alice")
    assert name == user_queue_name(nlp, "alice") and re.fullmatch(r"nlp-u-alice-[0-9a-f]{16}", name), name
    assert user_local_queue(nlp, "alice")["metadata"]["annotations"] == {"gpuhub.io/user": "alice"}
