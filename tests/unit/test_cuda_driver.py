"""A profile's CUDA requirement against the GPUs' driver (issue 28 item 3): the policy's
``gpu.cuda``, the one-machine check from NVML's driver, the Kubernetes node affinity on GPU
feature discovery's labels. The hub-level refusal is in tests/integration/test_cuda_refusal.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import kubernetes_validate
import pytest

from gpuhub_spawner.kube.spawner import and_terms, cuda_node_terms
from gpuhub_spawner.local import devices as D
from gpuhub_spawner.policy.loader import PolicyError, parse_policy

FAKE = Path(__file__).resolve().parents[1] / "support" / "fake_nvml" / "pynvml.py"

POLICY = """\
flavors:
  - {name: a100, local: {virtual: 2}}
teams:
  - {name: vision, groups: [vision-lab], quota: {gpus: {a100: 2}}}
profiles:
  - {slug: torch, displayName: PyTorch CUDA 12.8, gpu: {count: 1, flavor: a100, cuda: "12.8"}, teams: "*"}
  - {slug: any, displayName: Any, gpu: {count: 1, flavor: a100}, teams: "*"}
"""


def test_the_policy_takes_a_quoted_major_minor_and_locates_anything_else():
    torch, plain = parse_policy(POLICY).profiles
    assert torch.gpu.cuda_needed == (12, 8) and plain.gpu.cuda_needed is None
    with pytest.raises(PolicyError) as e:
        parse_policy(POLICY.replace('cuda: "12.8"', "cuda: 12.10"), "p.yaml")
    [issue] = [i.format("p.yaml") for i in e.value.issues]
    assert issue.startswith("p.yaml:6:87: profiles[0].gpu.cuda:") and 'write the CUDA version quoted, "12.1"' in issue
    with pytest.raises(PolicyError) as e:
        parse_policy(POLICY.replace('cuda: "12.8"', 'cuda: "12"'), "p.yaml")
    assert 'a CUDA version as "MAJOR.MINOR"' in e.value.issues[0].format("p.yaml")


def test_the_refusal_names_the_need_the_driver_and_what_to_do():
    torch, plain = parse_policy(POLICY).profiles
    old = D.Driver("535.183.01", (12, 2))
    words = D.cuda_refusal(torch, old)
    assert words == (
        "PyTorch CUDA 12.8 needs CUDA 12.8, but this machine's NVIDIA driver 535.183.01 supports CUDA "
        "12.2 at most: its GPU code would fail to start. Choose another profile, or ask an admin to "
        "update the driver."
    )
    assert D.cuda_refusal(torch, D.Driver("570.86.15", (12, 8))) is None  # exactly enough
    assert D.cuda_refusal(torch, D.Driver("580.95.05", (13, 0))) is None  # a newer major
    assert D.cuda_refusal(plain, old) is None  # the profile says nothing
    assert D.cuda_refusal(torch, None) is None  # no NVML: virtual GPUs


def test_the_driver_is_read_from_nvml(tmp_path, monkeypatch):
    state = tmp_path / "nvml.json"
    state.write_text(json.dumps({"devices": [], "driver": {"version": "535.183.01", "cuda": 12020}}))
    monkeypatch.setenv("GPUHUB_FAKE_NVML", str(state))
    spec = importlib.util.spec_from_file_location("pynvml", FAKE)
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
    assert D.read_driver() == D.Driver("535.183.01", (12, 2))
    calls = []
    table = D.DeviceTable(
        lambda: parse_policy(POLICY), discover=lambda: [], driver=lambda: calls.append(1) or D.Driver("x", (12, 2))
    )
    assert table.driver() == table.driver() and len(calls) == 1  # read once per DRIVER_TTL


def test_kubernetes_pods_go_only_to_nodes_whose_driver_supports_the_cuda():
    terms = cuda_node_terms(12, 8)
    assert terms == [
        {"matchExpressions": [{"key": "nvidia.com/cuda.runtime-version.major", "operator": "Gt", "values": ["12"]}]},
        {
            "matchExpressions": [
                {"key": "nvidia.com/cuda.runtime-version.major", "operator": "In", "values": ["12"]},
                {"key": "nvidia.com/cuda.runtime-version.minor", "operator": "Gt", "values": ["7"]},
            ]
        },
    ]

    def fits(labels: dict) -> bool:  # the scheduler's reading of required node affinity
        def ok(e):
            value = labels.get(e["key"])
            if value is None:
                return False
            return int(value) > int(e["values"][0]) if e["operator"] == "Gt" else value in e["values"]

        return any(all(ok(e) for e in t["matchExpressions"]) for t in terms)

    def node(major, minor):
        return {
            "nvidia.com/cuda.runtime-version.major": major,  # noqa: E731
            "nvidia.com/cuda.runtime-version.minor": minor,
        }

    assert fits(node("12", "8")) and fits(node("12", "9")) and fits(node("13", "0"))
    assert not fits(node("12", "4")) and not fits(node("11", "8")) and not fits({})
    assert cuda_node_terms(13, 0)[1] == {
        "matchExpressions": [{"key": "nvidia.com/cuda.runtime-version.major", "operator": "In", "values": ["13"]}]
    }
    # Configured terms (OR'ed) AND the CUDA terms: every pair.
    zone = [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]
    both = and_terms(zone, terms)
    assert len(both) == 2 and all(t["matchExpressions"][0]["key"] == "zone" for t in both)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p"},
        "spec": {
            "containers": [{"name": "c", "image": "i"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": both}}},
        },
    }
    kubernetes_validate.validate(pod, "1.33", strict=True)
