"""Which device nodes a server's private /dev gets: its GPUs', the control nodes, MIG capabilities."""

from types import SimpleNamespace

from gpuhub_spawner.local.devices import CONTROL_NODES, DeviceTable, NvmlDevice, _mig_cap_nodes
from gpuhub_spawner.policy import parse_policy

POLICY = """
flavors:
  - {name: a100, local: {match: A100}}
  - {name: mig, local: {match: MIG}}
teams: [{name: t, groups: [g], quota: {gpus: {a100: 2, mig: 1}}}]
profiles: [{slug: one, displayName: one, gpu: {count: 1, flavor: a100}, teams: [t]}]
"""


def test_mig_slice_needs_its_parent_gpu_and_its_instance_capabilities(tmp_path):
    """The driver's table (/proc/driver/nvidia/capabilities) names the nvidia-caps minors."""
    for sub, minor in (("gpu3/mig/gi2", 21), ("gpu3/mig/gi2/ci0", 22), ("gpu3/mig/gi1", 12)):
        (tmp_path / sub).mkdir(parents=True, exist_ok=True)
        (tmp_path / sub / "access").write_text(f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    nvml = SimpleNamespace(nvmlDeviceGetGpuInstanceId=lambda h: 2, nvmlDeviceGetComputeInstanceId=lambda h: 0)
    assert _mig_cap_nodes(nvml, object(), 3, proc=str(tmp_path)) == ("nvidia-caps/nvidia-cap21", "nvidia-caps/nvidia-cap22")


def test_a_server_gets_exactly_its_gpus_nodes_and_none_for_none():
    devices = [
        NvmlDevice(0, "GPU-a", "NVIDIA A100", 80, ("nvidia0",)),
        NvmlDevice(1, "GPU-b", "NVIDIA A100", 80, ("nvidia1",)),
        NvmlDevice(
            3, "MIG-c", "NVIDIA A100 MIG 1g.10gb", 10, ("nvidia3", "nvidia-caps/nvidia-cap21", "nvidia-caps/nvidia-cap22")
        ),
    ]
    policy = parse_policy(POLICY)
    table = DeviceTable(lambda: policy, discover=lambda: devices)
    assert table.nodes_for(["GPU-b"]) == ["nvidia1", *CONTROL_NODES]
    assert table.nodes_for(["MIG-c"]) == ["nvidia-caps/nvidia-cap21", "nvidia-caps/nvidia-cap22", "nvidia3", *CONTROL_NODES]
    assert table.nodes_for([]) == []  # a CPU profile: not even nvidiactl
    assert table.nodes_for(["GPU-unknown"]) == []
