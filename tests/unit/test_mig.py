"""MIG slices as flavors (issue 25, docs/mig.md): the policy, quota words, one machine's devices."""

import pytest

from gpuhub_spawner.admission.quota import check_fit, demand_for, describe
from gpuhub_spawner.policy import PolicyError, parse_policy

MIG = """\
flavors:
  - name: a100
    displayName: A100
    local: {{match: A100}}
  - name: a100-1g
    displayName: A100 1g.10gb
    mig: {{profile: 1g.10gb{strategy}}}
{labels}    local: {{match: A100, virtual: 7}}
teams:
  - name: students
    groups: [students]
    quota: {{gpus: {{a100-1g: 7, a100: 1}}}}
profiles:
  - slug: mig-1g
    displayName: One slice
    gpu: {{count: {count}, flavor: a100-1g}}
    teams: [students]
"""


def policy(strategy="", labels="", count=1):
    return parse_policy(MIG.format(strategy=strategy, labels=labels, count=count), "p.yaml")


def errors(**kw):
    with pytest.raises(PolicyError) as e:
        policy(**kw)
    return [i.format("p.yaml") for i in e.value.issues]


def test_a_mixed_strategy_slice_is_its_own_resource_and_quota_counts_slices():
    p = policy()
    f = p.flavor("a100-1g")
    assert f.resource == "nvidia.com/mig-1g.10gb" and f.mig.strategy == "mixed"
    assert p.flavor("a100").resource == "nvidia.com/gpu"
    team = p.team("students")
    demand = demand_for(p, p.profile("mig-1g"))
    assert demand["gpu/a100-1g"] == 1
    assert check_fit(p, {"students": {"gpu/a100-1g": 6}}, team, demand).fits
    fit = check_fit(p, {"students": {"gpu/a100-1g": 7}}, team, demand)
    assert not fit.fits and "needs 1 A100 1g.10gb slice:" in fit.shortages[0].reason
    assert describe("gpu/a100-1g", 7, p) == "7 A100 1g.10gb slices"
    assert describe("gpu/a100", 2, p) == "2 A100 GPUs"


def test_two_slices_in_one_server_are_refused_with_the_reason_and_place():
    errs = [e for e in errors(count=2) if "MIG" in e]
    assert len(errs) == 1
    assert errs[0].startswith("p.yaml:16:18: profiles[0].gpu.count: asks for 2 1g.10gb slices")
    assert "a CUDA process uses only the first MIG device it sees" in errs[0]


def test_a_single_strategy_slice_is_nvidia_gpu_keyed_on_the_product_label():
    labels = "    nodeLabels: {nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB-MIG-1g.10gb}\n"
    p = policy(strategy=", strategy: single", labels=labels)
    assert p.flavor("a100-1g").resource == "nvidia.com/gpu"
    errs = errors(strategy=", strategy: single")
    assert len(errs) == 1 and "flavors[1]" in errs[0] and "nvidia.com/gpu.product tells shapes apart" in errs[0]
    wrong = "    nodeLabels: {nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB}\n"
    errs = errors(strategy=", strategy: single", labels=wrong)
    assert (
        len(errs) == 1
        and "p.yaml:8:42: flavors[1].nodeLabels.nvidia.com/gpu.product" in errs[0]
        and "is not a 1g.10gb node" in errs[0]
    )


def test_mig_names_and_resources_are_checked():
    errs = errors(strategy=", strategy: both")
    assert len(errs) == 1 and "flavors[1].mig.strategy" in errs[0]
    bad = MIG.format(strategy="", labels="    resource: nvidia.com/gpu\n", count=1)
    with pytest.raises(PolicyError) as e:
        parse_policy(bad, "p.yaml")
    [issue] = e.value.issues
    assert issue.path == "flavors[1].resource" and "advertises a 1g.10gb slice as nvidia.com/mig-1g.10gb" in issue.message
    with pytest.raises(PolicyError) as e:
        parse_policy(MIG.format(strategy="", labels="", count=1).replace("1g.10gb}", "1g10gb}"), "p.yaml")
    assert "is not a MIG profile name" in e.value.issues[0].message


