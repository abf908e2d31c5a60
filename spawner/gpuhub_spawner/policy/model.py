"""The policy file's schema: one declarative model for hub, Kueue and culler.

Vocabulary follows Kueue (flavors, nominal quota, cohorts, borrowing and lending
limits, priority classes) so the same file renders into Kueue objects on a cluster
and drives the in-hub admission queue on one machine. Field names are camelCase in
YAML; unknown keys are errors (``extra="forbid"``) so typos never pass silently.
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import Annotated, Any, Literal, TypeVar, cast

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError
from pydantic.alias_generators import to_camel

from .bounded import PROFILE_ENV_INSTEAD, unsafe_env_reason  # LD_*, GCONV_PATH, ...
from .quantities import parse_cpu_millis, parse_duration, parse_memory_bytes

# Names become Kubernetes object names (ClusterQueue, ResourceFlavor, ...): DNS-1123 labels.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _dns_label(value: Any) -> Any:
    if isinstance(value, str) and (len(value) > 63 or not _DNS_LABEL.match(value)):
        raise ValueError(
            f"{value!r} is not a valid name: use lowercase letters, digits and '-', "
            "starting and ending with a letter or digit, at most 63 characters"
        )
    return value


def _quantity(parser):
    # A policy writes the same few quantities thousands of times ("4", "16Gi", "1h"): each
    # distinct string is parsed once (a mistake is not kept: it raises every time).
    parsed: dict[str, Any] = {}

    def parse(value: Any) -> Any:
        if value is None:
            return None
        if type(value) is not str:
            return parser(value)
        result = parsed.get(value)
        if result is None:
            if len(parsed) >= 1024:
                parsed.clear()
            result = parsed[value] = parser(value)
        return result

    return BeforeValidator(parse)


Name = Annotated[str, BeforeValidator(_dns_label)]
CpuMillis = Annotated[int, _quantity(parse_cpu_millis)]
MemoryBytes = Annotated[int, _quantity(parse_memory_bytes)]
Seconds = Annotated[float, _quantity(parse_duration)]
GpuCount = Annotated[StrictInt, Field(ge=0)]
# Tasks (processes and threads: the kernel's pids controller counts both) one server or
# job may hold. A server with a kernel needs ~40; below 64 it could not work at all.
MIN_MAX_PROCESSES = 64
DEFAULT_MAX_PROCESSES = 4096  # as OpenShift's default pod pids limit
# All of one user's servers, jobs and Ray clusters together (one machine): two servers'
# worth by default, so no user's many jobs hold the machine's pid space (issue 39: 14 CPU
# jobs of one user were allowed 57,344 tasks against a pid_max of 32,768).
DEFAULT_MAX_PROCESSES_PER_USER = 8192
ProcessCount = Annotated[StrictInt, Field(ge=MIN_MAX_PROCESSES)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)


class Toleration(_Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


class LocalDevices(_Model):
    """How the one-machine backend finds this flavor's devices."""

    match: str | None = None  # substring of the NVML device name, e.g. "A100"
    devices: list[int | str] | None = None  # explicit indices or UUIDs
    virtual: GpuCount = 0  # virtual GPUs to declare when NVML finds no device


class MigSlice(_Model):
    """A flavor of MIG slices of one shape (docs/mig.md): NVIDIA's profile name, and how the
    cluster's device plugin advertises it (``mixed``: ``nvidia.com/mig-<profile>``;
    ``single``: ``nvidia.com/gpu`` on nodes labelled ``nvidia.com/gpu.product=...-MIG-<profile>``)."""

    profile: str  # e.g. 1g.10gb, 2g.20gb, 3g.40gb, 7g.80gb, 1g.10gb+me (nvidia-smi mig -lgip)
    strategy: Literal["mixed", "single"] = "mixed"

    @field_validator("profile")
    @classmethod
    def _profile_name(cls, value: str) -> str:
        if not re.match(r"^([1-7]c\.)?[1-7]g\.[0-9]+gb(\+me)?$", value):
            raise ValueError(
                f"{value!r} is not a MIG profile name: NVIDIA writes <slices>g.<memory>gb, "
                "e.g. 1g.10gb, 2g.20gb, 3g.40gb, 7g.80gb (see nvidia-smi mig -lgip)"
            )
        return value

    @property
    def memory(self) -> int:
        """Bytes of GPU memory a slice of this shape counts in a team's ``gpuMemory`` quota: the
        number its name gives (1g.10gb: 10Gi), the arithmetic Kueue's resource transformation
        applies on Kubernetes (``gpuhub render kueue-config``), so both modes agree."""
        found = re.search(r"g\.([0-9]+)gb", self.profile)
        assert found is not None, self.profile  # _profile_name let only <slices>g.<memory>gb names in
        return int(found.group(1)) * 2**30


def _mig_resource(value: Any) -> Any:
    """A MIG flavor's device resource follows its strategy unless written out."""
    if isinstance(value, dict) and isinstance(value.get("mig"), dict) and "resource" not in value:
        mig = value["mig"]
        single = mig.get("strategy") == "single"
        value = {**value, "resource": "nvidia.com/gpu" if single else f"nvidia.com/mig-{mig.get('profile')}"}
    return value


# A node label key as Kubernetes (and Kueue's Topology CRD) accepts it: an optional DNS prefix, a name.
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)
HOSTNAME_LABEL = "kubernetes.io/hostname"


def _label_key(value: Any) -> Any:
    if isinstance(value, str) and (len(value) > 316 or not _LABEL_KEY.match(value)):
        raise ValueError(f"{value[:100]!r} is not a node label key (like topology.kubernetes.io/zone)")
    return value


