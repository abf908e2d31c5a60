"""GPU health (issue 23): the policy's ``health:`` section, the classification of XIDs and
counters, the health book, the device table and queue honouring it, the monitor reading
the fake NVML in-process, and the fake keeping nvidia-ml-py's names and signatures."""

import asyncio
import importlib.util
import inspect
import json
import re
import sys
from pathlib import Path

import pytest

from gpuhub_spawner.admission import AdmissionQueue, Ticket
from gpuhub_spawner.admission.health import BAD, HEALTHY, SUSPECT, Counters, HealthBook, classify_counters, classify_xid
from gpuhub_spawner.local.devices import DeviceTable, NvmlDevice
from gpuhub_spawner.policy import PolicyError, parse_policy
from gpuhub_spawner.policy.model import HealthRules

FAKE = Path(__file__).resolve().parents[1] / "support" / "fake_nvml" / "pynvml.py"

POLICY = """\
flavors:
  - name: a100
    displayName: A100
    local: {match: A100}
teams:
  - name: vision
    displayName: Vision Lab
    groups: [vision-lab]
    quota: {gpus: {a100: 3}}
profiles:
  - {slug: g1, displayName: g1, gpu: {count: 1, flavor: a100}, teams: "*"}
"""

# The list NVIDIA's k8s-device-plugin ignores by default (internal/rm/health.go).
DEVICE_PLUGIN_IGNORED = [13, 31, 43, 45, 68, 109]


def _issues(text: str) -> list[str]:
    with pytest.raises(PolicyError) as e:
        parse_policy(text, "p.yaml")
    return [i.format("p.yaml") for i in e.value.issues]


# -- policy ---------------------------------------------------------------------------------------
def test_health_defaults_are_the_device_plugins():
    rules = parse_policy(POLICY).health
    assert rules.application_xids == DEVICE_PLUGIN_IGNORED
    assert rules.critical_xids is None  # "all": every other XID takes the GPU out
    assert rules.poll_interval == 30.0
    assert parse_policy(POLICY + "health: {criticalXids: all, pollInterval: 1m}\n").health.poll_interval == 60.0


def test_health_mistakes_are_located():
    lines = POLICY.count("\n")
    assert _issues(POLICY + "health:\n  pollInterval: 0.5s\n") == [
        f"p.yaml:{lines + 2}:17: health.pollInterval: must be between 1s and 1h (got 0.5s)"
    ]
    issues = _issues(POLICY + "health:\n  criticalXids: [79, 13, 79]\n")
    assert any(
        i.startswith(f"p.yaml:{lines + 2}:") and "health.criticalXids[1]: XID 13 is also in applicationXids" in i for i in issues
    ), issues
    assert any("health.criticalXids[2]: XID 79 is listed twice" in i for i in issues), issues
    assert _issues(POLICY + "health: {criticalXids: sometimes}\n") == [
        f"p.yaml:{lines + 1}:24: health.criticalXids: must be 'all' or a list of XID numbers (got 'sometimes')"
    ]
    assert "health.applicationXids[0]: must be at least 1 (got 0)" in _issues(POLICY + "health: {applicationXids: [0]}\n")[0]
    assert "did you mean 'pollInterval'" in _issues(POLICY + "health: {pollIntervall: 5s}\n")[0]


# -- classification -------------------------------------------------------------------------------
@pytest.mark.parametrize("xid", DEVICE_PLUGIN_IGNORED)
def test_application_xids_leave_the_gpu_in(xid):
    assert classify_xid(HealthRules(), xid) == HEALTHY


@pytest.mark.parametrize("xid", [48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 154])
def test_other_xids_take_it_out_by_default(xid):
    assert classify_xid(HealthRules(), xid) == BAD


def test_an_explicit_critical_list_makes_unlisted_xids_suspect():
    rules = HealthRules(critical_xids=[79])
    assert classify_xid(rules, 79) == BAD
    assert classify_xid(rules, 48) == SUSPECT
    assert classify_xid(rules, 13) == HEALTHY


