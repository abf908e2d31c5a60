"""GPU inventory and the device table of one machine.

Devices come from NVML (nvidia-ml-py) when a driver is present, MIG slices included,
and are matched to flavors by the policy's ``local`` rules. Where NVML finds nothing
(a laptop, CI) each flavor's ``local.virtual`` count of virtual GPUs stands in, so
everything but CUDA itself can be tried. The table guarantees that no device is ever
handed to two servers at once, and re-registers holders after a hub restart.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Callable

from ..admission.health import HealthBook
from ..admission.quota import Demand, describe
from ..policy.model import Policy

log = logging.getLogger("JupyterHub.gpuhub.devices")


@dataclass(frozen=True)
class NvmlDevice:
    index: int
    uuid: str  # GPU-... or MIG-...
    name: str
    memory_total: int
    # Device nodes (relative to /dev) a process needs to use it: nvidia<minor>, and for a
    # MIG slice also its GPU- and compute-instance capability nodes (nvidia-caps/...).
    nodes: tuple[str, ...] = ()
    # A MIG slice: its shape ('1g.10gb', from NVML's name '... MIG 1g.10gb') and its parent GPU.
    mig_profile: str | None = None
    parent: str = ""  # the parent GPU's UUID
    parent_name: str = ""


@dataclass(frozen=True)
class Device:
    id: str  # what goes into CUDA_VISIBLE_DEVICES
    flavor: str
    name: str
    virtual: bool
    nodes: tuple[str, ...] = ()  # what the server's private /dev holds for it


# Opened by every CUDA process that uses any GPU; they give access to no GPU by themselves.
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")


def _gpu_minor(pynvml, handle, index: int) -> int:
    try:
        return int(pynvml.nvmlDeviceGetMinorNumber(handle))
    except Exception:  # not in every NVML (or stand-in): the index usually is the minor
        return index


def _mig_cap_nodes(pynvml, mig_handle, minor: int, proc: str = "/proc/driver/nvidia/capabilities") -> tuple[str, ...]:
    """The nvidia-caps nodes granting a MIG slice's GPU and compute instance (from the driver's table)."""
    try:
        gi = pynvml.nvmlDeviceGetGpuInstanceId(mig_handle)
        ci = pynvml.nvmlDeviceGetComputeInstanceId(mig_handle)
    except Exception:
        return ()
    nodes = []
    for sub in (f"gi{gi}", f"gi{gi}/ci{ci}"):
        try:
            text = open(f"{proc}/gpu{minor}/mig/{sub}/access").read()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("DeviceFileMinor:"):
                nodes.append(f"nvidia-caps/nvidia-cap{int(line.split(':')[1])}")
    return tuple(nodes)


def _decode(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


CAPABILITIES = "/proc/driver/nvidia/capabilities"
_MIG_NAME = re.compile(r"MIG\s+(\S+)\s*$")  # 'NVIDIA A100-SXM4-80GB MIG 1g.10gb' -> 1g.10gb


def discover_nvml(capabilities: str = CAPABILITIES) -> list[NvmlDevice]:
    """Every GPU (or MIG slice, where MIG is on) that NVML reports; [] without a driver."""
    try:
        import pynvml
    except ImportError:  # pragma: no cover - nvidia-ml-py is a dependency
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        log.info("NVML not available (%s): using the policy's virtual GPUs", e)
        return []
    found: list[NvmlDevice] = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = _decode(pynvml.nvmlDeviceGetName(handle))
            minor = _gpu_minor(pynvml, handle, i)
            migs = []
            try:
                current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
                if current == pynvml.NVML_DEVICE_MIG_ENABLE:
                    for m in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                        try:
                            mh = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, m)
                        except pynvml.NVMLError:
                            continue
                        slice_name = _decode(pynvml.nvmlDeviceGetName(mh))
                        shape = _MIG_NAME.search(slice_name)
                        migs.append(
                            NvmlDevice(
                                i,
                                _decode(pynvml.nvmlDeviceGetUUID(mh)),
                                slice_name,
                                pynvml.nvmlDeviceGetMemoryInfo(mh).total,
                                (f"nvidia{minor}", *_mig_cap_nodes(pynvml, mh, minor, capabilities)),
                                shape.group(1) if shape else "unknown",
                                _decode(pynvml.nvmlDeviceGetUUID(handle)),
                                name,
                            )
                        )
            except pynvml.NVMLError:
                pass  # MIG not supported on this GPU
            if migs:
                found.extend(migs)
            elif current_mig_on(pynvml, handle):
                log.warning("GPU %d (%s) has MIG on but no slices: nothing of it is handed out", i, name)
            else:
                found.append(
                    NvmlDevice(
                        i,
                        _decode(pynvml.nvmlDeviceGetUUID(handle)),
                        name,
                        pynvml.nvmlDeviceGetMemoryInfo(handle).total,
                        (f"nvidia{minor}",),
                    )
                )
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return found


@dataclass(frozen=True)
class Driver:
    """The NVIDIA driver, as NVML reports it."""

    version: str  # "550.54.15"
    cuda: tuple[int, int]  # the newest CUDA version it supports, (12, 4)

    @property
    def cuda_text(self) -> str:
        return f"{self.cuda[0]}.{self.cuda[1]}"


def read_driver() -> Driver | None:
    """The driver's version and the newest CUDA it supports; None without NVML (virtual GPUs)."""
    try:
        import pynvml
    except ImportError:  # pragma: no cover - nvidia-ml-py is a dependency
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        try:
            packed = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        except (pynvml.NVMLError, AttributeError):
            packed = pynvml.nvmlSystemGetCudaDriverVersion()
        return Driver(_decode(pynvml.nvmlSystemGetDriverVersion()), (packed // 1000, (packed % 1000) // 10))
    except pynvml.NVMLError as e:
        log.warning("NVML did not say the driver's CUDA version (%s): profiles' gpu.cuda is not checked", e)
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def cuda_refusal(profile, driver: Driver | None) -> str | None:
    """Why ``profile`` cannot run on this machine's driver (its ``gpu.cuda``), in plain words; None
    when it can, when the profile says nothing, or without a driver (virtual GPUs)."""
    need = profile.gpu.cuda_needed if profile.gpu else None
    if need is None or driver is None or driver.cuda >= need:
        return None
    return (
        f"{profile.display_name} needs CUDA {profile.gpu.cuda}, but this machine's NVIDIA driver "
        f"{driver.version} supports CUDA {driver.cuda_text} at most: its GPU code would fail to start. "
        f"Choose another profile, or ask an admin to update the driver."
    )


def build_inventory(policy: Policy, nvml: list[NvmlDevice]) -> list[Device]:
    """Assign real devices to flavors (explicit list, then name match), or make virtual ones."""
    if not nvml:
        devices, n = [], 0
        for flavor in policy.flavors:
            what = f"{flavor.mig.profile} slice" if flavor.mig else (flavor.display_name or flavor.name)
            for _ in range(flavor.local.virtual):
                # A virtual GPU (or MIG slice) maps to nvidia<n>: present only as a stand-in node in tests.
                devices.append(Device(str(n), flavor.name, f"virtual {what}", True, (f"nvidia{n}",)))
                n += 1
        return devices
    taken: set[str] = set()
    devices = []
    for flavor in policy.flavors:
        rules = flavor.local
        for d in nvml:
            if d.uuid in taken:
                continue
            # A MIG flavor takes only slices of its shape; any other flavor only whole GPUs.
            if (flavor.mig.profile if flavor.mig else None) != d.mig_profile:
                continue
            if rules.devices is not None:
                ok = d.index in rules.devices or d.uuid in rules.devices or (d.parent and d.parent in rules.devices)
            elif rules.match is not None:
                ok = rules.match.lower() in (d.parent_name or d.name).lower()
            else:
                ok = len(policy.flavors) == 1
            if ok:
                taken.add(d.uuid)
                devices.append(Device(d.uuid, flavor.name, d.name, False, d.nodes or (f"nvidia{d.index}",)))
    for d in nvml:
        if d.uuid not in taken:
            log.warning(
                "%s %s (%s, %s) matches no flavor in the policy and will not be handed out",
                "MIG slice of GPU" if d.mig_profile else "GPU",
                d.index,
                d.name,
                d.uuid,
            )
    return devices


def current_mig_on(pynvml, handle) -> bool:
    try:
        return pynvml.nvmlDeviceGetMigMode(handle)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
    except Exception:
        return False


def capacity_by_flavor(policy: Policy, nvml: list[NvmlDevice]) -> dict[str, int]:
    """GPUs of each flavor this machine hands out, for the flavors meant for it (a local
    rule, or devices found); flavors only for Kubernetes are left out (policy/checks.py)."""
    counts: dict[str, int] = {}
    for d in build_inventory(policy, nvml):
        counts[d.flavor] = counts.get(d.flavor, 0) + 1
    for flavor in policy.flavors:
        rules = flavor.local
        if rules.virtual or rules.match is not None or rules.devices is not None:
            counts.setdefault(flavor.name, 0)
    return counts


class DeviceTable:
    """Which device is held by which server; the only place devices are handed out."""

    DRIVER_TTL = 300.0  # a driver changes with a reboot or a module reload; read it again now and then

    def __init__(
        self,
        policy: Callable[[], Policy],
        discover: Callable[[], list[NvmlDevice]] = discover_nvml,
        driver: Callable[[], Driver | None] = read_driver,
    ):
        self._policy = policy
        self.discover = discover
        self._read_driver = driver
        self._driver: tuple[float, Driver | None] | None = None
        self._nvml = discover()
        self.devices: list[Device] = build_inventory(policy(), self._nvml)
        self.owner: dict[str, str] = {}  # device id -> server key
        # Health of each device (local/gpu_health.py feeds it): a bad or drained one is never handed out.
        self.health = HealthBook()
        log.info(
            "GPU inventory: %s",
            ", ".join(f"{d.id}={d.flavor}{' (virtual)' if d.virtual else ''}" for d in self.devices) or "none",
        )

    def driver(self) -> Driver | None:
        """The NVIDIA driver (cached ``DRIVER_TTL`` seconds); None without NVML."""
        now = time.monotonic()
        if self._driver is None or now - self._driver[0] > self.DRIVER_TTL:
            self._driver = (now, self._read_driver())
        return self._driver[1]

    @property
    def nvml(self) -> list[NvmlDevice]:
        """The devices NVML found at start (empty: the policy's virtual GPUs stand in)."""
        return list(self._nvml)

    def reload(self, policy: Policy) -> None:
        """Re-match devices to flavors after a policy change; holders keep their devices."""
        self.devices = build_inventory(policy, self._nvml)

    def apply_layout(self, nvml: list[NvmlDevice]) -> bool:
        """A fresh NVML discovery (a MIG layout changed while the hub runs): slices that appeared
        can be handed out, slices that are gone are never handed out again. A holder keeps what it
        holds until it releases it (``owner`` is untouched), so nothing is ever given twice.
        True when the layout changed."""
        if not nvml and self._nvml:
            return False  # NVML did not answer this time: keep what we know, never fall back to virtual
        before = {d.uuid for d in self._nvml}
        after = {d.uuid for d in nvml}
        if before == after:
            return False
        old = {d.uuid: d for d in self._nvml}
        self._nvml = list(nvml)
        self.devices = build_inventory(self._policy(), self._nvml)
        self._inherit_parent_health(old, [d for d in self._nvml if d.uuid not in before])
        gone = sorted(before - after)
        held = [f"{d} (held by {self.owner[d]} until it stops)" for d in gone if d in self.owner]
        log.warning(
            "GPU layout changed: %d new (%s), %d gone (%s)%s",
            len(after - before),
            ", ".join(sorted(after - before)) or "none",
            len(gone),
            ", ".join(gone) or "none",
            f"; {', '.join(held)}" if held else "",
        )
        return True

    def _inherit_parent_health(self, old: dict[str, NvmlDevice], new: list[NvmlDevice]) -> None:
        """A slice made on a GPU whose slices were marked by an event (an XID, a DBE) carries the
        same marks: the event was the parent's, and a new layout does not heal it (only ``gpuhub gpu
        uncordon`` does). A GPU whose every slice was drained has its new slices drained too."""
        for d in new:
            if not d.parent:
                continue
            known = [self.health.devices.get(o.uuid) for o in old.values() if o.parent == d.parent]
            siblings = [h for h in known if h is not None]
            marks = {(m.state, m.reason, m.at, m.xid): m for h in siblings for m in h.marks}
            if marks:
                entry = self.health._entry(d.uuid)
                entry.marks = sorted(marks.values(), key=lambda m: m.at)[-20:]
                entry._recompute(time.time())
                log.warning("New MIG slice %s of GPU %s is %s like its siblings: %s", d.uuid, d.parent, entry.state, entry.reason)
            drained = [h.drained for h in siblings if h.drained]  # by whom
            if siblings and len(drained) == len([o for o in old.values() if o.parent == d.parent]):
                self.health.drain(d.uuid, drained[0])

    def _of(self, flavor: str) -> list[Device]:
        return [d for d in self.devices if d.flavor == flavor]

    def free_devices(self, flavor: str) -> list[Device]:
        """Devices of ``flavor`` nobody holds that may be handed out (not bad, not drained)."""
        return [d for d in self._of(flavor) if d.id not in self.owner and self.health.usable(d.id)]

    def out_of_service(self, flavor: str) -> list[Device]:
        return [d for d in self._of(flavor) if not self.health.usable(d.id)]

    def out_of_service_words(self, flavor: str) -> str:
        """'1 out of service since 10:42 (XID 79: GPU has fallen off the bus)', '1 out of service (drained
        by admin since 10:42)'; '' when none."""
        out = self.out_of_service(flavor)
        if not out:
            return ""
        first = min((self.health.of(d.id) for d in out), key=lambda h: h.since or h.drained_at or 0)
        detail = first.summary()
        # 'since 10:42 (XID 79: ...)' for a bad one; '(drained by admin since 10:42)' for a drained one
        detail = detail[len("out of service ") :] if detail.startswith("out of service ") else f"({detail})"
        more = f"; {len(out) - 1} more" if len(out) > 1 else ""
        return f"{len(out)} out of service {detail}{more}"

    def nodes_for(self, ids: list[str]) -> list[str]:
        """Device nodes for the given device ids: theirs plus the control nodes, none for none."""
        wanted = [d for d in self.devices if d.id in set(ids)]
        if not wanted:
            return []
        nodes = [n for d in wanted for n in d.nodes]
        return sorted(set(nodes)) + list(CONTROL_NODES)

    def held_by(self, key: str) -> list[str]:
        return [dev for dev, owner in self.owner.items() if owner == key]

    # -- the Allocator protocol of the admission queue -----------------------------------
    def allocate(self, key: str, demand: Demand) -> list[str] | None:
        chosen: list[str] = []
        for res, count in demand.items():
            if not res.startswith("gpu/") or count <= 0:
                continue
            free = self.free_devices(res[4:])
            if len(free) < count:
                return None
            chosen.extend(d.id for d in free[:count])
        for dev in chosen:
            self.owner[dev] = key
        return chosen

    def free(self, key: str) -> None:
        for dev in self.held_by(key):
            del self.owner[dev]

    def restore(self, key: str, devices: list[str]) -> None:
        clash = [d for d in devices if self.owner.get(d, key) != key]
        if clash:
            raise ValueError(f"devices {clash} of {key} are already held by {[self.owner[d] for d in clash]}")
        for dev in devices:
            self.owner[dev] = key

    def shortage(self, demand: Demand) -> str | None:
        policy = self._policy()
        for res, count in demand.items():
            if res.startswith("gpu/") and len(self.free_devices(res[4:])) < count:
                flavor = res[4:]
                total = len(self._of(flavor))
                free = len(self.free_devices(flavor))
                out = self.out_of_service_words(flavor)
                if not out:
                    return f"needs {describe(res, count, policy)}: only {free} of the {total} on this machine are free"
                usable = total - len(self.out_of_service(flavor))
                try:
                    name = policy.flavor(flavor).display_name or flavor
                except StopIteration:
                    name = flavor
                return (
                    f"needs {describe(res, count, policy)}: only {free} of the {usable} usable on this machine "
                    f"are free ({usable} of {total} {name} usable, {out})"
                )
        return None

    def never_fits(self, demand: Demand) -> str | None:
        policy = self._policy()
        for res, count in demand.items():
            if res.startswith("gpu/") and len(self._of(res[4:])) < count:
                return (
                    f"{describe(res, count, policy)} requested but this machine has only "
                    f"{describe(res, len(self._of(res[4:])), policy)}."
                )
        return None