class Topology(_Model):
    """How the operator labelled the nodes' physical layout, broadest level first (Kueue's
    topology-aware scheduling, TAS): Kueue places a several-worker job's pods inside one domain
    of a level (one rack, one block) when the flavor's ``topology`` asks for it. Rendered as a
    Kueue ``Topology`` only when named by a flavor's ``topology``; levels follow Kueue's rules
    (1-16, unique, ``kubernetes.io/hostname`` only as the last)."""

    name: Name
    levels: Annotated[list[Annotated[str, BeforeValidator(_label_key)]], Field(min_length=1, max_length=16)]

    @field_validator("levels")
    @classmethod
    def _levels(cls, value: list[str]) -> list[str]:
        dup = sorted({v for v in value if value.count(v) > 1})
        if dup:
            raise ValueError(f"each level once ({', '.join(dup)} repeated)")
        if HOSTNAME_LABEL in value[:-1]:
            raise ValueError(f"{HOSTNAME_LABEL} can only be the last (lowest) level")
        return value


class FlavorTopology(_Model):
    """A flavor's placement of a job's workers: all inside one domain of ``level`` of the
    topology ``name``; ``required`` (Kueue's ``podset-required-topology``: the job waits until
    one domain fits all workers) or ``preferred`` (``podset-preferred-topology``: as close as
    Kueue can, spread wider when no single domain fits)."""

    name: Name
    level: Annotated[str, BeforeValidator(_label_key)]
    mode: Literal["preferred", "required"] = "preferred"


class Flavor(_Model):
    name: Name
    resource: str = "nvidia.com/gpu"
    display_name: str | None = None
    node_labels: dict[str, str] = {}
    tolerations: list[Toleration] = []
    local: LocalDevices = LocalDevices()
    mig: MigSlice | None = None  # a slice of a MIG-enabled GPU instead of a whole GPU
    topology: FlavorTopology | None = None  # Kubernetes: where a job's workers go (Kueue TAS)

    @model_validator(mode="before")
    @classmethod
    def _derive_resource(cls, value: Any) -> Any:
        return _mig_resource(value)

    @property
    def unit(self) -> str:
        """What one of this flavor is called: 'GPU', or '1g.10gb slice'."""
        return f"{self.mig.profile} slice" if self.mig else "GPU"


class PriorityClass(_Model):
    name: Name
    value: StrictInt
    description: str = ""


def _shorthand_nominal(value: Any) -> Any:
    """``cpu: 32`` is short for ``cpu: {nominal: 32}``."""
    return value if isinstance(value, dict) or value is None else {"nominal": value}


class GpuQuota(_Model):
    nominal: GpuCount
    borrowing_limit: GpuCount | None = None
    lending_limit: GpuCount | None = None


class CpuQuota(_Model):
    nominal: CpuMillis
    borrowing_limit: CpuMillis | None = None
    lending_limit: CpuMillis | None = None


class MemoryQuota(_Model):
    nominal: MemoryBytes
    borrowing_limit: MemoryBytes | None = None
    lending_limit: MemoryBytes | None = None


class GpuMemoryQuota(_Model):
    """A team's quota for MIG slices of several shapes, in GPU memory (docs/mig.md): a slice of
    a flavor in ``flavors`` counts the memory its shape names (1g.10gb: 10Gi, 3g.40gb: 40Gi)
    instead of one slice of its flavor, as Kueue's resource transformations count it."""

    nominal: MemoryBytes
    borrowing_limit: MemoryBytes | None = None
    lending_limit: MemoryBytes | None = None
    flavors: list[str] = Field(min_length=1)  # MIG flavors (mixed strategy) counted in memory


class TeamQuota(_Model):
    cpu: Annotated[CpuQuota | None, BeforeValidator(_shorthand_nominal)] = None
    memory: Annotated[MemoryQuota | None, BeforeValidator(_shorthand_nominal)] = None
    gpus: dict[str, Annotated[GpuQuota, BeforeValidator(_shorthand_nominal)]] = {}
    gpu_memory: GpuMemoryQuota | None = None  # gpuMemory: MIG slices of mixed shapes, in memory


def _over(own: _M, base: _M) -> _M:
    """``own``'s values, with those it leaves unset (None) taken from ``base`` (same model).

    Both are validated already, so the merge is not validated again (``model_construct``): a
    500-team policy merges 2,000 profiles' idle rules at each load. ``own`` with nothing
    set is ``base`` itself (frozen, so sharing it is safe)."""
    cls = type(own)
    values, fallback = own.__dict__, base.__dict__
    if type(base) is cls and all(values[name] is None for name in cls.model_fields):
        return base
    merged = cls.model_construct(**{name: fallback[name] if values[name] is None else values[name] for name in cls.model_fields})
    # pydantic's mypy plugin types model_construct as returning the model that declares the
    # fields (here _Model's subclass as written), not the class it is called on: it is type(own).
    return cast(_M, merged)


_M = TypeVar("_M", bound=_Model)


class ReclaimRules(_Model):
    """Taking lent quota back (admission/reclaim.py); unset keys come from ``defaults.reclaim``.

    ``enabled`` and ``notice`` are the *lender's*: whether its lent quota comes back when
    it needs it, and the most it then waits (a borrowing server's warning; jobs stop at
    once). ``interactiveBorrowing`` is the *borrower's*: whether its servers may borrow.
    """

    enabled: bool | None = None
    notice: Seconds | None = None
    interactive_borrowing: bool | None = None

    def over(self, base: "ReclaimRules") -> "ReclaimRules":
        return _over(self, base)


# A team gets lent quota back within ``notice`` (10 min, enough to save a notebook; at most
# half of queueTimeout when no notice is written); servers may borrow; reclaim applies.
RECLAIM_NOTICE = 600.0
RECLAIM_DEFAULTS = ReclaimRules(enabled=True, notice=RECLAIM_NOTICE, interactive_borrowing=True)


class PerUser(_Model):
    max_servers: GpuCount | None = None
    max_gpus: GpuCount | None = Field(None, alias="maxGPUs")


# A team's share of contested capacity (fair share, docs/fair-share.md). Kueue's
# ``fairSharing.weight``: 0 means "always last", otherwise above 10^-9.
Weight = Annotated[float, Field(ge=0, le=1_000_000)]