def test_counters():
    assert classify_counters(Counters(0, False, False, False, 0)) == []
    assert classify_counters(Counters()) == []  # nothing supported: nothing known, nothing wrong
    assert classify_counters(Counters(ecc_uncorrected=2))[0][0] == BAD
    assert classify_counters(Counters(remap_failure=True))[0][0] == BAD
    assert classify_counters(Counters(remap_pending=True)) == [
        (SUSPECT, "a memory row remapping is pending (applied at the next GPU reset)")
    ]
    assert classify_counters(Counters(retired_pages_pending=True))[0][0] == SUSPECT
    assert classify_counters(Counters(recovery_action=1)) == [(BAD, "the driver asks for a GPU reset")]
    assert classify_counters(Counters(recovery_action=3))[0][0] == SUSPECT
    assert classify_counters(Counters(lost="GPU is lost")) == [(BAD, "NVML: GPU is lost")]


# -- the health book ------------------------------------------------------------------------------
def test_an_xid_mark_stays_until_uncordon_and_counters_are_re_read():
    book = HealthBook()
    assert book.mark("g0", BAD, "XID 79: GPU has fallen off the bus", 79, now=100.0)
    assert not book.poll("g0", [], now=130.0)  # a clean poll does not clear an event's mark
    h = book.of("g0")
    assert (h.state, h.xid, h.since, h.usable) == (BAD, 79, 100.0, False)
    assert book.uncordon("g0", now=200.0)
    assert book.of("g0").state == HEALTHY and book.usable("g0")

    assert book.poll("g1", [(SUSPECT, "a memory row remapping is pending")], now=10.0)
    assert book.of("g1").state == SUSPECT and book.usable("g1")  # suspect is still handed out
    assert book.poll("g1", [], now=40.0)  # a reset applied the remap
    assert book.of("g1").state == HEALTHY
    assert not book.mark("g1", HEALTHY, "XID 13")  # the application's own error changes nothing


def test_drain_and_persistence():
    book = HealthBook()
    book.drain("g0", "admin", now=5.0)
    book.mark("g1", BAD, "double-bit ECC error", now=6.0)
    again = HealthBook()
    again.load(json.loads(json.dumps(book.to_json())))
    assert not again.usable("g0") and again.of("g0").state == HEALTHY and again.of("g0").drained == "admin"
    assert again.of("g1").state == BAD and again.of("g1").since == 6.0


# -- the device table and the queue ---------------------------------------------------------------
def _table():
    policy = parse_policy(POLICY)
    gpus = [NvmlDevice(i, f"GPU-{i}", "NVIDIA A100-SXM4-80GB", 80) for i in range(3)]
    return policy, DeviceTable(lambda: policy, discover=lambda: gpus)


def test_a_bad_gpu_is_never_handed_out_and_the_wait_says_why():
    async def run():
        policy, table = _table()
        queue = AdmissionQueue(lambda: policy, table)
        table.health.mark("GPU-0", BAD, "XID 79: GPU has fallen off the bus", 79, now=0.0)
        got = [queue.submit(Ticket(f"u{i}/", f"u{i}", "vision", "g1", {"gpu/a100": 1})) for i in range(3)]
        assert [t.admission.devices for t in got[:2]] == [["GPU-1"], ["GPU-2"]]
        waiting = got[2]
        assert waiting.admission is None
        assert re.search(
            r"only 0 of the 2 usable on this machine are free \(2 of 3 A100 usable, "
            r"1 out of service since \d\d:\d\d \(XID 79: GPU has fallen off the bus\)\)",
            waiting.status.message,
        ), waiting.status.message
        queue.release("u0/")
        assert waiting.admission.devices == ["GPU-1"]  # the freed healthy one, never GPU-0
        # uncordoned: back in admission
        table.health.uncordon("GPU-0")
        third = queue.submit(Ticket("u3/", "u3", "vision", "g1", {"gpu/a100": 1}))
        assert third.admission.devices == ["GPU-0"]

    asyncio.run(run())


