"""The Kueue objects a policy edit changes, and a change Kueue refuses (kube/kueue_diff.py), as the
hub's policy preview shows them on Kubernetes."""

from gpuhub_spawner.kube.kueue_diff import kueue_changes
from gpuhub_spawner.policy import parse_policy

OLD = """\
flavors:
  - {name: a100, displayName: A100}
teams:
  - {name: vision, groups: [vision-lab], quota: {gpus: {a100: {nominal: 2}}}}
  - {name: nlp, groups: [nlp-group], quota: {gpus: {a100: {nominal: 1}}}}
profiles:
  - {slug: a100-1, displayName: 1x A100, gpu: {count: 1, flavor: a100}, teams: [vision, nlp]}
"""


def test_a_lowered_quota_changes_only_that_teams_clusterqueue():
    new = OLD.replace("a100: {nominal: 2}", "a100: {nominal: 1}")
    assert kueue_changes(parse_policy(OLD), parse_policy(new)) == [
        ("ClusterQueue vision changes (resourceGroups).", frozenset({"vision"}))
    ]
    assert kueue_changes(parse_policy(OLD), parse_policy(OLD)) == []


def test_a_renamed_team_that_keeps_its_queue_name_is_refused_by_kueue_first():
    renamed = OLD.replace("{name: nlp, groups", "{name: nlp2, queue: nlp, groups").replace("[vision, nlp]", "[vision, nlp2]")
    changes = kueue_changes(parse_policy(OLD), parse_policy(renamed))
    assert changes[0][0].startswith("Kueue refuses this change: LocalQueue gpuhub-users/nlp points at ClusterQueue 'nlp'")
    assert "field is immutable" in changes[0][0]
    assert [c[0] for c in changes[1:]] == [
        "ClusterQueue nlp is deleted.",
        "ClusterQueue nlp2 is created.",
        "LocalQueue gpuhub-users/nlp changes (clusterQueue).",
    ]


def test_a_new_flavor_concerns_every_team():
    more = OLD.replace("  - {name: a100, displayName: A100}\n", "  - {name: a100, displayName: A100}\n  - {name: l4}\n")
    ((words, teams),) = kueue_changes(parse_policy(OLD), parse_policy(more))
    assert words == "ResourceFlavor l4 is created." and teams == {"vision", "nlp"}