class Team(_Model):
    name: Name
    display_name: str | None = None
    groups: list[str] = Field(min_length=1)
    cohort: Name | None = None
    queue: Name | None = None  # LocalQueue name; defaults to the team name
    default_priority: str | None = None
    # Priority class of the team's batch jobs (gpuhub job); default: as its servers.
    job_priority: str | None = None
    # Kueue's queueing strategies: BestEffortFIFO lets a later, smaller request pass a
    # blocked head; StrictFIFO makes the team's head of queue block the rest.
    queueing_strategy: Literal["BestEffortFIFO", "StrictFIFO"] = "BestEffortFIFO"
    quota: TeamQuota = TeamQuota()
    per_user: PerUser = PerUser()
    # Identity-provider groups whose members lead this team: they see its holders, queue
    # and history and may stop its members' idle servers (hub/roles.py).
    leads: list[str] = []
    reclaim: ReclaimRules = ReclaimRules()
    # Share of contested capacity against the other teams (only with a ``fairShare`` section).
    weight: Weight = 1.0

    @field_validator("weight")
    @classmethod
    def _weight(cls, value: float) -> float:
        if 0 < value < 1e-9:
            raise ValueError(f"a weight is 0 (always last) or at least 1e-9 (got {value!r}), as Kueue requires")
        return value

    @property
    def local_queue(self) -> str:
        return self.queue or self.name

    @property
    def label(self) -> str:
        return self.display_name or self.name


class IdleRules(_Model):
    """Culling rules; every field optional so profiles override defaults key by key."""

    timeout: Seconds | None = None  # no kernel/terminal activity for this long
    gpu_idle_timeout: Seconds | None = None  # own GPUs below threshold for this long
    gpu_busy_threshold: Annotated[int, Field(ge=0, le=100)] | None = None  # percent
    max_age: Seconds | None = None
    warning: Seconds | None = None
    snooze: Seconds | None = None
    max_snoozes: GpuCount | None = None
    # A GPU with no utilisation reading (a MIG slice NVML does not measure, a virtual GPU):
    # ``idle`` counts it idle (gpuIdleTimeout applies); ``activity``: only the activity rules.
    gpu_unread: Literal["idle", "activity"] | None = None

    def over(self, base: "IdleRules") -> "IdleRules":
        """These rules with unset keys taken from ``base``."""
        return _over(self, base)

    def problems(self, has_gpus: bool = True) -> list[tuple[tuple[str, ...], str]]:
        """Combinations that cannot work, as ``(fields involved, message)``.

        The warning is the user's chance to come back before a stop, so it must be
        shorter than every idle period it follows; snoozes need a length; a busy
        threshold of 0 % would call every GPU busy forever.
        """
        from .quantities import format_duration as fmt

        out: list[tuple[tuple[str, ...], str]] = []
        w = self.warning or 0
        for name, label in (("timeout", "timeout"), ("gpu_idle_timeout", "gpuIdleTimeout"), ("max_age", "maxAge")):
            limit = getattr(self, name)
            if name == "gpu_idle_timeout" and not has_gpus:
                continue
            if limit and w >= limit:
                out.append(
                    (
                        ("warning", name),
                        f"warning ({fmt(w)}) must be shorter than {label} ({fmt(limit)}): "
                        "a user could never come back in time to keep the server",
                    )
                )
        if (self.max_snoozes or 0) > 0 and not self.snooze:
            out.append((("max_snoozes", "snooze"), f"maxSnoozes is {self.max_snoozes} but no snooze length is set"))
        if has_gpus and self.gpu_idle_timeout and self.gpu_busy_threshold == 0:
            out.append(
                (("gpu_busy_threshold",), "gpuBusyThreshold 0 counts every GPU as busy, so gpuIdleTimeout could never apply")
            )
        return out


def _cuda_version(value: Any) -> Any:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        raise ValueError(f'write the CUDA version quoted, "{value}": YAML reads 12.10 as the number 12.1')
    if not isinstance(value, str) or not re.fullmatch(r"\d{1,3}\.\d{1,3}", value):
        raise ValueError(f'{value!r}: a CUDA version as "MAJOR.MINOR", e.g. "12.4"')
    return value


CudaVersion = Annotated[str, BeforeValidator(_cuda_version)]


class GpuRequest(_Model):
    count: GpuCount
    flavor: str
    # The CUDA version the profile's software needs (its image's CUDA, e.g. "12.4"): the GPUs'
    # driver must support at least that version, or CUDA fails inside the server. One machine:
    # checked against NVML's driver before the request queues, refused in plain words;
    # Kubernetes: the pod may only go to nodes whose driver supports it (GPU feature discovery's
    # nvidia.com/cuda.runtime-version labels). Unset: not checked.
    cuda: CudaVersion | None = None

    @property
    def cuda_needed(self) -> tuple[int, int] | None:
        if self.cuda is None:
            return None
        major, minor = self.cuda.split(".")
        return int(major), int(minor)


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _all_teams(value: Any) -> Any:
    return ["*"] if value == "*" else value


