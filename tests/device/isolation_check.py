"""On a real NVIDIA GPU host, as root: the isolation wrapper really confines CUDA.

Not part of the suite (no GPU in CI; prepared for the lead to run). From the repo root:
    PYTHONPATH=spawner python3 tests/device/isolation_check.py [OUT_DIR]

For the last GPU NVML reports (not GPU 0, so "sees one GPU" cannot be CUDA's default),
it runs PyTorch inside gpuhub's sandbox launcher exactly as the hub would for a server
holding that GPU, as a throwaway Unix account, and the code *deletes*
CUDA_VISIBLE_DEVICES before importing torch. It checks:

1. torch sees exactly one GPU, and it is the assigned one (UUID);
2. a CPU-profile sandbox (no GPU nodes) sees no GPU at all, same deletion;
3. /dev inside holds only that GPU's node plus nvidiactl/nvidia-uvm(-tools);
4. the cgroup: allocating past the memory limit is killed and counted; the CPU quota shows.

Prints one JSON line per check and writes them to OUT_DIR/isolation_check.json; exit 0
only if every check passed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from gpuhub_spawner.local.cgroups import CgroupHost
from gpuhub_spawner.local.devices import CONTROL_NODES, discover_nvml
from gpuhub_spawner.local.isolation import STANDARD_DEVICE_RULES
from gpuhub_spawner.local.sandbox import host_nodes
from gpuhub_spawner.local.unix_users import ensure_account, ensure_home, remove_accounts

PREFIX = "gpuhub-devcheck-"
SITE_DIRS = [p for p in dict.fromkeys(os.path.realpath(p) for p in sys.path if p) if os.path.isdir(p)]

PROBE = r"""
import json, os, stat
os.environ.pop("CUDA_VISIBLE_DEVICES", None)  # the user clears it: must gain nothing
assert "CUDA_VISIBLE_DEVICES" not in os.environ
nodes = sorted(os.path.relpath(os.path.join(r, f), "/dev") for r, _, fs in os.walk("/dev") for f in fs
               if f.startswith("nvidia") and stat.S_ISCHR(os.lstat(os.path.join(r, f)).st_mode))
import torch
n = torch.cuda.device_count()
uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(n)]
ok = False
if n:
    x = torch.ones(1024, 1024, device="cuda"); ok = float((x @ x).sum()) == 1024.0 ** 3
print(json.dumps({"uid": os.getuid(), "count": n, "uuids": uuids, "nodes": nodes, "matmul_ok": ok}))
"""


def sandboxed(account, home, nodes, cg, code, env_extra=None):
    spec = {
        "uid": account.uid,
        "gid": account.gid,
        "home": home,
        "visible_home": home,
        "dev_dir": "/dev",
        "gpu_nodes": nodes,
        "cgroup_procs": cg.procs_files() if cg else [],
        "expose": [sys.base_prefix, sys.prefix, *SITE_DIRS],
    }
    # torch is found where this script found it (a venv, a user site under /root, ...)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": home,
        "PYTHONPATH": os.pathsep.join(SITE_DIRS),
        **(env_extra or {}),
    }
    if "LD_LIBRARY_PATH" in os.environ:
        env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
    return subprocess.run(
        [sys.executable, "-I", "-m", "gpuhub_spawner.local.sandbox", json.dumps(spec), "--", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def main() -> int:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
    results = []

    def check(name, ok, **detail):
        results.append({"check": name, "ok": bool(ok), **detail})
        print(json.dumps(results[-1]), flush=True)

    if os.geteuid() != 0:
        print("run as root", file=sys.stderr)
        return 2
    if not Path("/dev/nvidia-uvm").exists():  # created on first CUDA use; the sandbox cannot create it
        try:
            subprocess.run(["nvidia-modprobe", "-u", "-c=0"], capture_output=True)
        except FileNotFoundError:
            pass
    gpus = [d for d in discover_nvml() if not d.uuid.startswith("MIG-")]
    check("nvml_found_gpus", bool(gpus), gpus=[(d.index, d.uuid, d.name, d.nodes) for d in gpus])
    if not gpus:
        return 1
    target = gpus[-1]
    nodes = sorted(set(target.nodes)) + list(CONTROL_NODES)
    host = CgroupHost.detect()
    check("cgroups", host.version in (1, 2), cgroups=host.describe())
    account = ensure_account("devcheck", PREFIX)
    home = tempfile.mkdtemp(prefix="gpuhub-devcheck-")
    ensure_home(home, account)
    cg = host.server(f"{PREFIX}gpu") if host.version else None
    try:
        if cg:
            found = host_nodes("/dev", nodes)
            try:
                cg.create(
                    memory=8 * 2**30,
                    cpu_millis=2000,
                    device_rules=STANDARD_DEVICE_RULES + [f"c {a}:{b} rwm" for a, b in found.values()],
                )
            except OSError as e:
                check("cgroup_create", False, error=str(e))
                cg = None
        r = sandboxed(account, home, nodes, cg, PROBE, {"CUDA_VISIBLE_DEVICES": target.uuid})
        got = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else {}
        check(
            "assigned_gpu_only_after_del_CUDA_VISIBLE_DEVICES",
            got.get("count") == 1
            and got.get("uuids", [""])[0].replace("GPU-", "") == target.uuid.replace("GPU-", "")
            and got.get("matmul_ok")
            and got.get("uid") == account.uid,
            assigned=target.uuid,
            seen=got,
            stderr=r.stderr[-2000:],
        )
        check(
            "dev_holds_only_assigned_nodes",
            set(got.get("nodes", [])) <= set(nodes) and target.nodes[0] in got.get("nodes", []),
            nodes=got.get("nodes"),
            allowed=nodes,
        )
        if cg:
            q = cg.cpu_quota()
            check("cpu_quota_in_cgroup", q == (200000, 100000), quota=q)
            r2 = sandboxed(account, home, [], None, "print(1)")
            cg.kill_all()
            cg.remove()
            cg.create(memory=256 * 2**20, cpu_millis=None, device_rules=None)
            r3 = sandboxed(account, home, [], cg, "x = bytearray(1024 * 2**20); x[::4096] = b'1' * len(x[::4096])")
            check(
                "over_memory_killed",
                r3.returncode != 0 and cg.oom_kills() >= 1,
                rc=r3.returncode,
                oom_kills=cg.oom_kills(),
                ran_plain=r2.returncode == 0,
            )
        r4 = sandboxed(account, home, [], None, PROBE, {"CUDA_VISIBLE_DEVICES": target.uuid})
        got4 = json.loads(r4.stdout.strip().splitlines()[-1]) if r4.returncode == 0 and r4.stdout.strip() else {}
        check("cpu_profile_sees_no_gpu", got4.get("count") == 0 and got4.get("nodes") == [], seen=got4, stderr=r4.stderr[-1000:])
    finally:
        if cg:
            cg.kill_all()
            cg.remove()
        remove_accounts(PREFIX)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "isolation_check.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