# -- one machine: slices from NVML (the fake nvidia-ml-py, in-process) -------------------------------
import asyncio  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from gpuhub_spawner.admission.health import BAD, HEALTHY  # noqa: E402
from gpuhub_spawner.admission.queue import AdmissionQueue  # noqa: E402
from gpuhub_spawner.local.devices import CONTROL_NODES, DeviceTable, discover_nvml  # noqa: E402

FAKE = Path(__file__).resolve().parents[1] / "support" / "fake_nvml" / "pynvml.py"


def a100(uuid, slices=None):
    d = {"uuid": uuid, "name": "NVIDIA A100-SXM4-80GB", "memory_total": 80 * 2**30, "events": []}
    if slices is not None:
        d["mig"] = {"enabled": True, "devices": slices}
    return d


def slice_(uuid, shape="1g.10gb", gi=7, ci=0):
    return {"uuid": uuid, "name": f"NVIDIA A100-SXM4-80GB MIG {shape}", "memory_total": 10 * 2**30, "gi": gi, "ci": ci}


@pytest.fixture
def fake(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("fake_pynvml_for_mig", FAKE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    state = tmp_path / "nvml.json"
    monkeypatch.setenv("GPUHUB_FAKE_NVML", str(state))

    def write(devices):
        state.write_text(json.dumps({"devices": devices}))

    mod.write = write
    return mod


def caps(tmp_path, gpu, gi, minor):
    for sub, m in ((f"gpu{gpu}/mig/gi{gi}", minor), (f"gpu{gpu}/mig/gi{gi}/ci0", minor + 1)):
        (tmp_path / sub).mkdir(parents=True, exist_ok=True)
        (tmp_path / sub / "access").write_text(f"DeviceFileMinor: {m}\nDeviceFileMode: 292\n")
    return str(tmp_path)


def test_slices_are_found_by_uuid_with_parent_and_shape_and_only_their_nodes(fake, tmp_path):
    seven = [slice_(f"MIG-s{i}", gi=7 + i) for i in range(7)]
    fake.write([a100("GPU-whole"), a100("GPU-split", seven)])
    for i in range(7):
        caps(tmp_path, 1, 7 + i, 100 + 2 * i)
    found = discover_nvml(capabilities=str(tmp_path))
    assert [(d.uuid, d.mig_profile, d.parent) for d in found] == [("GPU-whole", None, "")] + [
        (f"MIG-s{i}", "1g.10gb", "GPU-split") for i in range(7)
    ]
    p = policy()
    table = DeviceTable(lambda: p, discover=lambda: found)
    # the whole-GPU flavor does not take slices even though 'A100' is in their names, and vice versa
    assert [d.id for d in table.free_devices("a100")] == ["GPU-whole"]
    assert [d.id for d in table.free_devices("a100-1g")] == [f"MIG-s{i}" for i in range(7)]
    assert table.nodes_for(["MIG-s2"]) == ["nvidia-caps/nvidia-cap104", "nvidia-caps/nvidia-cap105", "nvidia1", *CONTROL_NODES]
    demand = demand_for(p, p.profile("mig-1g"))
    held = [table.allocate(f"student{i}/", demand) for i in range(7)]
    assert sorted(h[0] for h in held) == [f"MIG-s{i}" for i in range(7)]
    assert table.allocate("student7/", demand) is None
    assert table.shortage(demand) == "needs 1 A100 1g.10gb slice: only 0 of the 7 on this machine are free"


def test_a_layout_change_is_read_again_without_giving_anything_twice(fake):
    fake.write([a100("GPU-split", [slice_("MIG-a", gi=7), slice_("MIG-b", gi=8), slice_("MIG-c", gi=9)])])
    p = policy()
    table = DeviceTable(lambda: p, discover=discover_nvml)
    demand = demand_for(p, p.profile("mig-1g"))
    assert table.allocate("alice/", demand) == ["MIG-a"]
    assert not table.apply_layout(table.discover())  # nothing changed
    # an admin destroys the free MIG-b and MIG-c and creates four new 1g slices (alice's stays)
    fake.write([a100("GPU-split", [slice_("MIG-a", gi=7)] + [slice_(f"MIG-n{i}", gi=10 + i) for i in range(4)])])
    assert table.apply_layout(table.discover())
    assert [d.id for d in table.free_devices("a100-1g")] == [f"MIG-n{i}" for i in range(4)]
    got = [table.allocate(f"u{i}/", demand) for i in range(5)]
    assert got[:4] == [["MIG-n0"], ["MIG-n1"], ["MIG-n2"], ["MIG-n3"]] and got[4] is None  # never MIG-a twice
    assert table.owner["MIG-a"] == "alice/"
    # NVML not answering for a moment is not a layout with no devices
    assert not table.apply_layout([]) and len(table.devices) == 5


def test_a_bad_parent_gpu_takes_all_its_slices_out(fake, tmp_path, monkeypatch):
    from gpuhub_spawner.local import gpu_health

    devices = [a100("GPU-split", [slice_(f"MIG-s{i}", gi=7 + i) for i in range(3)]), a100("GPU-other")]
    fake.write(devices)
    monkeypatch.setattr(gpu_health, "audit", lambda event, **f: None)
    p = parse_policy(MIG.format(strategy="", labels="", count=1) + "health: {pollInterval: 1s}\n", "p.yaml")

    class Broker:
        class store:
            current = p

    async def run():
        broker = Broker()
        broker.devices = DeviceTable(lambda: p, discover=discover_nvml)
        broker.queue = AdmissionQueue(lambda: p, broker.devices)
        monitor = gpu_health.GpuHealthMonitor(broker, str(tmp_path / "gpu-health.json"))
        assert monitor.ids_of == {0: ["MIG-s0", "MIG-s1", "MIG-s2"], 1: ["GPU-other"]}
        monitor.start()
        for _ in range(100):
            if monitor.polls >= 1:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # the event thread registered
        devices[0]["events"].append({"id": 1, "type": 8, "data": 79})
        fake.write(devices)
        for _ in range(100):
            if broker.devices.health.of("MIG-s2").state == BAD:
                break
            await asyncio.sleep(0.05)
        monitor.stop()
        await asyncio.get_running_loop().run_in_executor(None, monitor._thread.join, 3)
        return broker.devices

    table = asyncio.run(run())
    assert [table.health.of(f"MIG-s{i}").state for i in range(3)] == [BAD, BAD, BAD]
    assert table.health.of("GPU-other").state == HEALTHY
    assert table.free_devices("a100-1g") == []
    assert "3 out of service" in table.shortage({"gpu/a100-1g": 1})


# -- culling a slice NVML does not measure ---------------------------------------------------------
from gpuhub_spawner.culling.rules import GPU_IDLE, TIMEOUT, CullState, Signals, decide  # noqa: E402
from gpuhub_spawner.policy.model import IdleRules  # noqa: E402


def test_an_unread_slice_counts_idle_or_only_activity_as_the_policy_says_and_the_warning_says_which():
    idle = IdleRules(timeout=3600, gpu_idle_timeout=1800, warning=600, gpu_unread="idle")
    s = CullState()
    d = decide(1800, idle, Signals(0.0, last_activity=1700, has_gpus=True, gpu_unread="idle"), s)
    assert d.action == "warn" and d.rule == GPU_IDLE  # busy notebook, but the slice counts as idle
    assert "which the policy counts as idle (gpuUnread: idle)" in d.reason

    activity = IdleRules(timeout=3600, gpu_idle_timeout=1800, warning=600, gpu_unread="activity")
    s = CullState()
    assert decide(3000, activity, Signals(0.0, last_activity=1700, has_gpus=True, gpu_unread="activity"), s).action == "keep"
    d = decide(1700 + 3600, activity, Signals(0.0, last_activity=1700, has_gpus=True, gpu_unread="activity"), s)
    assert d.action == "warn" and d.rule == TIMEOUT
    assert d.reason.startswith("no activity for 1h") and "judges it by activity only (gpuUnread: activity)" in d.reason
    assert decide(1700 + 3600 + 600, activity, Signals(0.0, 1700, has_gpus=True, gpu_unread="activity"), s).action == "cull"
    # a GPU that is read is judged as before, whatever gpuUnread says
    s = CullState()
    assert decide(1800, activity, Signals(0.0, last_activity=1700, has_gpus=True), s).rule == GPU_IDLE


# -- a slice's utilisation from GPM, where its GPU has it (Hopper), none where not (A100) ------------
from gpuhub_spawner.culling.gpu import read_nvml  # noqa: E402


def h100(uuid, slices):
    return {
        "uuid": uuid,
        "name": "NVIDIA H100 80GB HBM3",
        "memory_total": 80 * 2**30,
        "events": [],
        "gpm": True,
        "mig": {"enabled": True, "devices": slices},
    }


def test_a_hopper_slice_is_read_through_gpm_an_a100_slice_is_unread(fake, monkeypatch):
    h = [
        dict(slice_("MIG-h-busy", "1g.10gb", gi=7), utilization=83),
        dict(slice_("MIG-h-idle", "1g.10gb", gi=8), utilization=0),
        slice_("MIG-h-none", "1g.10gb", gi=9),
    ]  # GPM, but no reading for this one
    fake.write(
        [
            h100("GPU-h100", h),
            a100("GPU-a100", [dict(slice_("MIG-a", gi=7), utilization=90)]),
            {"uuid": "GPU-whole", "name": "NVIDIA L4", "utilization": 41, "events": []},
        ]
    )
    ids = ["MIG-h-busy", "MIG-h-idle", "MIG-h-none", "MIG-a", "GPU-whole", "MIG-gone"]
    waits = []
    monkeypatch.setattr("gpuhub_spawner.culling.gpu.time.sleep", waits.append)
    # a busy Hopper slice reads busy, an idle one idle; the A100's slice (no GPM) and the slice whose
    # metric fails have no reading at all, which the profile's gpuUnread decides; one wait for all
    assert read_nvml(ids, gpm_window=0.5) == {"MIG-h-busy": 83, "MIG-h-idle": 0, "GPU-whole": 41}
    assert waits == [0.5]
    # an nvidia-ml-py without GPM (older than 11.5): the slices are unread, nothing breaks
    monkeypatch.delattr(fake, "nvmlGpmQueryDeviceSupport")
    assert read_nvml(ids) == {"GPU-whole": 41}
    # no slice to sample through GPM: no wait
    waits.clear()
    assert read_nvml(["GPU-whole", "MIG-a"]) == {"GPU-whole": 41} and waits == []


def test_the_gpm_samples_are_freed_and_taken_of_the_slices_gpu_instance(fake, monkeypatch):
    fake.write([h100("GPU-h100", [dict(slice_("MIG-x", gi=11), utilization=5), dict(slice_("MIG-y", gi=12), utilization=60)])])
    monkeypatch.setattr("gpuhub_spawner.culling.gpu.time.sleep", lambda s: None)
    taken, allocated = [], []
    real_get, real_alloc = fake.nvmlGpmMigSampleGet, fake.nvmlGpmSampleAlloc
    monkeypatch.setattr(fake, "nvmlGpmMigSampleGet", lambda dev, gi, s: taken.append((dev, gi)) or real_get(dev, gi, s))
    monkeypatch.setattr(fake, "nvmlGpmSampleAlloc", lambda: allocated.append(real_alloc()) or allocated[-1])
    assert read_nvml(["MIG-y", "MIG-x"]) == {"MIG-y": 60, "MIG-x": 5}
    assert sorted(taken) == [(("fake", 0), 11)] * 2 + [(("fake", 0), 12)] * 2  # the parent GPU, each slice's GI twice
    assert len(allocated) == 4 and all(s.freed for s in allocated)


def test_a_busy_gpm_slice_is_kept_and_an_idle_one_warned_by_the_gpu_rule_not_the_unread_rule(fake, monkeypatch):
    fake.write(
        [h100("GPU-h100", [dict(slice_("MIG-busy", gi=7), utilization=70), dict(slice_("MIG-idle", gi=8), utilization=1)])]
    )
    monkeypatch.setattr("gpuhub_spawner.culling.gpu.time.sleep", lambda s: None)
    rules = IdleRules(timeout=3600, gpu_idle_timeout=1800, warning=600, gpu_unread="activity")
    readings = read_nvml(["MIG-busy", "MIG-idle"])
    now, threshold = 1800.0, 5  # both notebooks active all along; the culler's busy threshold
    decisions = {}
    for dev, util in readings.items():
        # a reading: gpuUnread does not apply (culling/board.py passes it only for an unread GPU)
        signals = Signals(0.0, last_activity=now, gpu_last_busy=now if util >= threshold else None, has_gpus=True)
        decisions[dev] = decide(now, rules, signals, CullState())
    assert decisions["MIG-busy"].action == "keep"
    assert decisions["MIG-idle"].action == "warn" and decisions["MIG-idle"].rule == GPU_IDLE
    assert decisions["MIG-idle"].reason == "its GPUs were idle for 30m"  # no word about unread GPUs


# -- quota in GPU memory for a team that mixes shapes (Kueue's resource transformations) ---------------
from gpuhub_spawner.admission import AdmissionQueue as _Queue, Ticket  # noqa: E402
from gpuhub_spawner.admission.quota import GPU_MEMORY  # noqa: E402

MIXED_SHAPES = """\
flavors:
  - {name: a100, displayName: A100, local: {match: A100, virtual: 1}}
  - {name: a100-1g, displayName: A100 1g.10gb, mig: {profile: 1g.10gb}, local: {match: A100, virtual: 7}}
  - {name: a100-3g, displayName: A100 3g.40gb, mig: {profile: 3g.40gb}, local: {match: A100, virtual: 2}}
teams:
  - name: lab
    displayName: Lab
    groups: [lab]
    quota: {gpus: {a100: 1}, gpuMemory: {nominal: 60Gi, flavors: [a100-1g, a100-3g]}}
  - name: students
    groups: [students]
    quota: {gpus: {a100-1g: 3}}
profiles:
  - {slug: small, displayName: small, gpu: {count: 1, flavor: a100-1g}, teams: [lab, students]}
  - {slug: large, displayName: large, gpu: {count: 1, flavor: a100-3g}, teams: [lab]}
"""


def test_a_team_mixing_shapes_counts_their_memory_and_waits_with_words_naming_the_slice():
    p = parse_policy(MIXED_SHAPES, "p.yaml")
    small, large = demand_for(p, p.profile("small")), demand_for(p, p.profile("large"))
    assert small[GPU_MEMORY] == 10 * 2**30 and large[GPU_MEMORY] == 40 * 2**30  # the memory the shape names
    lab, students = p.team("lab"), p.team("students")
    # 40Gi + 10Gi held: one more 1g fits (60Gi), however many 1g slices that makes; a 3g does not
    held = {"lab": {"gpu/a100-3g": 1, "gpu/a100-1g": 1, GPU_MEMORY: 50 * 2**30}}
    assert check_fit(p, held, lab, small).fits
    fit = check_fit(p, held, lab, large)
    assert not fit.fits and fit.never is None
    assert fit.shortages[0].reason == (
        "needs 40Gi of MIG slice memory (1 A100 3g.40gb slice): your team Lab is using "
        "50Gi of the 60Gi it may hold; it waits until one of your team's servers or jobs stops"
    )
    # the students count 1g slices, as before: their slices' memory is not limited
    used = {"students": {"gpu/a100-1g": 2, GPU_MEMORY: 20 * 2**30}}
    assert check_fit(p, used, students, small).fits
    fit = check_fit(p, {"students": {"gpu/a100-1g": 3, GPU_MEMORY: 30 * 2**30}}, students, small)
    assert not fit.fits and "needs 1 A100 1g.10gb slice:" in fit.shortages[0].reason


async def test_one_machine_admits_a_memory_team_by_memory_and_hands_out_slices_of_each_shape():
    p = parse_policy(MIXED_SHAPES, "p.yaml")
    table = DeviceTable(lambda: p, discover=lambda: [])  # the policy's virtual slices: 7 x 1g, 2 x 3g
    q = _Queue(lambda: p, table)

    def ticket(key, profile, team="lab"):
        return Ticket(key=key, user=key.split("/")[0], team=team, profile=profile, demand=demand_for(p, p.profile(profile)))

    a = q.submit(ticket("a/", "large"))
    b = q.submit(ticket("b/", "small"))
    c = q.submit(ticket("c/", "small"))  # 40 + 10 + 10 = 60Gi
    assert all(x.admission is not None for x in (a, b, c))
    assert len({*a.admission.devices, *b.admission.devices, *c.admission.devices}) == 3
    d = q.submit(ticket("d/", "small"))
    assert d.admission is None and "needs 10Gi of MIG slice memory (1 A100 1g.10gb slice)" in d.status.message
    s = q.submit(ticket("s/", "small", team="students"))  # another team, counted in slices: not held up
    assert s.admission is not None
    q.release("a/")  # the 3g slice's 40Gi come back: the waiting 1g goes in
    assert d.admission is not None
    assert q.usage()["lab"][GPU_MEMORY] == 30 * 2**30


def test_gpu_memory_quota_mistakes_are_explained_where_they_are():
    def errs(text):
        with pytest.raises(PolicyError) as e:
            parse_policy(text, "p.yaml")
        return [i.format("p.yaml") for i in e.value.issues]

    whole = errs(MIXED_SHAPES.replace("flavors: [a100-1g, a100-3g]", "flavors: [a100-1g, a100]"))
    assert any("teams[0].quota.gpuMemory.flavors[1]" in e and "'a100' is a whole GPU" in e for e in whole), whole
    both = errs(MIXED_SHAPES.replace("quota: {gpus: {a100: 1}, gpuMemory", "quota: {gpus: {a100: 1, a100-1g: 2}, gpuMemory"))
    assert len(both) == 1 and "teams[0].quota.gpus.a100-1g" in both[0] and "cannot also have a quota in slices" in both[0]
    single = MIXED_SHAPES.replace(
        "mig: {profile: 3g.40gb}",
        "mig: {profile: 3g.40gb, strategy: single}, nodeLabels: {nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB-MIG-3g.40gb}",
    )
    e = errs(single)
    assert len(e) == 1 and "flavors[1]" in e[0] and "single strategy, where every slice is nvidia.com/gpu" in e[0]
    e = errs(MIXED_SHAPES.replace("{nominal: 60Gi, flavors: [a100-1g, a100-3g]}", "{nominal: 30Gi, flavors: [a100-1g, a100-3g]}"))
    assert any("profiles[1].gpu.count" in x and "no team may use profile 'large'" in x for x in e), e  # 30Gi < one 3g slice


def test_a_lower_gpu_memory_quota_is_previewed_in_memory_words():
    from gpuhub_spawner.admission.impact import Holding, impact

    old = parse_policy(MIXED_SHAPES, "p.yaml")
    new = parse_policy(MIXED_SHAPES.replace("{nominal: 60Gi,", "{nominal: 40Gi,"), "p.yaml")
    held = [
        Holding("a/", "a", "lab", "large", demand_for(old, old.profile("large")), since=1.0),
        Holding("b/", "b", "lab", "small", demand_for(old, old.profile("small")), since=2.0),
    ]
    imp = impact(old, new, (), held, (), None, now=10.0)
    quotas = [ln.text for ln in imp.section("quotas")]
    assert quotas == ["Lab: MIG slice memory quota 60Gi → 40Gi."], quotas
    running = [ln.text for ln in imp.section("running")]
    assert len(running) == 1 and running[0].startswith("Lab holds 50Gi MIG slice memory and its new quota is 40Gi"), running


def test_a_slice_made_on_a_gpu_marked_bad_is_bad_too_and_one_on_a_drained_gpu_drained():
    from gpuhub_spawner.local.devices import NvmlDevice

    def mig(uuid, parent, index):
        return NvmlDevice(
            index, uuid, "NVIDIA A100-SXM4-80GB MIG 1g.10gb", 10, (f"nvidia{index}",), "1g.10gb", parent, "NVIDIA A100-SXM4-80GB"
        )

    p = policy()
    layout = [mig("MIG-a0", "GPU-a", 0), mig("MIG-a1", "GPU-a", 0), mig("MIG-b0", "GPU-b", 1), mig("MIG-c0", "GPU-c", 2)]
    table = DeviceTable(lambda: p, discover=lambda: layout)
    for dev in ("MIG-a0", "MIG-a1"):  # an XID 79 on GPU-a marks its slices (local/gpu_health.py)
        table.health.mark(dev, BAD, "XID 79: GPU has fallen off the bus", 79)
    table.health.drain("MIG-c0", "admin")  # GPU-c drained (its only slice)
    # an admin re-partitions all three GPUs while the hub runs: a new slice on each
    assert table.apply_layout(layout + [mig("MIG-a2", "GPU-a", 0), mig("MIG-b1", "GPU-b", 1), mig("MIG-c1", "GPU-c", 2)])
    assert table.health.of("MIG-a2").state == BAD and table.health.of("MIG-a2").xid == 79
    assert table.health.usable("MIG-b1") and not table.health.usable("MIG-c1")
    assert table.health.of("MIG-c1").drained == "admin"
    assert [d.id for d in table.free_devices("a100-1g")] == ["MIG-b0", "MIG-b1"]
    # uncordon heals the slice (only that); the marks do not come back at the next layout read
    table.health.uncordon("MIG-a2")
    assert not table.apply_layout(table.nvml) and table.health.usable("MIG-a2")


def test_kueues_shortage_messages_name_slices_and_slice_memory_on_the_spawn_page():
    from gpuhub_spawner.kube import kueue as K
    from gpuhub_spawner.kube.messages import shortages

    p = parse_policy(MIXED_SHAPES, "p.yaml")
    said = ", ".join(
        [
            K.MSG_UNUSED_QUOTA.format(resource="nvidia.com/mig-1g.10gb", flavor="a100-1g", more="1"),
            K.MSG_UNUSED_QUOTA.format(resource="gpuhub.io/mig-memory", flavor="gpuhub-default", more="10Gi"),
        ]
    )
    short, never = shortages(p, said)
    assert short == ["1 A100 1g.10gb slice", "10Gi of MIG slice memory"] and never == []
    said = K.MSG_MAX_CAPACITY.format(
        resource="gpuhub.io/mig-memory", flavor="gpuhub-default", previous="0", request="40Gi", capacity="30Gi"
    )
    assert shortages(p, said)[1] == ["40Gi of MIG slice memory requested but the team can hold at most 30Gi of MIG slice memory"]
    assert shortages(p, K.MSG_UNUSED_QUOTA.format(resource="nvidia.com/gpu", flavor="a100", more="2"))[0] == ["2 A100 GPUs"]