class Profile(_Model):
    slug: Name
    display_name: str
    description: str = ""
    image: str | None = None
    cpu: CpuMillis | None = None
    memory: MemoryBytes | None = None
    max_processes: ProcessCount | None = None  # pids.max of each server/job cgroup
    gpu: GpuRequest | None = None
    teams: Annotated[list[str], BeforeValidator(_all_teams)]
    priority: str | None = None
    idle: IdleRules = IdleRules()
    env: dict[str, str] = {}
    default: bool = False

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for key in env:
            if not _ENV_NAME.match(key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
            if reason := unsafe_env_reason(key, PROFILE_ENV_INSTEAD):
                raise ValueError(reason)
        return env

    @property
    def gpu_count(self) -> int:
        return self.gpu.count if self.gpu else 0

    def usable_by(self, team: str) -> bool:
        return "*" in self.teams or team in self.teams


class Defaults(_Model):
    image: str = "quay.io/jupyter/minimal-notebook:2025-10-20"
    cpu: CpuMillis = 1000
    memory: MemoryBytes = 2 * 2**30
    max_processes: ProcessCount = DEFAULT_MAX_PROCESSES
    max_processes_per_user: ProcessCount = DEFAULT_MAX_PROCESSES_PER_USER
    priority: str | None = None
    queue_timeout: Seconds = 3600.0  # how long a server may wait in the queue
    launch_timeout: Seconds = 300.0  # start timeout once admitted
    idle: IdleRules = IdleRules(
        timeout=3600.0 * 8,
        gpu_idle_timeout=3600.0,
        gpu_busy_threshold=5,
        max_age=3600.0 * 24 * 7,
        warning=900.0,
        snooze=3600.0,
        max_snoozes=2,
    )
    reclaim: ReclaimRules = ReclaimRules()  # keys unset here: RECLAIM_DEFAULTS


DEFAULT_HALF_LIFE = 24 * 3600.0  # yesterday counts half, last week under 1 %


class FairShare(_Model):
    """``fairShare:``: who used the GPUs lately decides who gets the next one (docs/fair-share.md).

    Usage is GPU-seconds *held* (admitted), by flavor, times ``flavorWeights`` (default 1),
    decayed with ``halfLife``. Idle time counts: a held GPU is denied to everyone else whether
    it computes or not (the culler is what gives idle GPUs back), and Kueue counts admitted
    requests the same way, so both modes agree. Absent section: today's order (priority, then
    arrival), team weights unused.
    """

    enabled: bool = True
    half_life: Seconds = DEFAULT_HALF_LIFE
    flavor_weights: dict[str, Annotated[float, Field(ge=0, le=1000)]] = {}
    # Inside a team, the user with less recent use goes first (Kueue: a LocalQueue per user
    # in the team's ClusterQueue with Admission Fair Sharing); off: arrival order in the team.
    users: bool = False
    # A borrower runs at least this long before its GPUs are reclaimed or it is preempted
    # (Slurm's PreemptExemptTime; Kueue KEP-9876, not in v0.19.2). 0: at once, as today.
    min_runtime: Seconds = 0.0

    @field_validator("half_life")
    @classmethod
    def _half_life(cls, value: float) -> float:
        if not 60.0 <= value <= 365 * 86400.0:
            raise ValueError(f"must be between 1m and 365d (got {value:g}s)")
        return value

    @field_validator("min_runtime")
    @classmethod
    def _min_runtime(cls, value: float) -> float:
        if value < 0:
            raise ValueError("cannot be negative")
        return value

    def flavor_weight(self, flavor: str) -> float:
        return self.flavor_weights.get(flavor, 1.0)


# NVIDIA's k8s-device-plugin (internal/rm/health.go) ignores these by default: errors of the
# application that ran, not of the GPU (graphics engine exception, GPU memory page fault,
# GPU stopped processing, preemptive cleanup, video processor exception, context switch timeout).
APPLICATION_XIDS = (13, 31, 43, 45, 68, 109)
Xid = Annotated[StrictInt, Field(ge=1)]


def _all_or_list(value: Any) -> Any:
    """``criticalXids: all`` (the device plugin's default) is kept as None."""
    if value == "all" or value is None:
        return None
    if isinstance(value, str):
        raise ValueError(f"must be 'all' or a list of XID numbers (got {value!r})")
    return value


class KubernetesHealth(_Model):
    """Kubernetes (docs/gpu-health.md): which ClusterQueue gives up quota for GPUs out of
    service, and which node taints take a node's GPUs out."""

    # flavor -> the team whose ClusterQueue's nominalQuota for that flavor is lowered by the
    # flavor's GPUs out of service (and restored when they are back). A flavor not named keeps
    # its quotas (its waiting messages still count what is out).
    capacity_queue: dict[str, str] = {}
    # A node with one of these taint keys (NoSchedule or NoExecute) has all its GPUs out of
    # service. List the keys your NVSentinel / node-problem-detector set (default one key).
    taints: list[Annotated[str, Field(min_length=1, max_length=316)]] = ["nvidia.com/gpu-error"]
    sync_interval: Seconds = 10.0

    @field_validator("sync_interval")
    @classmethod
    def _interval(cls, value: float) -> float:
        if not 1.0 <= value <= 3600.0:
            raise ValueError(f"must be between 1s and 1h (got {value:g}s)")
        return value


class HealthRules(_Model):
    """GPU health (docs/gpu-health.md): which XIDs leave a GPU in, which take it out, how often
    the error counters are read."""

    application_xids: list[Xid] = list(APPLICATION_XIDS)  # the GPU stays
    # None ("all"): every XID not in applicationXids takes the GPU out, as the device plugin
    # does by default. A list: only these do; any other XID marks the GPU suspect.
    critical_xids: Annotated[list[Xid] | None, BeforeValidator(_all_or_list)] = None
    poll_interval: Seconds = 30.0  # ECC, row remapping, retired pages, recovery action
    kubernetes: KubernetesHealth = KubernetesHealth()

    @field_validator("poll_interval")
    @classmethod
    def _interval(cls, value: float) -> float:
        if not 1.0 <= value <= 3600.0:
            raise ValueError(f"must be between 1s and 1h (got {value:g}s)")
        return value

    @model_validator(mode="after")
    def _lists_apart(self) -> "HealthRules":
        errors = []
        for field, values in (("applicationXids", self.application_xids), ("criticalXids", self.critical_xids or [])):
            seen = set()
            for i, xid in enumerate(values):
                if xid in seen:
                    errors.append(((field, i), f"XID {xid} is listed twice"))
                seen.add(xid)
        app = set(self.application_xids)
        for i, xid in enumerate(self.critical_xids or []):
            if xid in app:
                errors.append(
                    (
                        ("criticalXids", i),
                        f"XID {xid} is also in applicationXids: an XID either leaves the GPU in service or takes it out",
                    )
                )
        if errors:
            raise ValidationError.from_exception_data(
                "HealthRules",
                [
                    InitErrorDetails(type=PydanticCustomError("value_error", "{error}", {"error": m}), loc=loc, input=None)
                    for loc, m in errors
                ],
            )
        return self


class Roles(_Model):
    """Who sees what beyond their own servers, by identity-provider group (hub/roles.py).

    Researchers are simply team members; team leads are listed on each team (``leads``).
    """

    admins: list[str] = []  # everything: every holder, the queue, the audit trail, quotas
    viewers: list[str] = []  # usage and metrics only: no servers, files or artifacts


# Worker processes (one machine) or pods (Kubernetes) a cluster may have. A policy cap, not
# Kueue's: Kueue v0.19.2 takes up to 18 pod sets per workload (MaxPodSets), i.e. a head and 17
# worker groups (kube/ray_manifest.py enforces that); 7 keeps clusters a size the queue can place.
MAX_RAY_WORKERS = 7


class RayHeadResources(_Model):
    """What a Ray cluster's head asks for on Kubernetes (its own pod); on one machine the head
    and the workers share the cluster's cgroup, sized by the profile."""

    cpu: CpuMillis = 1000
    memory: MemoryBytes = 2 * 2**30


class RayRules(_Model):
    """``ray:``: may users start Ray clusters (``gpuhub ray up``), and how (docs/ray.md).

    A cluster asks for a profile's GPUs through the team's queue like a server; both
    backends read this section (``local.ray_manager``, ``kube.ray_*``).
    """

    enabled: bool = False
    stop_with_server: bool = True  # stop a user's clusters when their default server stops
    max_workers: Annotated[StrictInt, Field(ge=0, le=MAX_RAY_WORKERS)] = 4  # worker processes/pods besides the head
    autoscaling: bool = False  # Kubernetes only: Kueue's elastic-job annotation on the RayCluster
    image: str | None = None  # Kubernetes only: head and worker image (default: the profile's image)
    head_resources: RayHeadResources = RayHeadResources()


class OffboardingRules(_Model):
    """``offboarding:``: what ``gpuhub user offboard NAME`` does with a leaver's data
    (hub/offboarding.py, docs/runbooks/offboarding.md).

    ``home``: ``keep`` (default) leaves it where it is; ``archive`` packs it into a tar.gz in
    the hub's data directory that only admins (root) can read, then removes it. On Kubernetes
    the home's PVC is kept and labelled ``gpuhub.io/offboarded=true`` either way.
    ``mlflow``: ``lead`` hands the leaver's experiments to their team's lead, ``read-only``
    keeps them readable and unchanged.
    """

    home: Literal["keep", "archive"] = "keep"
    mlflow: Literal["lead", "read-only"] = "lead"


# Where a server or job finds what the policy grants it (both modes): files of granted secrets
# under SECRETS_DIR, each team dataset at DATA_DIR/<name>. /run: nothing of the user's lives
# there, and on one machine the sandbox mounts a private tmpfs over /run/gpuhub for them.
RUN_DIR = "/run/gpuhub"
SECRETS_DIR = RUN_DIR + "/secrets"
DATA_DIR = RUN_DIR + "/data"
# Kernels of the team environments a server is granted (``data[].kernel``): a Jupyter data
# directory (``JUPYTER_PATH``) holding ``kernels/<name>/kernel.json``.
JUPYTER_DIR = RUN_DIR + "/jupyter"
# A Kubernetes Secret's key (and so a local key): letters, digits, '-', '_' and '.'.
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]{1,253}$")
# Names the hub sets for every server: a granted secret must not replace them.
_RESERVED_ENV = re.compile(r"^(GPUHUB_|JUPYTERHUB_|JPY_|MLFLOW_RUN_CONTEXT$|CUDA_VISIBLE_DEVICES$|HOME$|PATH$|USER$)")