def test_a_request_for_all_gpus_waits_while_one_is_out_instead_of_being_refused():
    async def run():
        policy, table = _table()
        queue = AdmissionQueue(lambda: policy, table)
        table.health.drain("GPU-2", "admin")
        t = queue.submit(Ticket("u/", "u", "vision", "g3", {"gpu/a100": 3}))
        assert t.admission is None and "drained by admin" in t.status.message

    asyncio.run(run())


# -- the monitor against the fake NVML (in-process) -----------------------------------------------
def _load_fake():
    spec = importlib.util.spec_from_file_location("fake_pynvml_for_health", FAKE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_read_counters_from_the_fake(tmp_path, monkeypatch):
    from gpuhub_spawner.local.gpu_health import read_counters

    fake = _load_fake()
    state = tmp_path / "nvml.json"
    monkeypatch.setenv("GPUHUB_FAKE_NVML", str(state))
    state.write_text(
        json.dumps(
            {
                "devices": [
                    {
                        "uuid": "GPU-0",
                        "ecc_uncorrected_volatile": 1,
                        "remapped_rows": [0, 1, 1, 0],
                        "retired_pages_pending": 1,
                        "recovery_action": 1,
                    },
                    {"uuid": "GPU-1", "not_supported": ["ecc", "remapped_rows", "retired_pages", "recovery_action"]},
                    {"uuid": "GPU-2", "lost": True},
                ]
            }
        )
    )
    fake.nvmlInit()
    c0, c1, c2 = (read_counters(fake, fake.nvmlDeviceGetHandleByIndex(i)) for i in range(3))
    assert (c0.ecc_uncorrected, c0.remap_pending, c0.remap_failure, c0.retired_pages_pending, c0.recovery_action) == (
        1,
        True,
        False,
        True,
        1,
    )
    assert c1 == Counters()
    assert c2.lost == "GPU is lost"
    fake.nvmlShutdown()


def test_the_fake_delivers_each_event_once_and_only_after_registration(tmp_path, monkeypatch):
    fake = _load_fake()
    state = tmp_path / "nvml.json"
    monkeypatch.setenv("GPUHUB_FAKE_NVML", str(state))
    dev = {"uuid": "GPU-0", "events": [{"id": 1, "type": 8, "data": 48}]}
    state.write_text(json.dumps({"devices": [dev]}))
    fake.nvmlInit()
    es = fake.nvmlEventSetCreate()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    fake.nvmlDeviceRegisterEvents(h, fake.nvmlEventTypeXidCriticalError, es)
    with pytest.raises(fake.NVMLError_Timeout):
        fake.nvmlEventSetWait(es, 100)  # the XID 48 happened before registration
    dev["events"].append({"id": 2, "type": 8, "data": 79})
    state.write_text(json.dumps({"devices": [dev]}))
    e = fake.nvmlEventSetWait(es, 1000)
    assert (e.eventType, e.eventData, fake.nvmlDeviceGetUUID(e.device)) == (fake.nvmlEventTypeXidCriticalError, 79, "GPU-0")
    with pytest.raises(fake.NVMLError) as err:
        fake.nvmlEventSetWait(es, 100)
    assert err.value.value == fake.NVML_ERROR_TIMEOUT
    fake.nvmlEventSetFree(es)
    fake.nvmlShutdown()


def test_the_fake_keeps_nvidia_ml_py_names_and_signatures():
    import pynvml as real  # nvidia-ml-py, installed in the venv

    if Path(real.__file__).resolve() == FAKE.resolve():
        pytest.skip("the fake is first on sys.path here")
    fake = _load_fake()
    for name, obj in vars(fake).items():
        if name.startswith("nvml") and callable(obj):
            assert hasattr(real, name), f"nvidia-ml-py has no {name}"
            assert list(inspect.signature(obj).parameters) == list(inspect.signature(getattr(real, name)).parameters), name
        elif re.match(r"^(NVML_|nvmlEventType)", name):
            assert getattr(real, name) == obj, name
        elif name.startswith("NVMLError_"):
            assert hasattr(real, name), name
    assert isinstance(fake.NVMLError(fake.NVML_ERROR_GPU_IS_LOST), fake.NVMLError_GpuIsLost)


def test_the_monitor_turns_events_and_polls_into_admission(tmp_path, monkeypatch):
    """XID 79 and a DBE counter take GPUs out; a pending remap is suspect; XID 13 leaves it in."""
    from gpuhub_spawner.local import gpu_health

    fake = _load_fake()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    state = tmp_path / "nvml.json"
    monkeypatch.setenv("GPUHUB_FAKE_NVML", str(state))
    devices = [{"uuid": f"GPU-{i}", "name": "NVIDIA A100-SXM4-80GB", "events": []} for i in range(3)]
    state.write_text(json.dumps({"devices": devices}))
    audits = []
    monkeypatch.setattr(gpu_health, "audit", lambda event, **f: audits.append((event, f)))

    class Store:
        current = parse_policy(POLICY + "health: {pollInterval: 1s}\n")

    class Broker:
        store = Store()

    async def run():
        broker = Broker()
        broker.devices = DeviceTable(
            lambda: broker.store.current,
            discover=lambda: [NvmlDevice(i, f"GPU-{i}", "NVIDIA A100-SXM4-80GB", 80) for i in range(3)],
        )
        broker.queue = AdmissionQueue(lambda: broker.store.current, broker.devices)
        monitor = gpu_health.GpuHealthMonitor(broker, str(tmp_path / "gpu-health.json"))
        monitor.start()

        async def until(pred, what):
            for _ in range(100):
                if pred():
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(what)

        await until(lambda: monitor.polls >= 1, "first poll")
        await asyncio.sleep(0.3)  # the event thread registered
        # JupyterLab's long poll (culling_api): nothing changes, the wait times out...
        assert await monitor.wait_change(0.05) is False and monitor.waiters == 0
        waiter = asyncio.ensure_future(monitor.wait_change(30))  # ... and a change wakes it
        devices[0]["events"].append({"id": 1, "type": 8, "data": 13})  # application error
        devices[1]["events"].append({"id": 1, "type": 8, "data": 79})
        devices[2]["remapped_rows"] = [0, 0, 1, 0]
        state.write_text(json.dumps({"devices": devices}))
        await until(lambda: broker.devices.health.of("GPU-1").state == BAD, "XID 79 marks GPU-1 bad")
        assert await asyncio.wait_for(waiter, 1) is True and monitor.waiters == 0
        await until(lambda: broker.devices.health.of("GPU-2").state == SUSPECT, "pending remap: suspect")
        assert broker.devices.health.of("GPU-0").state == HEALTHY
        assert [d.id for d in broker.devices.free_devices("a100")] == ["GPU-0", "GPU-2"]
        devices[0]["ecc_uncorrected_volatile"] = 1
        state.write_text(json.dumps({"devices": devices}))
        await until(lambda: broker.devices.health.of("GPU-0").state == BAD, "a DBE count takes GPU-0 out")
        monitor.stop()
        await asyncio.get_running_loop().run_in_executor(None, monitor._thread.join, 3)
        assert json.loads((tmp_path / "gpu-health.json").read_text())["GPU-1"]["marks"][0]["xid"] == 79
        return [(e, f.get("device"), f.get("state")) for e, f in audits if e == "gpu_health"]

    changes = asyncio.run(run())
    assert ("gpu_health", "GPU-1", BAD) in changes and ("gpu_health", "GPU-2", SUSPECT) in changes
    assert ("gpu_health", "GPU-0", BAD) in changes
    assert gpu_health.XID_TOTAL.labels(device="GPU-1", xid="79")._value.get() >= 1
