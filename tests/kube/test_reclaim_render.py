"""The rendered ClusterQueues carry reclaim (issue 14), valid against the v0.19.2 CRDs and webhook rules."""

from __future__ import annotations

import pytest

from double.harness import POLICY
from double.schemas import validate
from gpuhub_spawner.kube.render import render_objects
from gpuhub_spawner.policy import parse_policy

pytestmark = pytest.mark.usefixtures("schemas_dir")


def cluster_queues(text):
    return {o["metadata"]["name"]: o for o in render_objects(parse_policy(text)) if o["kind"] == "ClusterQueue"}


def test_shipped_policy_reclaims_lower_priority_borrowers_at_once():
    cqs = cluster_queues(POLICY.read_text())
    for name in ("vision", "nlp"):  # the research cohort
        validate(cqs[name])
        pre = cqs[name]["spec"]["preemption"]
        # A lender's request inside its nominal quota preempts borrowing workloads of lower
        # priority (batch jobs) at once; equal-priority servers are the hub's, with notice.
        assert pre["reclaimWithinCohort"] == "LowerPriority"
        assert pre["withinClusterQueue"] == "LowerPriority"
        assert pre["borrowWithinCohort"] == {"policy": "LowerPriority", "maxPriorityThreshold": 100}


def test_a_team_that_does_not_reclaim_never_preempts_in_the_cohort():
    text = POLICY.read_text().replace("    cohort: research\n", "    cohort: research\n    reclaim: {enabled: false}\n", 1)
    cqs = cluster_queues(text)
    first = next(n for n in ("vision", "nlp") if cqs[n]["spec"]["preemption"]["reclaimWithinCohort"] == "Never")
    validate(cqs[first])  # the webhook rule: reclaimWithinCohort Never needs borrowWithinCohort Never
    assert cqs[first]["spec"]["preemption"]["borrowWithinCohort"] == {"policy": "Never"}
    other = ({"vision", "nlp"} - {first}).pop()
    assert cqs[other]["spec"]["preemption"]["reclaimWithinCohort"] == "LowerPriority"
