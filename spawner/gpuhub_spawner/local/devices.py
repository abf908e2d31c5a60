"""GPU inventory and the device table of one machine.

Devices come from NVML (nvidia-ml-py) when a driver is present, MIG slices included,
and are matched to flavors by the policy's ``local`` rules. Where NVML finds nothing
(a laptop, CI) each flavor's ``local.virtual`` count of virtual GPUs stands in, so
everything but CUDA itself can be tried. The table guarantees that no device is ever
handed to two servers at once, and re-registers holders after a hub restart.
"""

from __future__ import annotations

import logging
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


def discover_nvml() -> list[NvmlDevice]:
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
                        migs.append(
                            NvmlDevice(
                                i,
                                _decode(pynvml.nvmlDeviceGetUUID(mh)),
                                _decode(pynvml.nvmlDeviceGetName(mh)),
                                pynvml.nvmlDeviceGetMemoryInfo(mh).total,
                                (f"nvidia{minor}", *_mig_cap_nodes(pynvml, mh, minor)),
                            )
                        )
            except pynvml.NVMLError:
                pass  # MIG not supported on this GPU
            if migs:
                found.extend(migs)
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


def build_inventory(policy: Policy, nvml: list[NvmlDevice]) -> list[Device]:
    """Assign real devices to flavors (explicit list, then name match), or make virtual ones."""
    if not nvml:
        devices, n = [], 0
        for flavor in policy.flavors:
            for _ in range(flavor.local.virtual):
                # A virtual GPU maps to nvidia<n>: present only as a stand-in node in tests.
                devices.append(Device(str(n), flavor.name, f"virtual {flavor.display_name or flavor.name}", True, (f"nvidia{n}",)))
                n += 1
        return devices
    taken: set[str] = set()
    devices = []
    for flavor in policy.flavors:
        rules = flavor.local
        for d in nvml:
            if d.uuid in taken:
                continue
            if rules.devices is not None:
                ok = d.index in rules.devices or d.uuid in rules.devices
            elif rules.match is not None:
                ok = rules.match.lower() in d.name.lower()
            else:
                ok = len(policy.flavors) == 1
            if ok:
                taken.add(d.uuid)
                devices.append(Device(d.uuid, flavor.name, d.name, False, d.nodes or (f"nvidia{d.index}",)))
    for d in nvml:
        if d.uuid not in taken:
            log.warning("GPU %s (%s, %s) matches no flavor in the policy and will not be handed out", d.index, d.name, d.uuid)
    return devices


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

    def __init__(self, policy: Callable[[], Policy], discover: Callable[[], list[NvmlDevice]] = discover_nvml):
        self._policy = policy
        self._nvml = discover()
        self.devices: list[Device] = build_inventory(policy(), self._nvml)
        self.owner: dict[str, str] = {}  # device id -> server key
        # Health of each device (local/gpu_health.py feeds it): a bad or drained one is never handed out.
        self.health = HealthBook()
        log.info(
            "GPU inventory: %s",
            ", ".join(f"{d.id}={d.flavor}{' (virtual)' if d.virtual else ''}" for d in self.devices) or "none",
        )

    @property
    def nvml(self) -> list[NvmlDevice]:
        """The devices NVML found at start (empty: the policy's virtual GPUs stand in)."""
        return list(self._nvml)

    def reload(self, policy: Policy) -> None:
        """Re-match devices to flavors after a policy change; holders keep their devices."""
        self.devices = build_inventory(policy, self._nvml)

    def _of(self, flavor: str) -> list[Device]:
        return [d for d in self.devices if d.flavor == flavor]

    def free_devices(self, flavor: str) -> list[Device]:
        """Devices of ``flavor`` nobody holds that may be handed out (not bad, not drained)."""
        return [d for d in self._of(flavor) if d.id not in self.owner and self.health.usable(d.id)]

    def out_of_service(self, flavor: str) -> list[Device]:
        return [d for d in self._of(flavor) if not self.health.usable(d.id)]

    def out_of_service_words(self, flavor: str) -> str:
        """'1 out of service since 10:42 (XID 79: GPU has fallen off the bus)'; '' when none."""
        out = self.out_of_service(flavor)
        if not out:
            return ""
        first = min((self.health.of(d.id) for d in out), key=lambda h: h.since or h.drained_at or 0)
        detail = first.summary()
        detail = detail[len("out of service "):] if detail.startswith("out of service ") else detail
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
                return (f"needs {describe(res, count, policy)}: only {free} of the {usable} usable on this machine "
                        f"are free ({usable} of {total} {name} usable, {out})")
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
