"""The GPU health monitor of one machine (docs/gpu-health.md).

Reads NVML as NVIDIA's device plugin does, in the hub process:

- **events**, on a thread of its own (``nvmlEventSetWait`` blocks; never on the event
  loop): critical XIDs (``nvmlEventTypeXidCriticalError``) and double-bit ECC errors,
  classified by the policy's ``health:`` lists (``admission.health.classify_xid``);
- **counters**, every ``health.pollInterval`` (30 s), in the loop's executor: volatile
  uncorrected ECC errors, remapped rows (pending, failure), retired pages pending, the
  driver's recovery action (``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``), and whether NVML
  answers at all (``NVML_ERROR_GPU_IS_LOST`` / ``NVML_ERROR_RESET_REQUIRED``).

What they say goes into the device table's ``HealthBook`` on the event loop; a change
re-runs admission (a bad or drained device is never handed out, the waiting messages
count it), is logged and audited, and shows on the holder's home page, the status page
and ``/hub/metrics`` (``gpuhub_gpu_health``, ``gpuhub_gpu_xid_total``). Drains and the
marks of events are kept in the data directory across hub restarts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from pathlib import Path

from prometheus_client import REGISTRY, Counter
from prometheus_client.core import GaugeMetricFamily

from ..admission.health import BAD, HEALTHY, RANK, Counters, classify_counters, classify_xid, xid_text
from ..usage.recorder import audit
from ..policy.files import write_atomically

log = logging.getLogger("JupyterHub.gpuhub.health")

XID_TOTAL = Counter("gpuhub_gpu_xid_total", "XID errors NVML reported, per GPU and XID", ["device", "xid"])
WAIT_MS = 1000  # an event wait returns at least this often, so the thread can stop


def _nvml():
    import pynvml  # nvidia-ml-py, a dependency; the fake one in tests

    return pynvml


def read_counters(pynvml, handle) -> Counters:
    """Every polled signal of one GPU; a signal NVML does not support stays None."""
    c = Counters()

    def read(fn):
        try:
            return fn()
        except pynvml.NVMLError as e:
            if e.value in (pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED):
                raise
            return None  # not supported (no ECC, no row remapper, an old driver)

    try:
        c.ecc_uncorrected = read(
            lambda: pynvml.nvmlDeviceGetTotalEccErrors(
                handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
            )
        )
        rows = read(lambda: pynvml.nvmlDeviceGetRemappedRows(handle))
        if rows is not None:
            c.remap_pending, c.remap_failure = bool(rows[2]), bool(rows[3])
        pending = read(lambda: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))
        c.retired_pages_pending = None if pending is None else pending == pynvml.NVML_FEATURE_ENABLED
        field = getattr(pynvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field is not None:
            values = read(lambda: pynvml.nvmlDeviceGetFieldValues(handle, [field]))
            if values is not None and values[0].nvmlReturn == pynvml.NVML_SUCCESS:
                c.recovery_action = int(values[0].value.uiVal)
    except pynvml.NVMLError as e:
        c.lost = str(e)
    return c


class GpuHealthMonitor:
    """One per hub (the broker's). ``start()`` needs the running event loop."""

    def __init__(self, broker, state_file: str = ""):
        self.broker = broker
        self.table = broker.devices
        self.book = self.table.health
        self.state_file = state_file
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._poller: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.polls = 0
        self._changed: asyncio.Event | None = None  # set (and replaced) at every change of a state
        self.waiters = 0
        self._load()
        register_metrics(self)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # outside the hub's loop (tests, CLI): drains work, nothing is read
        if not self.ids_of:
            log.info("GPU health: no NVML devices (virtual GPUs); only drains apply")
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._events, name="gpuhub-gpu-events", daemon=True)
            self._thread.start()
        if self._poller is None:
            self._poller = asyncio.ensure_future(self._poll_forever())

    def stop(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.cancel()

    @property
    def rules(self):
        return self.broker.store.current.health

    @property
    def ids_of(self) -> dict[int, list[str]]:
        """NVML index of each GPU -> the device-table ids on it (the GPU, or its MIG slices, as
        NVML lists them now): an event or a bad counter on a parent GPU takes all its slices out."""
        out: dict[int, list[str]] = {}
        for d in self.table.nvml:
            out.setdefault(d.index, []).append(d.uuid)
        return out

    # -- events (a thread) -----------------------------------------------------------------------
    def _events(self) -> None:
        pynvml = _nvml()
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            log.warning("GPU health: NVML unavailable for events (%s)", e)
            return
        index_of: dict[str, int] = {}
        eventset = None
        try:
            eventset = pynvml.nvmlEventSetCreate()
            wanted = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
            for i in self.ids_of:
                try:
                    handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                    index_of[_text(pynvml.nvmlDeviceGetUUID(handle))] = i
                    mask = wanted & pynvml.nvmlDeviceGetSupportedEventTypes(handle)
                    pynvml.nvmlDeviceRegisterEvents(handle, mask, eventset)
                except pynvml.NVMLError as e:
                    if e.value in (pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED):
                        self._post(self._on_lost, i, str(e))
                    else:
                        log.warning("GPU health: no XID events from GPU %d (%s); its counters are still read", i, e)
            log.info("GPU health: watching XID events of %d GPU(s)", len(index_of))
            while not self._stop.is_set():
                try:
                    event = pynvml.nvmlEventSetWait(eventset, WAIT_MS)
                except pynvml.NVMLError as e:
                    if e.value == pynvml.NVML_ERROR_TIMEOUT:
                        continue
                    log.warning("GPU health: waiting for NVML events failed (%s); retrying in 5 s", e)
                    self._stop.wait(5)
                    continue
                try:
                    index = index_of.get(_text(pynvml.nvmlDeviceGetUUID(event.device)))
                except pynvml.NVMLError:
                    index = None
                if index is None:
                    log.warning("GPU health: event %#x (data %s) from a GPU not in the table", event.eventType, event.eventData)
                    continue
                self._post(self._on_event, index, int(event.eventType), int(event.eventData))
        except Exception:
            log.exception("GPU health: the event thread stopped")
        finally:
            if eventset is not None:
                try:
                    pynvml.nvmlEventSetFree(eventset)
                except pynvml.NVMLError:
                    pass
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError:
                pass

    def _post(self, fn, *args) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn, *args)

    def _on_event(self, index: int, event_type: int, data: int) -> None:
        pynvml = _nvml()
        ids = self.ids_of.get(index, [])
        parent = ids[0] if len(ids) == 1 else f"gpu{index}"
        if event_type & pynvml.nvmlEventTypeXidCriticalError:
            XID_TOTAL.labels(device=parent, xid=str(data)).inc()
            state = classify_xid(self.rules, data)
            reason, xid = xid_text(data), data
        elif event_type & pynvml.nvmlEventTypeDoubleBitEccError:
            state, reason, xid = BAD, "double-bit ECC error", None
        else:
            return
        log.warning("GPU health: %s on GPU %d (%s): %s", reason, index, ", ".join(ids), state)
        audit("gpu_event", devices=ids, reason=reason, xid=xid, verdict=state)
        for dev in ids:
            self._apply(dev, lambda d=dev: self.book.mark(d, state, reason, xid), persist=True)

    def _on_lost(self, index: int, words: str) -> None:
        for dev in self.ids_of.get(index, []):
            self._apply(dev, lambda d=dev: self.book.poll(d, [(BAD, f"NVML: {words}")]))

    # -- counters (every poll interval) ------------------------------------------------------------
    async def _poll_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            try:
                # A MIG layout changed while the hub runs (nvidia-smi mig -cgi/-dgi): re-read it.
                if self.table.apply_layout(await loop.run_in_executor(None, self.table.discover)):
                    self.broker.queue.schedule()
                readings = await loop.run_in_executor(None, self._read_all)
                self.apply_readings(readings)
            except Exception:
                log.exception("GPU health: reading the counters failed")
            await asyncio.sleep(self.rules.poll_interval)

    def _read_all(self) -> dict[int, Counters]:
        pynvml = _nvml()
        pynvml.nvmlInit()
        try:
            out = {}
            for i in self.ids_of:
                try:
                    handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                except pynvml.NVMLError as e:
                    out[i] = Counters(lost=str(e))
                    continue
                out[i] = read_counters(pynvml, handle)
            return out
        finally:
            pynvml.nvmlShutdown()

    def apply_readings(self, readings: dict[int, Counters]) -> None:
        self.polls += 1
        for index, counters in readings.items():
            verdicts = classify_counters(counters)
            for dev in self.ids_of.get(index, []):
                self._apply(dev, lambda d=dev, v=verdicts: self.book.poll(d, v))

    # -- changes -----------------------------------------------------------------------------------
    def _apply(self, dev: str, change, persist: bool = False) -> None:
        before = self.book.of(dev)
        was = (before.state, before.usable)
        change()
        h = self.book.of(dev)
        if persist or (h.state, h.usable) != was:
            self.save()  # an event's mark (kept across restarts), or a new state
        if (h.state, h.usable) == was:
            return
        holder = self.table.owner.get(dev)
        adm = self.broker.queue.admitted.get(holder) if holder else None
        flavor = next((d.flavor for d in self.table.devices if d.id == dev), None)
        level = logging.WARNING if RANK[h.state] > RANK[was[0]] else logging.INFO
        log.log(level, "GPU %s (%s) is now %s: %s%s", dev, flavor, h.state, h.summary(), f"; held by {holder}" if holder else "")
        audit(
            "gpu_health",
            device=dev,
            flavor=flavor,
            state=h.state,
            was=was[0],
            reason=h.reason or None,
            xid=h.xid,
            key=holder,
            user=getattr(adm, "user", None),
            team=getattr(adm, "team", None),
        )
        if h.state == BAD and was[0] != BAD and holder and holder.startswith("job:"):
            # a batch job cannot be told and wait: its attempt ends now, and it resumes elsewhere
            self.broker.gpu_failed_job(holder, f"{dev} ({h.reason})")
        self.broker.queue.schedule()  # usable capacity changed: admit, and re-word every waiting message
        self._notify()  # a holder's JupyterLab waiting on culling_api is told now

    def _notify(self) -> None:
        """Wake whoever waits for a change (JupyterLab's long poll, through culling_api)."""
        event, self._changed = self._changed, None
        if event is not None:
            event.set()

    async def wait_change(self, timeout: float) -> bool:
        """Wait until a device's state or drain changes, at most ``timeout`` s; True if it did.
        On the event loop only (every change is applied there)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        event = self._changed
        self.waiters += 1
        try:
            async with asyncio.timeout(max(0.0, timeout)):  # not wait_for: 3.11's loses a cancel that finds it done
                await event.wait()
            return True
        except TimeoutError:
            return False
        finally:
            self.waiters -= 1

    def drain(self, dev: str, by: str) -> bool:
        changed = self.book.drain(dev, by)
        if changed:
            holder = self.table.owner.get(dev)
            log.warning("GPU %s drained by %s%s", dev, by, f"; {holder} keeps it until it stops" if holder else "")
            audit("gpu_drained", device=dev, by=by, key=holder)
            self.save()
            self.broker.queue.schedule()
            self._notify()
        return changed

    def uncordon(self, dev: str, by: str) -> bool:
        changed = self.book.uncordon(dev)
        h = self.book.of(dev)
        log.info("GPU %s uncordoned by %s: now %s", dev, by, h.state)
        audit("gpu_uncordoned", device=dev, by=by, state=h.state, reason=h.reason or None)
        self.save()
        if changed:
            self.broker.queue.schedule()
            self._notify()
        return changed

    # -- persistence -------------------------------------------------------------------------------
    def _load(self) -> None:
        if not self.state_file or not os.path.exists(self.state_file):
            return
        try:
            self.book.load(json.loads(Path(self.state_file).read_text()))
        except (OSError, ValueError, TypeError, KeyError) as e:
            log.error("GPU health: cannot read %s (%s); starting with every GPU healthy", self.state_file, e)
            return
        out = [f"{d} ({h.summary()})" for d, h in self.book.devices.items() if not h.usable]
        if out:
            log.warning("GPU health: out of service since before the restart: %s", "; ".join(out))

    def save(self) -> None:
        if not self.state_file:
            return
        path = Path(self.state_file)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, json.dumps(self.book.to_json()), 0o600)
        except OSError as e:
            log.error("GPU health: cannot save %s: %s", path, e)

    # -- what pages and the API show ---------------------------------------------------------------
    def listing(self) -> list[dict]:
        policy = self.broker.store.current
        names = {f.name: f.display_name or f.name for f in policy.flavors}
        out = []
        for d in self.table.devices:
            holder = self.table.owner.get(d.id)
            adm = self.broker.queue.admitted.get(holder) if holder else None
            out.append(
                {
                    "id": d.id,
                    "flavor": d.flavor,
                    "flavor_name": names.get(d.flavor, d.flavor),
                    "name": d.name,
                    "virtual": d.virtual,
                    "key": holder,
                    "user": getattr(adm, "user", None),
                    "team": getattr(adm, "team", None),
                    **self.book.of(d.id).as_dict(),
                }
            )
        return out


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _HealthCollector:
    monitor: GpuHealthMonitor | None = None

    def describe(self):
        return []

    def collect(self):
        m = self.monitor
        if m is None:
            return
        health = GaugeMetricFamily(
            "gpuhub_gpu_health",
            "1 for each GPU's current health state (healthy, suspect, bad)",
            labels=["device", "flavor", "state"],
        )
        drained = GaugeMetricFamily("gpuhub_gpu_drained", "1 when an admin drained the GPU", labels=["device", "flavor"])
        usable = GaugeMetricFamily(
            "gpuhub_gpus_usable", "GPUs of a flavor that may be handed out (not bad, not drained)", labels=["flavor"]
        )
        counts: dict[str, int] = {}
        for d in m.table.devices:
            h = m.book.of(d.id)
            for state in RANK:
                health.add_metric([d.id, d.flavor, state], 1 if h.state == state else 0)
            drained.add_metric([d.id, d.flavor], 1 if h.drained else 0)
            counts[d.flavor] = counts.get(d.flavor, 0) + (1 if h.usable else 0)
        for flavor, n in counts.items():
            usable.add_metric([flavor], n)
        yield from (health, drained, usable)


# One per process, registered at import (Prometheus's registry is the process's); it yields
# nothing until a hub's monitor hands itself in.
HEALTH = _HealthCollector()
REGISTRY.register(HEALTH)


def register_metrics(monitor: GpuHealthMonitor) -> None:
    """Scrapes describe ``monitor``'s GPUs from now on."""
    HEALTH.monitor = monitor


__all__ = ["GpuHealthMonitor", "read_counters", "HEALTHY", "BAD"]