def _absolute_path(value: Any) -> Any:
    if isinstance(value, str):
        if not value.startswith("/") or "\0" in value or any(part in (".", "..") for part in value.split("/")):
            raise ValueError(f"{value!r}: an absolute path without '.' or '..' components")
        if len(value) > 4096:
            raise ValueError("longer than 4096 characters")
    return value


AbsolutePath = Annotated[str, BeforeValidator(_absolute_path)]


def _secret_key(value: Any) -> Any:
    if isinstance(value, str) and not _SECRET_KEY.match(value):
        raise ValueError(f"{value!r} is not a valid key: letters, digits, '-', '_' and '.' (as a Kubernetes Secret's keys)")
    return value


SecretKey = Annotated[str, BeforeValidator(_secret_key)]


class LocalSecretSource(_Model):
    """One machine: a YAML file the admin keeps outside the policy (root's, not writable by
    anyone else), a mapping of keys to values; ``key`` picks one. Read at each server's or
    job's start, so rewriting the file rotates the secret without a hub restart."""

    file: AbsolutePath
    key: SecretKey


class KubernetesSecretSource(_Model):
    """Kubernetes: a Secret in the users' namespace; ``key`` picks one of its data keys. The
    pod refers to it by name (kubelet mounts it); the hub never reads it."""

    secret: Name
    key: SecretKey


