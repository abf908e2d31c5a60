"""MIG flavors: what the validator checks beyond each field (docs/mig.md).

A MIG flavor is one slice shape (``mig: {profile: 1g.10gb}``). Quota counts slices of that
shape, per flavor, as Kueue counts ``nvidia.com/mig-1g.10gb`` (mixed strategy) or the
``nvidia.com/gpu`` of a flavor keyed on ``nvidia.com/gpu.product`` (single strategy), so a
team holds the same number on one machine and on Kubernetes. A team that mixes shapes may
count them in GPU memory instead (``quota.gpuMemory``): each slice counts the memory its shape
names, as Kueue's resource transformation ``nvidia.com/mig-<shape>`` -> ``gpuhub.io/mig-memory``
counts it (kube/render.py ``kueue_config``).
"""

from __future__ import annotations

from typing import Iterable

from .model import Policy

PRODUCT_LABEL = "nvidia.com/gpu.product"
MIG_MEMORY_RESOURCE = "gpuhub.io/mig-memory"  # what Kueue's transformation turns a slice into
ONE_SLICE = (
    "a server gets at most one MIG slice: a CUDA process uses only the first MIG device it sees, "
    "so a second slice would sit idle while counting against the team's quota; use a larger shape "
    "(e.g. 2g.20gb, 3g.40gb) or a whole GPU"
)


def expected_resource(profile: str, strategy: str) -> str:
    return "nvidia.com/gpu" if strategy == "single" else f"nvidia.com/mig-{profile}"


def mig_checks(policy: Policy) -> Iterable[tuple[tuple, str]]:
    """``(location, message)`` for every MIG mistake, as ``loader.cross_check`` yields them."""
    migs = {}
    for fi, flavor in enumerate(policy.flavors):
        if flavor.mig is None:
            continue
        migs[flavor.name] = flavor
        m = flavor.mig
        want = expected_resource(m.profile, m.strategy)
        if flavor.resource != want:
            yield (
                ("flavors", fi, "resource"),
                (
                    f"the device plugin's {m.strategy} strategy advertises a {m.profile} slice as {want}, "
                    f"not {flavor.resource} (leave resource out: it follows mig.strategy)"
                ),
            )
        if m.strategy == "single":
            product = flavor.node_labels.get(PRODUCT_LABEL)
            if product is None:
                yield (
                    ("flavors", fi, "nodeLabels"),
                    (
                        f"with the single strategy every slice is nvidia.com/gpu, so only the node label {PRODUCT_LABEL} "
                        f"tells shapes apart: add it (GPU feature discovery writes e.g. NVIDIA-A100-SXM4-80GB-MIG-{m.profile})"
                    ),
                )
            elif not product.endswith(f"-MIG-{m.profile}"):
                yield (
                    ("flavors", fi, "nodeLabels", PRODUCT_LABEL),
                    (
                        f"{product!r} is not a {m.profile} node: with the single strategy GPU feature discovery "
                        f"labels it <GPU product>-MIG-{m.profile}, e.g. NVIDIA-A100-SXM4-80GB-MIG-{m.profile}"
                    ),
                )
    for pi, prof in enumerate(policy.profiles):
        if prof.gpu and prof.gpu.flavor in migs and prof.gpu.count > 1:
            yield ("profiles", pi, "gpu", "count"), f"asks for {prof.gpu.count} {migs[prof.gpu.flavor].unit}s: {ONE_SLICE}"

    for ti, team in enumerate(policy.teams):
        gm = team.quota.gpu_memory
        if gm is None:
            continue
        loc = ("teams", ti, "quota", "gpuMemory")
        if gm.lending_limit is not None and gm.lending_limit > gm.nominal:
            yield loc + ("lendingLimit",), "lendingLimit is above the nominal quota"
        if gm.borrowing_limit is not None and not team.cohort:
            yield loc + ("borrowingLimit",), "borrowingLimit needs the team to be in a cohort"
        for fi, name in enumerate(gm.flavors):
            counted = next((f for f in policy.flavors if f.name == name), None)
            if counted is None:
                yield loc + ("flavors", fi), f"unknown flavor {name!r}"
            elif counted.mig is None:
                yield (
                    loc + ("flavors", fi),
                    (
                        f"{name!r} is a whole GPU, not MIG slices: gpuMemory counts only slices (by the memory their "
                        f"shape names); give whole GPUs a quota in gpus"
                    ),
                )
            elif counted.mig.strategy == "single":
                yield (
                    loc + ("flavors", fi),
                    (
                        f"{name!r} uses the single strategy, where every slice is nvidia.com/gpu: Kueue cannot tell its "
                        f"shape to count its memory. Count its slices in gpus, or run the mixed strategy"
                    ),
                )
        # One way per team: a team's usage of gpu_memory is every slice it holds (admission/quota.py).
        for name in team.quota.gpus:
            if name in migs:
                yield (
                    ("teams", ti, "quota", "gpus", name),
                    (
                        f"team {team.name!r} counts MIG slices in GPU memory (gpuMemory), so {name!r} cannot also have a "
                        f"quota in slices: list it in gpuMemory.flavors, or count every shape in slices"
                    ),
                )
