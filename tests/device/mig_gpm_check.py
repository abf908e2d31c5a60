"""On a machine with a real NVIDIA GPU: MIG state and GPM readings, read only (issue 25).

Not part of the suite (no GPU in CI). It never changes a GPU's MIG mode or layout. Run from
the repo root on a GPU host:
    PYTHONPATH=spawner python3 tests/device/mig_gpm_check.py [OUT_DIR]
It also runs against the fake NVML (no load then: torch is not needed):
    PYTHONPATH=spawner:tests/support/fake_nvml GPUHUB_FAKE_NVML=nvml.json python3 tests/device/mig_gpm_check.py

Reports each GPU's MIG mode (current, pending) and, through gpuhub's own discovery, its slices
(UUID, shape, parent, device and capability nodes). GPM, the source of a slice's utilisation
(culling/gpu.py): where MIG is on and has slices, gpuhub's read_nvml on them, idle and (with
torch) under a load in one slice; where MIG is off, the same GPM metric call
(``gpm_graphics_util``) on two whole-GPU samples, idle and under load, which checks the call
against the real library. A GPU without GPM (before Hopper) is reported, not failed.
"""

import json
import os
import subprocess
import sys
import time

from gpuhub_spawner.culling.gpu import gpm_graphics_util, read_nvml
from gpuhub_spawner.local.devices import discover_nvml

BURN = (
    "import torch, time\n"
    "a = torch.randn(4096, 4096, device='cuda', dtype=torch.float16)\n"
    "end = time.time() + 8\n"
    "while time.time() < end:\n"
    "    (a @ a).sum().item()\n"
)


def have_torch() -> bool:
    return subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode == 0


def burn(visible: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BURN], env=dict(os.environ, CUDA_VISIBLE_DEVICES=visible))


def whole_gpu_gpm(pynvml, handle, seconds: float = 1.0) -> int:
    first, second = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
    try:
        pynvml.nvmlGpmSampleGet(handle, first)
        time.sleep(seconds)
        pynvml.nvmlGpmSampleGet(handle, second)
        return gpm_graphics_util(pynvml, first, second)
    finally:
        pynvml.nvmlGpmSampleFree(first)
        pynvml.nvmlGpmSampleFree(second)


def main() -> int:
    import pynvml

    results: dict = {"gpus": [], "torch": have_torch()}
    pynvml.nvmlInit()
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            gpu = {"index": i, "uuid": pynvml.nvmlDeviceGetUUID(h), "name": pynvml.nvmlDeviceGetName(h)}
            try:
                gpu["mig_mode"] = list(pynvml.nvmlDeviceGetMigMode(h))  # [current, pending]: read, never set
            except pynvml.NVMLError as e:
                gpu["mig_mode"] = f"not supported ({e})"
            try:
                gpu["gpm"] = bool(pynvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice)
            except (pynvml.NVMLError, AttributeError) as e:
                gpu["gpm"] = f"no ({e})"
            results["gpus"].append(gpu)
    finally:
        pynvml.nvmlShutdown()

    found = discover_nvml()
    results["discovered"] = [d.__dict__ for d in found]
    slices = [d for d in found if d.mig_profile]
    if slices:
        ids = [d.uuid for d in slices]
        results["slices_idle"] = read_nvml(ids)
        if results["torch"]:
            p = burn(ids[0])
            time.sleep(4)
            results["slice_under_load"] = read_nvml([ids[0]])
            p.wait()
    else:
        pynvml.nvmlInit()
        try:
            for gpu in results["gpus"]:
                if gpu["gpm"] is not True:
                    continue
                h = pynvml.nvmlDeviceGetHandleByIndex(gpu["index"])
                gpu["gpm_idle"] = whole_gpu_gpm(pynvml, h)
                if results["torch"]:
                    p = burn(gpu["uuid"])
                    time.sleep(4)
                    gpu["gpm_under_load"] = whole_gpu_gpm(pynvml, h)
                    p.wait()
                    assert gpu["gpm_under_load"] >= 50, gpu
        finally:
            pynvml.nvmlShutdown()
    text = json.dumps(results, indent=2, default=str)
    print(text)
    if len(sys.argv) > 1:
        with open(os.path.join(sys.argv[1], "mig_gpm_check.json"), "w") as f:
            f.write(text)
    print("MIG/GPM CHECK DONE (read only)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
