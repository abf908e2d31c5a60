"""MIG flavors: what the validator checks beyond each field (docs/mig.md).

A MIG flavor is one slice shape (``mig: {profile: 1g.10gb}``). Quota counts slices of that
shape, per flavor, as Kueue counts ``nvidia.com/mig-1g.10gb`` (mixed strategy) or the
``nvidia.com/gpu`` of a flavor keyed on ``nvidia.com/gpu.product`` (single strategy), so a
team holds the same number on one machine and on Kubernetes.
"""

from __future__ import annotations

from typing import Iterable

from .model import Policy

PRODUCT_LABEL = "nvidia.com/gpu.product"
ONE_SLICE = ("a server gets at most one MIG slice: a CUDA process uses only the first MIG device it sees, "
             "so a second slice would sit idle while counting against the team's quota; use a larger shape "
             "(e.g. 2g.20gb, 3g.40gb) or a whole GPU")


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
            yield ("flavors", fi, "resource"), (
                f"the device plugin's {m.strategy} strategy advertises a {m.profile} slice as {want}, "
                f"not {flavor.resource} (leave resource out: it follows mig.strategy)")
        if m.strategy == "single":
            product = flavor.node_labels.get(PRODUCT_LABEL)
            if product is None:
                yield ("flavors", fi, "nodeLabels"), (
                    f"with the single strategy every slice is nvidia.com/gpu, so only the node label {PRODUCT_LABEL} "
                    f"tells shapes apart: add it (GPU feature discovery writes e.g. NVIDIA-A100-SXM4-80GB-MIG-{m.profile})")
            elif not product.endswith(f"-MIG-{m.profile}"):
                yield ("flavors", fi, "nodeLabels", PRODUCT_LABEL), (
                    f"{product!r} is not a {m.profile} node: with the single strategy GPU feature discovery "
                    f"labels it <GPU product>-MIG-{m.profile}, e.g. NVIDIA-A100-SXM4-80GB-MIG-{m.profile}")
    for pi, prof in enumerate(policy.profiles):
        if prof.gpu and prof.gpu.flavor in migs and prof.gpu.count > 1:
            yield ("profiles", pi, "gpu", "count"), f"asks for {prof.gpu.count} {migs[prof.gpu.flavor].unit}s: {ONE_SLICE}"
