"""A large, valid policy for the scale benchmarks: 500 teams, 2,000 profiles."""

from __future__ import annotations

import yaml

FLAVORS = ["a100", "h100", "l4", "t4"]


def big_policy(teams: int = 500, profiles: int = 2000, gpus_per_flavor: int = 64) -> str:
    doc = {
        "flavors": [{"name": f, "local": {"virtual": gpus_per_flavor}} for f in FLAVORS],
        "priorityClasses": [{"name": "interactive", "value": 1000}, {"name": "batch", "value": 10}],
        "teams": [],
        "profiles": [],
        "defaults": {"queueTimeout": "1h", "priority": "batch"},
    }
    for i in range(teams):
        flavor = FLAVORS[i % len(FLAVORS)]
        doc["teams"].append(
            {
                "name": f"team-{i:03d}",
                "displayName": f"Team {i}",
                "groups": [f"group-{i:03d}", f"lab-{i // 10:02d}"],
                "cohort": f"cohort-{i // 10:02d}",
                "defaultPriority": "interactive" if i % 3 == 0 else "batch",
                "quota": {
                    "cpu": 64,
                    "memory": "256Gi",
                    "gpus": {flavor: {"nominal": 2, "borrowingLimit": 2, "lendingLimit": 1}, "t4": 1},
                },
                "perUser": {"maxServers": 2, "maxGPUs": 2},
            }
        )
    for j in range(profiles):
        flavor = FLAVORS[j % len(FLAVORS)]
        first = (j * 7) % teams
        doc["profiles"].append(
            {
                "slug": f"profile-{j:04d}",
                "displayName": f"Profile {j}",
                "description": f"{flavor} x{1 + j % 2} for a few teams",
                "cpu": "4",
                "memory": "16Gi",
                "gpu": {"count": 1 + j % 2, "flavor": flavor},
                "teams": "*" if j % 50 == 0 else [f"team-{(first + k) % teams:03d}" for k in range(3)],
                "env": {"PROFILE_INDEX": str(j)},
            }
        )
    return yaml.safe_dump(doc, sort_keys=False)
