"""On a machine with a real NVIDIA GPU: gpuhub's own NVML code against the driver.

Not part of the suite (no GPU in CI). Run on a GPU host from the repo root:
    PYTHONPATH=spawner python3 tests/device/nvml_check.py [OUT_DIR]
Checks: discovery and flavor matching, exclusive hand-out, CUDA_VISIBLE_DEVICES with
the UUIDs gpuhub assigns really isolates devices for CUDA, and utilisation readings
follow a real workload so the culler sees busy vs idle GPUs.
"""

import json
import os
import subprocess
import sys
import time

from gpuhub_spawner.admission.quota import demand_for
from gpuhub_spawner.culling.gpu import read_nvml as read_utilization  # what the hub's culler reads
from gpuhub_spawner.culling.rules import CullState, Signals, decide
from gpuhub_spawner.local.devices import DeviceTable, build_inventory, discover_nvml
from gpuhub_spawner.policy import parse_policy

POLICY = """
flavors:
  - {name: h200, local: {match: H200}}
  - {name: other, local: {match: A100}}
teams: [{name: t, groups: [g], quota: {gpus: {h200: 1}}}]
profiles: [{slug: one, displayName: one, gpu: {count: 1, flavor: h200}, teams: [t]}]
"""

TORCH_COUNT = "import torch; print(torch.cuda.device_count())"
BURN = (
    "import torch, time\n"
    "a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)\n"
    "end = time.time() + 12\n"
    "while time.time() < end:\n"
    "    (a @ a).sum().item()\n"
)


def torch_devices(visible: str | None) -> int:
    env = dict(os.environ)
    if visible is None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = visible
    out = subprocess.run([sys.executable, "-c", TORCH_COUNT], env=env, capture_output=True, text=True, timeout=120)
    return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else -1


def main() -> int:
    results: dict = {}
    policy = parse_policy(POLICY)
    nvml = discover_nvml()
    results["nvml"] = [d.__dict__ for d in nvml]
    inv = build_inventory(policy, nvml)
    results["inventory"] = [d.__dict__ for d in inv]
    assert inv and all(not d.virtual and d.flavor == "h200" for d in inv), inv
    table = DeviceTable(lambda: policy)
    demand = demand_for(policy, policy.profile("one"))
    first = table.allocate("alice/", demand)
    results["allocated"] = first
    assert first and table.allocate("bob/", demand) is None  # never handed out twice
    uuid = first[0]
    results["torch_sees"] = {
        "unset": torch_devices(None),
        "assigned_uuid": torch_devices(uuid),
        "empty (CPU profile)": torch_devices(""),
    }
    assert results["torch_sees"]["assigned_uuid"] == 1 and results["torch_sees"]["empty (CPU profile)"] == 0

    idle_before = read_utilization([uuid])
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=uuid)
    burn = subprocess.Popen([sys.executable, "-c", BURN], env=env)
    samples = []
    t0 = time.time()
    while burn.poll() is None and time.time() - t0 < 60:
        samples.append(read_utilization([uuid])[uuid])
        time.sleep(0.5)
    burn.wait()
    time.sleep(2)
    idle_after = read_utilization([uuid])
    results["utilization"] = {"idle_before": idle_before, "during_load": samples, "idle_after": idle_after}
    assert max(samples) >= 50, samples

    # the culling decision with real readings: busy keeps, idle past the limit warns
    rules = policy.defaults.idle
    now = 1e5  # 27 h after start: past every idle limit, before maxAge
    busy_seen = now if max(samples) >= 5 else None  # the pass's reading during the load
    idle_seen = now if idle_after[uuid] >= 5 else None  # ... and after it
    busy = decide(now, rules, Signals(started=0, last_activity=0, gpu_last_busy=busy_seen, has_gpus=True), CullState())
    idle = decide(now, rules, Signals(started=0, last_activity=0, gpu_last_busy=idle_seen, has_gpus=True), CullState())
    results["decisions"] = {"busy": busy.action, "idle": idle.action}
    assert busy.action == "keep" and idle.action == "warn"
    text = json.dumps(results, indent=2, default=str)
    print(text)
    if len(sys.argv) > 1:
        with open(os.path.join(sys.argv[1], "nvml_check.json"), "w") as f:
            f.write(text)
    print("NVML CHECK PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