class SecretGrant(_Model):
    """``secrets:``: one secret, by reference, and who gets it (docs/secrets-and-data.md).

    A server or job gets it when its profile is in ``profiles`` and its team in ``teams``
    (an empty list: any), at least one of them written. Delivered as the file
    ``/run/gpuhub/secrets/<name>`` readable only by the user's processes, or with ``env``
    as that environment variable instead."""

    name: Name
    description: str = ""
    local: LocalSecretSource | None = None
    kubernetes: KubernetesSecretSource | None = None
    profiles: Annotated[list[str], BeforeValidator(_all_teams)] = []
    teams: Annotated[list[str], BeforeValidator(_all_teams)] = []
    env: str | None = None

    @field_validator("env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not _ENV_NAME.match(value):
            raise ValueError(f"{value!r} is not a valid environment variable name")
        if reason := unsafe_env_reason(value, "deliver it as a file instead (leave env out)"):
            raise ValueError(reason)
        if _RESERVED_ENV.match(value):
            raise ValueError(f"{value!r} is set by gpuhub for every server; choose another name")
        return value

    @model_validator(mode="after")
    def _complete(self) -> "SecretGrant":
        if self.local is None and self.kubernetes is None:
            raise ValueError("a secret needs a source: local (file + key) on one machine, kubernetes (secret + key) on a cluster")
        if not self.profiles and not self.teams:
            raise ValueError("grant it to profiles, teams or both (write '*' for all): a secret granted to nobody is a mistake")
        return self

    def granted(self, team: str, profile: str) -> bool:
        return ("*" in self.teams or not self.teams or team in self.teams) and (
            "*" in self.profiles or not self.profiles or profile in self.profiles
        )


class LocalDataSource(_Model):
    """One machine: a directory, bind-mounted into the team's servers and jobs by the sandbox.
    Keep it under a directory only root may enter (e.g. ``/srv/gpuhub-data``, mode 0700): the
    bind is the only way in, so another team's members cannot reach it."""

    path: AbsolutePath


class KubernetesDataSource(_Model):
    """Kubernetes: a PersistentVolumeClaim in the users' namespace (any CSI driver behind it)."""

    claim: Name
    sub_path: str | None = None


class TeamData(_Model):
    """``data:``: a dataset mounted at ``/run/gpuhub/data/<name>`` into the servers and jobs of
    the members of ``teams`` (read-only unless ``readOnly: false``; optionally only for some
    ``profiles``)."""

    name: Name
    description: str = ""
    teams: list[str] = Field(min_length=1)
    profiles: Annotated[list[str], BeforeValidator(_all_teams)] = []
    read_only: bool = True
    # A Python environment the admin pinned for the team (docs/own-packages.md): its servers list
    # a Jupyter kernel of this display name running ``<DATA_DIR>/<name>/bin/python`` (one machine).
    kernel: str | None = Field(default=None, min_length=1, max_length=100)
    local: LocalDataSource | None = None
    kubernetes: KubernetesDataSource | None = None

    @field_validator("kernel")
    @classmethod
    def _display_name(cls, value: str | None) -> str | None:
        if value is not None and any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
            raise ValueError("a kernel's display name is one line of text, without control characters")
        return value

    @model_validator(mode="after")
    def _complete(self) -> "TeamData":
        if self.local is None and self.kubernetes is None:
            raise ValueError("a dataset needs a source: local (path) on one machine, kubernetes (claim) on a cluster")
        if self.kernel is not None and not self.read_only:
            # Every member's kernel runs what is in it: one member must not change it for the rest.
            raise ValueError("a team environment (kernel) is mounted read-only: leave readOnly out")
        return self

    def granted(self, team: str, profile: str) -> bool:
        return (team in self.teams or "*" in self.teams) and (
            "*" in self.profiles or not self.profiles or profile in self.profiles
        )


TEAM_PLACEHOLDER = "{team}"


class Tenancy(_Model):
    """``tenancy:``: where a team's pods live on Kubernetes (docs/install-kubernetes.md,
    "Tenancy"); the one-machine backend ignores it.

    ``shared`` (default): every team's pods and LocalQueues in one users' namespace (the
    spawner's ``namespace``, ``gpuhub render --namespace``). ``team``: each team in a namespace
    of its own, ``namespace`` with ``{team}`` replaced by the team's name: its pods, its
    LocalQueue, its NetworkPolicies, the hub's Role there and the Pod Security label
    (``gpuhub render tenancy``). In the policy, not the spawner's config, because the hub and
    ``gpuhub render`` must agree on it: both read this file.
    """

    mode: Literal["shared", "team"] = "shared"
    namespace: str = "gpuhub-" + TEAM_PLACEHOLDER

    @field_validator("namespace")
    @classmethod
    def _template(cls, value: str) -> str:
        rest = value.replace(TEAM_PLACEHOLDER, "", 1)
        if value.count(TEAM_PLACEHOLDER) != 1 or "{" in rest or "}" in rest:
            raise ValueError(f"{value!r}: write the namespace with {TEAM_PLACEHOLDER} once, e.g. 'gpuhub-{{team}}'")
        probe = value.replace(TEAM_PLACEHOLDER, "a")
        if not _DNS_LABEL.match(probe):
            raise ValueError(
                f"{value!r}: a namespace is lowercase letters, digits and '-', starting and ending with a letter or digit"
            )
        return value

    def namespace_of(self, team: str, shared: str) -> str:
        """The namespace of ``team``'s pods: its own (``team``) or ``shared``."""
        return self.namespace.replace(TEAM_PLACEHOLDER, team) if self.mode == "team" else shared


class Policy(_Model):
    api_version: Literal["gpuhub/v1"] = "gpuhub/v1"
    flavors: list[Flavor] = []
    topologies: list[Topology] = []
    priority_classes: list[PriorityClass] = []
    teams: list[Team] = Field(min_length=1)
    profiles: list[Profile] = Field(min_length=1)
    defaults: Defaults = Defaults()
    roles: Roles = Roles()
    health: HealthRules = HealthRules()
    ray: RayRules = RayRules()
    fair_share: FairShare | None = None
    offboarding: OffboardingRules = OffboardingRules()
    tenancy: Tenancy = Tenancy()
    secrets: list[SecretGrant] = []
    data: list[TeamData] = []

    def secrets_for(self, team: str, profile: str) -> list[SecretGrant]:
        """The secrets a server or job of ``team`` on ``profile`` receives, in policy order."""
        return [s for s in self.secrets if s.granted(team, profile)]

    def data_for(self, team: str, profile: str) -> list[TeamData]:
        """The team datasets mounted into a server or job of ``team`` on ``profile``."""
        return [d for d in self.data if d.granted(team, profile)]

    @property
    def fair(self) -> FairShare | None:
        """The fair-share rules in force (None: off, today's priority-then-arrival order)."""
        fs = self.fair_share
        return fs if fs is not None and fs.enabled else None

    def share_of(self, team: Team) -> float:
        """``team``'s weight as a fraction of its cohort's (no cohort: of all teams without one)."""
        cache = self._share_cache
        if cache.get("\0teams") is not self.teams:  # a model_copy with other teams: not stale
            cache.clear()
            cache["\0teams"] = self.teams
            totals: dict[str | None, float] = {}
            for t in self.teams:
                totals[t.cohort] = totals.get(t.cohort, 0.0) + t.weight
            for t in self.teams:
                total = totals[t.cohort]
                cache.setdefault(t.name, t.weight / total if total else 0.0)
        return cache.get(team.name, 0.0)

    @cached_property
    def _share_cache(self) -> dict:
        return {}

    # -- look-ups used by both backends -------------------------------------------------
    def flavor(self, name: str) -> Flavor:
        return next(f for f in self.flavors if f.name == name)

    # Dict look-ups: a queue event asks for teams and cohorts per waiting request, and a
    # large policy has hundreds of teams. (Cached per frozen policy; first name wins.)
    @cached_property
    def _by_name(self) -> tuple[dict[str, Team], dict[str, Profile], dict[str, list[Team]]]:
        teams: dict[str, Team] = {}
        profiles: dict[str, Profile] = {}
        cohorts: dict[str, list[Team]] = {}
        for t in self.teams:
            teams.setdefault(t.name, t)
            if t.cohort:
                cohorts.setdefault(t.cohort, []).append(t)
        for p in self.profiles:
            profiles.setdefault(p.slug, p)
        return teams, profiles, cohorts

    def team(self, name: str) -> Team:
        try:
            return self._by_name[0][name]
        except KeyError:
            raise StopIteration(name) from None

    def team_or_none(self, name: str) -> Team | None:
        return self._by_name[0].get(name)

    def profile(self, slug: str) -> Profile | None:
        return self._by_name[1].get(slug)

    def priority_value(self, name: str | None) -> int:
        for pc in self.priority_classes:
            if pc.name == name:
                return pc.value
        return 0

    def priority_for(self, team: Team, profile: Profile) -> str | None:
        return profile.priority or team.default_priority or self.defaults.priority

    def idle_rules(self, profile: Profile) -> IdleRules:
        # Cached per profile's own rules (and the defaults they fall back on: a ``model_copy``
        # of the policy keeps the cache): loading checks every profile twice, and the culler
        # asks per server and pass.
        own, base = profile.idle, self.defaults.idle
        hit = self._idle_cache.get(id(own))
        if hit is None or hit[0] is not own or hit[1] is not base:
            hit = self._idle_cache[id(own)] = (own, base, own.over(base))
        return hit[2]

    @cached_property
    def _idle_cache(self) -> dict:
        return {}

    def process_limit(self, profile: Profile | None) -> int:
        """Tasks one server or job of ``profile`` may hold (its cgroup's ``pids.max``)."""
        if profile is not None and profile.max_processes is not None:
            return profile.max_processes
        return self.defaults.max_processes

    @model_validator(mode="after")
    def _idle_rules_consistent(self) -> "Policy":
        """Reject idle rules that contradict themselves, located at the key that set them."""
        errors, seen = [], set()

        def where(own: IdleRules, base_loc, fields):
            for f in fields:
                if getattr(own, f) is not None:
                    return (*base_loc, IdleRules.model_fields[f].alias)
            for f in fields:
                if getattr(self.defaults.idle, f) is not None and "defaults" in self.model_fields_set:
                    return ("defaults", "idle", IdleRules.model_fields[f].alias)
            return base_loc

        checks: list[tuple[IdleRules, IdleRules, tuple[str | int, ...], bool]]
        checks = [(self.defaults.idle, self.defaults.idle, ("defaults", "idle"), True)]
        for i, prof in enumerate(self.profiles):
            checks.append((self.idle_rules(prof), prof.idle, ("profiles", i, "idle"), bool(prof.gpu_count)))
            if prof.idle.gpu_idle_timeout is not None and not prof.gpu_count:
                errors.append(
                    (("profiles", i, "idle", "gpuIdleTimeout"), "gpuIdleTimeout on a profile without GPUs never applies")
                )
        found: dict = {}  # most profiles share their effective rules (the defaults): checked once
        for effective, own, loc, gpus in checks:
            problems = found.get((id(effective), gpus))
            if problems is None:
                problems = found[id(effective), gpus] = effective.problems(gpus)
            for fields, message in problems:
                at = where(own, loc, fields)
                if (at, message) not in seen:
                    seen.add((at, message))
                    errors.append((at, message))
        if errors:
            raise ValidationError.from_exception_data(
                "Policy",
                [
                    InitErrorDetails(type=PydanticCustomError("value_error", "{error}", {"error": m}), loc=loc, input=None)
                    for loc, m in errors
                ],
            )
        return self

    @model_validator(mode="after")
    def _job_priorities_known(self) -> "Policy":
        """A team's ``jobPriority`` must name one of the priority classes (jobs queue at it)."""
        names = [p.name for p in self.priority_classes]
        errors = []
        for i, team in enumerate(self.teams):
            if team.job_priority is not None and team.job_priority not in names:
                import difflib  # only for a mistake

                close = difflib.get_close_matches(team.job_priority, names, n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                errors.append(
                    InitErrorDetails(
                        type=PydanticCustomError(
                            "value_error", "{error}", {"error": f"unknown priority class {team.job_priority!r}{hint}"}
                        ),
                        loc=("teams", i, "jobPriority"),
                        input=team.job_priority,
                    )
                )
        if errors:
            raise ValidationError.from_exception_data("Policy", errors)
        return self

    def namespace_of(self, team: Team | str, shared: str) -> str:
        """The namespace of ``team``'s pods and LocalQueue (``tenancy``)."""
        return self.tenancy.namespace_of(team if isinstance(team, str) else team.name, shared)

    def user_namespaces(self, shared: str) -> list[str]:
        """Every namespace where user pods run: ``shared``, or each team's (policy order)."""
        return list(dict.fromkeys(self.namespace_of(t, shared) for t in self.teams))

    @model_validator(mode="after")
    def _team_namespaces_valid(self) -> "Policy":
        """``tenancy.mode: team``: each team's namespace must be a valid name; Ray clusters are
        watched in one namespace (kube/ray_manager.py), so they need the shared mode."""
        if self.tenancy.mode != "team":
            return self
        errors: list[tuple[tuple[str | int, ...], str]] = []
        for i, team in enumerate(self.teams):
            ns = self.namespace_of(team, "")
            if len(ns) > 63:
                errors.append(
                    (
                        ("teams", i, "name"),
                        f"team {team.name!r}'s namespace {ns!r} is longer than 63 characters (tenancy.namespace)",
                    )
                )
        if self.ray.enabled:
            errors.append(
                (
                    ("ray", "enabled"),
                    "Ray clusters need tenancy.mode shared for now: the hub's Ray manager watches one namespace",
                )
            )
        if errors:
            raise ValidationError.from_exception_data(
                "Policy",
                [
                    InitErrorDetails(type=PydanticCustomError("value_error", "{error}", {"error": m}), loc=loc, input=None)
                    for loc, m in errors
                ],
            )
        return self

    @model_validator(mode="after")
    def _flavor_topologies_known(self) -> "Policy":
        """A flavor's ``topology`` names a declared topology and one of its levels; Kueue wants
        at least one node label on a flavor with a topology (its ResourceFlavor's CEL rule)."""
        errors: list[tuple[tuple[str | int, ...], str]] = []
        seen: set[str] = set()
        for i, declared in enumerate(self.topologies):
            if declared.name in seen:
                errors.append((("topologies", i, "name"), f"topology {declared.name!r} is declared twice"))
            seen.add(declared.name)
        by_name = {t.name: t for t in self.topologies}
        for i, flavor in enumerate(self.flavors):
            ft = flavor.topology
            if ft is None:
                continue
            topo = by_name.get(ft.name)
            if topo is None:
                known = ", ".join(sorted(by_name)) or "none; declare it under 'topologies'"
                errors.append((("flavors", i, "topology", "name"), f"unknown topology {ft.name!r} (topologies: {known})"))
            elif ft.level not in topo.levels:
                errors.append(
                    (
                        ("flavors", i, "topology", "level"),
                        f"{ft.level!r} is not a level of topology {ft.name!r} (levels: {', '.join(topo.levels)})",
                    )
                )
            if not flavor.node_labels:
                errors.append(
                    (
                        ("flavors", i, "nodeLabels"),
                        "a flavor with a topology needs at least one node label (Kueue refuses a topology flavor without)",
                    )
                )
        if errors:
            raise ValidationError.from_exception_data(
                "Policy",
                [
                    InitErrorDetails(type=PydanticCustomError("value_error", "{error}", {"error": m}), loc=loc, input=None)
                    for loc, m in errors
                ],
            )
        return self

    @model_validator(mode="after")
    def _capacity_queues_known(self) -> "Policy":
        """``health.kubernetes.capacityQueue``: a known flavor -> a team with quota for it."""
        errors = []
        flavors = {f.name for f in self.flavors}
        for flavor, team_name in self.health.kubernetes.capacity_queue.items():
            loc = ("health", "kubernetes", "capacityQueue", flavor)
            team = next((t for t in self.teams if t.name == team_name), None)
            if flavor not in flavors:
                msg = f"unknown flavor {flavor!r} (flavors: {', '.join(sorted(flavors)) or 'none'})"
            elif team is None:
                msg = f"unknown team {team_name!r}"
            elif flavor not in team.quota.gpus:
                msg = f"team {team_name!r} has no quota for {flavor!r}: its ClusterQueue cannot give up GPUs it does not have"
            else:
                continue
            errors.append(
                InitErrorDetails(type=PydanticCustomError("value_error", "{error}", {"error": msg}), loc=loc, input=team_name)
            )
        if errors:
            raise ValidationError.from_exception_data("Policy", errors)
        return self

    @cached_property
    def _reclaim_cache(self) -> dict:
        return {}

    def reclaim_rules(self, team: Team) -> ReclaimRules:
        """The team's effective reclaim rules (cached: the queue asks per waiting request)."""
        cache = self._reclaim_cache
        rules = cache.get(team.name)
        if rules is None or cache.get((team.name, "team")) is not team:
            rules = cache[team.name] = self._reclaim_rules(team)
            cache[(team.name, "team")] = team
        return rules

    def _reclaim_rules(self, team: Team) -> ReclaimRules:
        rules = team.reclaim.over(self.defaults.reclaim.over(RECLAIM_DEFAULTS))
        if team.reclaim.notice is None and self.defaults.reclaim.notice is None:
            # Nobody chose a notice: 10 min, but never more than half the queue timeout.
            rules = rules.model_copy(update={"notice": min(RECLAIM_NOTICE, self.defaults.queue_timeout / 2)})
        return rules

    @model_validator(mode="after")
    def _reclaim_notice_fits(self) -> "Policy":
        """A lender must not give up waiting before its lent quota comes back."""
        from .quantities import format_duration as fmt

        errors = []
        checks: list[tuple[tuple[str | int, ...], float | None]]
        checks = [(("defaults", "reclaim", "notice"), self.defaults.reclaim.notice)]
        checks += [(("teams", i, "reclaim", "notice"), t.reclaim.notice) for i, t in enumerate(self.teams)]
        for loc, notice in checks:
            if notice is None:
                continue
            if notice < 0:
                msg = "the notice cannot be negative"
            elif notice >= self.defaults.queue_timeout:
                msg = (
                    f"the notice ({fmt(notice)}) must be shorter than defaults.queueTimeout "
                    f"({fmt(self.defaults.queue_timeout)}): the lending team would give up waiting "
                    "before its own quota came back"
                )
            else:
                continue
            errors.append(
                InitErrorDetails(type=PydanticCustomError("value_error", "{error}", {"error": msg}), loc=loc, input=notice)
            )
        if errors:
            raise ValidationError.from_exception_data("Policy", errors)
        return self

    def cohort_members(self, team: Team) -> list[Team]:
        if not team.cohort:
            return [team]
        return self._by_name[2].get(team.cohort, [])
