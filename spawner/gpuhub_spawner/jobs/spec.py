"""The job file (``job.yaml``): what a researcher hands gpuhub, validated like the policy.

Every mistake is reported with its line:column through the policy loader's located-error
machinery (``policy.loader``), so ``gpuhub job submit`` and ``gpuhub validate`` speak the
same way. Only the *shape* is checked here; whether the user's team may run the profile
is decided by the hub at submission (``policy.access``), never by the client.

The hub parses job files on its event loop, for any user, before any team check: the text
goes through ``policy.bounded`` (size, node count and depth checked on libyaml's event
stream before anything is composed; anchors and aliases refused), so no job file costs
more than a few milliseconds to refuse or accept.
"""

from __future__ import annotations

import re
import shlex
from typing import Annotated, Any, Final, Literal

from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from ..policy.bounded import MAX_JOB_FILE_BYTES, InputRefused, load_yaml, unsafe_env_reason
from ..policy.loader import PolicyError, PolicyIssue, _clean_loc, _message, _Positions, format_loc, suggest
from ..policy.quantities import parse_duration

# Reasons an attempt can end with; the retryable ones are listed in ``retries.reasons``.
PREEMPTED: Final = "preempted"  # its GPUs were reclaimed (an interactive server, Kueue)
INTERRUPTED: Final = "interrupted"  # the hub restarted while it ran
FAILED: Final = "failed"  # non-zero exit (any code); list exit codes to retry only those
OOM: Final = "oom"  # went over the profile's memory limit
# A GPU the attempt held went bad (docs/gpu-health.md). Not a word of ``retries.reasons``: it
# is always retried and never charged (the platform's doing, like a preemption), and it
# cannot loop: the failed GPU stays out of admission until an admin uncordons it.
GPU_FAILED = "gpu-failed"
PLATFORM_REASONS = (PREEMPTED, INTERRUPTED, GPU_FAILED)  # never count against retries.limit
RETRY_WORDS = (PREEMPTED, INTERRUPTED, FAILED, OOM)
DEFAULT_RETRY_ON: Final = (PREEMPTED, INTERRUPTED)

# Set by gpuhub for every attempt; a job file may not override them (the record and the
# run tags must say what really ran, and the devices are the hub's decision).
RESERVED_ENV = re.compile(
    r"^(GPUHUB_|JUPYTERHUB_|JPY_|MLFLOW_RUN_CONTEXT$|CUDA_VISIBLE_DEVICES$|NVIDIA_VISIBLE_DEVICES$"
    r"|MASTER_ADDR$|MASTER_PORT$|WORLD_SIZE$|RANK$|LOCAL_RANK$|LOCAL_WORLD_SIZE$)"
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_RETRIES = 20
MAX_ISSUES = 50  # a file with thousands of mistakes is reported by its first 50
MAX_MESSAGE_CHARS = 300


class _EnvNamesRefused(ValueError):
    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("; ".join(reason for _, reason in problems))


def _checked_env(value: Any) -> Any:
    """Names a job may set: valid, not gpuhub's, not the dynamic loader's; plain values."""
    if not isinstance(value, dict):
        return value
    out, unsafe = {}, []
    for key, v in value.items():
        key = str(key)
        if not _ENV_NAME.match(key):
            raise ValueError(f"{key[:100]!r} is not a valid environment variable name")
        if RESERVED_ENV.match(key):
            raise ValueError(f"{key!r} is set by gpuhub for every attempt and cannot be overridden")
        reason = unsafe_env_reason(key)
        if reason:
            unsafe.append((key, reason))
            continue
        if isinstance(v, (dict, list)) or v is None:
            raise ValueError(f"the value of {key} must be a string, number or boolean")
        out[key] = str(v).lower() if isinstance(v, bool) else str(v)
    if unsafe:
        raise _EnvNamesRefused(unsafe)
    return out


def _ray_local_path(value: str) -> str:
    """A Ray job's ``working_dir`` or ``py_modules`` entry: your own files, never a URI.

    Ray reads anything with a URI scheme (``urlparse``'s, as Ray's ``is_path`` does: not only
    ``https://``, ``s3://``, ``gs://``, ``file://`` but also ``gcs:_ray_pkg_...``) as a package
    to fetch rather than a path. Refused: the machine would download code from wherever the
    job file points (the operator's network, not the user's files); ``file://`` reaches
    outside the home; a ``gcs://`` name is a package Ray uploaded to a cluster's store, not a
    file of the user's; and the job's record would not say what code ran (the git evidence
    is of the working directory)."""
    scheme = urlsplit(value).scheme
    if scheme:
        raise ValueError(
            f"{value[:80]!r} is a URI ({scheme}:), which Ray would fetch instead of reading your files: give a "
            "path inside your home directory (a relative path whose first part has a ':' reads as a URI: "
            "write './' before it)"
        )
    return _inside_home(value)


def _inside_home(value: str) -> str:
    if value.startswith("/"):
        raise ValueError("must be a relative path, inside your home directory (no leading '/')")
    if ".." in value.split("/") or "\0" in value:
        raise ValueError("must stay inside your home directory (no '..')")
    return value


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)


def _shorthand_retries(value: Any) -> Any:
    """``retries: 2`` is short for ``retries: {limit: 2}``."""
    if isinstance(value, dict) and any(isinstance(k, bool) for k in value):
        raise ValueError("YAML reads the key 'on' (or yes/no) as a boolean; list retryable reasons under 'reasons'")
    return {"limit": value} if isinstance(value, int) and not isinstance(value, bool) else value


MAX_DURATION_CHARS = 32  # "1h30m"; parse_duration's regex is quadratic in a long run of digits


def _duration(value: Any) -> Any:
    if isinstance(value, str) and len(value) > MAX_DURATION_CHARS:
        raise ValueError(
            f"{value[:20]!r}... is not a duration (at most {MAX_DURATION_CHARS} characters; examples: 90s, 15m, 1h30m, 2d)"
        )
    return None if value is None else parse_duration(value)


class Retries(_Model):
    limit: Annotated[StrictInt, Field(ge=0, le=MAX_RETRIES)] = 0
    reasons: list[Literal["preempted", "interrupted", "failed", "oom"] | Annotated[StrictInt, Field(ge=1, le=255)]] = list(
        DEFAULT_RETRY_ON
    )

    def retries(self, reason: str, exit_code: int | None) -> bool:
        if reason in self.reasons:
            return True
        return reason == FAILED and exit_code is not None and exit_code in self.reasons


class RayRuntimeEnv(BaseModel):
    """A Ray job's ``runtimeEnv``: Ray's keys, spelled as Ray spells them (snake_case).

    Paths are relative to the job's working directory (where the entrypoint is submitted
    from) and stay inside the user's home. Everything here is applied by Ray, as the user,
    inside the job's sandbox."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    env_vars: dict[str, str] = {}
    working_dir: str | None = Field(None, min_length=1, max_length=1024)
    py_modules: Annotated[list[Annotated[str, Field(min_length=1, max_length=1024)]], Field(max_length=MAX_RUNTIME_LIST)] = []
    pip: Annotated[list[Annotated[str, Field(min_length=1, max_length=500)]], Field(max_length=MAX_RUNTIME_LIST)] = []
    excludes: Annotated[list[Annotated[str, Field(min_length=1, max_length=1024)]], Field(max_length=MAX_RUNTIME_LIST)] = []

    @field_validator("env_vars", mode="before")
    @classmethod
    def _env_vars(cls, value):
        value = _checked_env(value)
        for key in value if isinstance(value, dict) else ():
            if RAY_RESERVED_ENV.match(key):
                raise ValueError(f"{key!r} is set by gpuhub for a Ray job (its cluster's address and token)")
        return value

    @field_validator("working_dir")
    @classmethod
    def _working_dir(cls, value):
        return value if value is None else _ray_local_path(value)

    @field_validator("py_modules")
    @classmethod
    def _py_modules(cls, value):
        return [_ray_local_path(v) for v in value]

    def for_ray(self) -> dict:
        """What Ray's job submission takes as ``runtime_env`` (empty keys left out)."""
        return {k: v for k, v in self.model_dump().items() if v}


# A notebook job's parameters (papermill's): identifiers to plain values, a bounded number.
MAX_PARAMETERS = 100
MAX_PARAMETER_CHARS = 4096
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,99}$")
# The runner of a notebook job (``jobs.notebook``), run as the user like any command; the
# backend puts its Python first (one machine: the hub's environment, which has papermill).
NOTEBOOK_RUNNER = ("-m", "gpuhub_spawner.jobs.notebook", "--")
MAX_WORKERS = 64
MISSING_BOTH = "give either 'command' (what to run) or 'notebook' (a notebook to execute)"
KINDS = ("command", "notebook", "ray")
# A Ray job's runtime environment: Ray's own keys (as in Ray's docs and KubeRay's
# runtimeEnvYAML), the ones that need nothing outside the user's sandbox but the package
# index. conda, container and image_uri would run other programs on the machine: refused.
RAY_RUNTIME_KEYS = ("env_vars", "working_dir", "py_modules", "pip", "excludes")
MAX_ENTRYPOINT_CHARS = 8192
MAX_RUNTIME_LIST = 100
# Set by gpuhub for a Ray job (its cluster's token and address): the job file may not.
RAY_RESERVED_ENV = re.compile(r"^(RAY_AUTH_|RAY_ADDRESS$|RAY_JOB_|RAY_RUNTIME_ENV)")


class JobSpec(_Model):
    # What runs: a command (the default), a notebook, or a Ray job on a cluster of its own.
    # Named ``declared_kind`` because ``kind`` is the property every backend reads.
    declared_kind: Literal["command", "notebook", "ray"] | None = Field(None, alias="kind")
    profile: str = Field(min_length=1)
    team: str | None = None  # for members of several teams
    name: str | None = Field(None, max_length=100)
    # Exactly one of: a command, or a notebook (relative to home) executed top to bottom.
    command: list[str] | str | None = None
    notebook: str | None = Field(None, min_length=1, max_length=1024)
    parameters: dict[str, str | int | float | bool | None] = {}
    # kind: ray: a shell command submitted to the job's own Ray cluster (Ray's job
    # submission API), with Ray's runtime environment.
    entrypoint: list[str] | str | None = None
    runtime_env: RayRuntimeEnv | None = None
    # Several processes admitted together (all or nothing), each with the profile's GPUs,
    # CPU and memory, and a torchrun-style rendezvous (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK).
    workers: Annotated[StrictInt, Field(ge=1, le=MAX_WORKERS)] = 1
    image: str | None = None  # Kubernetes; one machine runs in the machine's environment
    working_dir: str | None = None  # relative to the home directory
    env: dict[str, str] = {}
    retries: Annotated[Retries, BeforeValidator(_shorthand_retries)] = Retries()
    checkpoint_dir: str | None = None  # relative to home; default .gpuhub/checkpoints/<job id>
    experiment: str | None = Field(None, min_length=1, max_length=200)
    time_limit: Annotated[float | None, BeforeValidator(_duration)] = None

    @field_validator("command", "entrypoint", mode="before")
    @classmethod
    def _scalar_args(cls, value):
        # `[python, train.py, --epochs, 3]`, `[true]`: YAML makes numbers and booleans of
        # unquoted words; as arguments they mean their text.
        if isinstance(value, list):
            return [str(v).lower() if isinstance(v, bool) else str(v) if isinstance(v, (int, float)) else v for v in value]
        return value

    @field_validator("command", "entrypoint")
    @classmethod
    def _command(cls, value):
        if isinstance(value, str):
            if not value.strip():
                raise ValueError("must not be empty")
            try:
                shlex.split(value)
            except ValueError as e:
                raise ValueError(f"is not a valid shell command ({e})") from None
        elif not value or not value[0]:
            raise ValueError("must not be empty (give the program and its arguments)")
        return value

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, value):
        return _checked_env(value)

    @field_validator("notebook")
    @classmethod
    def _notebook(cls, value):
        if value is None:
            return value
        if value.startswith("/"):
            raise ValueError("must be a path relative to your home directory (no leading '/')")
        if not value.endswith(".ipynb"):
            raise ValueError("must be a notebook file (ending in .ipynb)")
        return value

    @field_validator("parameters", mode="before")
    @classmethod
    def _parameters(cls, value):
        if not isinstance(value, dict):
            return value
        if len(value) > MAX_PARAMETERS:
            raise ValueError(f"at most {MAX_PARAMETERS} parameters")
        for key, v in value.items():
            if not isinstance(key, str) or not _IDENTIFIER.match(key):
                raise ValueError(f"{str(key)[:100]!r} is not a Python identifier (a parameter is a variable of the notebook)")
            if isinstance(v, str) and len(v) > MAX_PARAMETER_CHARS:
                raise ValueError(f"the value of {key} is longer than {MAX_PARAMETER_CHARS} characters")
            if isinstance(v, (dict, list)):
                raise ValueError(f"the value of {key} must be a string, number, boolean or null")
        return value

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint(cls, value):
        if value is None:
            return value
        line = value if isinstance(value, str) else shlex.join(value)
        if len(line) > MAX_ENTRYPOINT_CHARS:
            raise ValueError(f"must be at most {MAX_ENTRYPOINT_CHARS} characters")
        if line[:1] in ("-", "+"):
            # Ray runs it as `/bin/sh -c ENTRYPOINT` (both backends): the shell would take it
            # for its own options and run nothing.
            raise ValueError(
                f"starts with {line[0]!r}: Ray runs the entrypoint as a shell command (/bin/sh -c), which would read "
                "it as the shell's own option; begin with the program, e.g. 'python -m mymodule'"
            )
        return value

    @model_validator(mode="after")
    def _one_of_command_or_notebook(self):
        problems = kind_problems(self.model_dump(by_alias=True, exclude_none=True))
        if problems:
            raise ValueError(f"{problems[0][0][0]}: {problems[0][1]}")
        if self.kind == "ray":
            return self
        if self.command is None and self.notebook is None:
            raise ValueError(MISSING_BOTH)
        if self.command is not None and self.notebook is not None:
            raise ValueError("give either 'command' or 'notebook', not both")
        if self.workers > 1 and self.notebook is not None:
            raise ValueError("a notebook runs as one worker ('workers' is for a command)")
        if self.parameters and self.notebook is None:
            raise ValueError("'parameters' are for a notebook job ('notebook: train.ipynb')")
        return self

    @field_validator("working_dir", "checkpoint_dir", "notebook")
    @classmethod
    def _relative(cls, value):
        if value is None:
            return value
        parts = value.split("/")
        if ".." in parts or "\0" in value:
            raise ValueError("must stay inside your home directory (no '..')")
        return value

    @field_validator("time_limit")
    @classmethod
    def _positive(cls, value):
        if value is not None and value <= 0:
            raise ValueError("must be longer than 0s")
        return value

    @property
    def kind(self) -> str:
        if self.declared_kind is not None:
            return self.declared_kind
        return "notebook" if self.notebook is not None else "command"

    @property
    def ray_entrypoint(self) -> str:
        """Ray's entrypoint is one shell command; a list is quoted into one."""
        assert self.entrypoint is not None  # kind: ray (the model validator)
        return self.entrypoint if isinstance(self.entrypoint, str) else shlex.join(self.entrypoint)

    @property
    def argv(self) -> list[str]:
        """The command as argv: a shell string runs under ``/bin/sh -c``; a notebook runs
        under ``python -m gpuhub_spawner.jobs.notebook`` (see ``notebook_argv``)."""
        if self.notebook is not None:
            return self.notebook_argv("python3")
        if self.kind == "ray":
            raise ValueError("a Ray job's command is its backend's (the cluster's launcher): see JobSpec.entrypoint")
        assert self.command is not None  # the model validator: one of the two
        return ["/bin/sh", "-c", self.command] if isinstance(self.command, str) else list(self.command)

    def notebook_argv(self, python: str) -> list[str]:
        assert self.notebook is not None
        return [python, *NOTEBOOK_RUNNER, self.notebook]


_MODELS: dict[tuple[str | int, ...], type[BaseModel]] = {
    (): JobSpec,
    ("retries",): Retries,
    ("runtimeEnv",): RayRuntimeEnv,
    ("runtime_env",): RayRuntimeEnv,
}


def kind_problems(data: dict) -> list[tuple[tuple[str, ...], str]]:
    """What the job file's kind and its keys say against each other, each at the key it is
    about: ``entrypoint`` missing for ``kind: ray``, a ``command`` given to a Ray job, an
    ``entrypoint`` without ``kind: ray``, ``kind: notebook`` with a command..."""
    kind = data.get("kind")
    if kind is not None and kind not in KINDS:
        return []  # an unknown kind is said at 'kind' by the model; nothing more here
    out: list[tuple[tuple[str, ...], str]] = []
    has = lambda *keys: next((k for k in keys if k in data and data[k] is not None), None)  # noqa: E731
    if kind == "ray":
        if has("entrypoint") is None:
            out.append((("entrypoint",), "is required for kind: ray (the shell command Ray runs on the job's cluster)"))
        for key in ("command", "notebook"):
            if has(key):
                out.append(((key,), "is not for kind: ray (a Ray job runs its 'entrypoint' on its own cluster)"))
        if data.get("parameters"):
            out.append((("parameters",), "are for a notebook job ('notebook: train.ipynb'), not for kind: ray"))
        env = data.get("env")
        for name in env if isinstance(env, dict) else ():
            if RAY_RESERVED_ENV.match(str(name)):
                out.append((("env", str(name)), "is set by gpuhub for a Ray job (its cluster's address and token)"))
        return out
    for key in ("entrypoint", "runtimeEnv", "runtime_env"):
        if has(key):
            out.append(((key,), "is for kind: ray (add 'kind: ray' to run it on a Ray cluster of its own)"))
    if kind == "command" and has("notebook"):
        out.append((("notebook",), "is not for kind: command (use kind: notebook, or leave 'kind' out)"))
    if kind == "notebook" and has("command"):
        out.append((("command",), "is not for kind: notebook (use kind: command, or leave 'kind' out)"))
    return out


def parse_job(text: str, filename: str = "job.yaml") -> JobSpec:
    """Parse and validate a job file; raise ``PolicyError`` listing every located problem.

    Bounded: at most ``MAX_JOB_FILE_BYTES``, no anchors or aliases, a capped number of
    values and nesting depth (``policy.bounded``), all refused before composing.
    """
    try:
        root, data = load_yaml(text, what="job files", max_bytes=MAX_JOB_FILE_BYTES)
    except InputRefused as e:
        raise PolicyError(filename, [PolicyIssue(e.path, e.line, e.column, e.message)]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line, col = (mark.line + 1, mark.column + 1) if mark else (None, None)
        problem = getattr(e, "problem", None) or str(e)
        raise PolicyError(filename, [PolicyIssue("", line, col, f"YAML syntax error: {problem}")]) from None
    positions = _Positions(root)  # no aliases: every walk of it is linear
    issues: list[PolicyIssue] = []

    def add(loc, message, key=False):
        if len(issues) >= MAX_ISSUES:
            return
        line_col = positions.mark(loc, key=key) or (None, None)
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[:MAX_MESSAGE_CHARS] + "…"
        issues.append(PolicyIssue(format_loc(loc), *line_col, message))

    issues.extend(positions.duplicate_key_issues()[:MAX_ISSUES])
    if not isinstance(data, dict):
        add((), "a job file must be a mapping with at least 'profile' and 'command' (or 'notebook')")
        raise PolicyError(filename, issues)
    located = kind_problems(data)
    for where, message in located:
        if where[0] in data:
            add(where, message, key=True)
        else:  # a key that is missing: said at the 'kind' that needs it
            line, column = positions.mark(("kind",)) or (None, None)
            issues.append(PolicyIssue(format_loc(where), line, column, message))
    if data.get("kind") in (None, "command", "notebook") and "command" not in data and "notebook" not in data and not located:
        add(("command",), "is required (or 'notebook': a notebook to execute)")
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as e:
        for err in e.errors()[:MAX_ISSUES]:
            loc = _clean_loc(err["loc"])
            if not loc and (MISSING_BOTH in str(err.get("msg", "")) or located):
                continue  # said above, located at the key it is about
            if err["type"] == "extra_forbidden" and loc[:1] in (("runtimeEnv",), ("runtime_env",)) and len(loc) == 2:
                add(
                    loc,
                    f"Ray's {loc[-1]!r} is not offered here{suggest(loc[-1], list(RAY_RUNTIME_KEYS))}: a Ray job's "
                    f"runtime environment may have {', '.join(RAY_RUNTIME_KEYS)}",
                    key=True,
                )
            elif loc == ("kind",) and err["type"] == "literal_error":
                got = str(err.get("input"))[:50]
                add(loc, f"must be one of {', '.join(KINDS)} (got {got!r}){suggest(got, list(KINDS))}")
            elif err["type"] == "extra_forbidden":
                model = _MODELS.get(tuple(p for p in loc[:-1] if not isinstance(p, int)))
                names = [f.alias or n for n, f in model.model_fields.items()] if model else []
                add(loc, f"unknown key {loc[-1]!r}{suggest(loc[-1], names)}", key=True)
            elif loc and loc[0] == "command" and err["type"] in ("string_type", "list_type"):
                add(("command",), "must be a list of strings or one shell command string")
            elif loc and loc[0] == "retries" and len(loc) >= 3 and loc[1] == "reasons":
                add(loc[:3], f"must be one of {', '.join(RETRY_WORDS)} or an exit code 1-255 (got {err.get('input')!r})")
            elif loc and loc[0] == "env" and isinstance(err.get("ctx", {}).get("error"), _EnvNamesRefused):
                for name, reason in err["ctx"]["error"].problems:
                    add(("env", name), reason, key=True)
            elif loc and loc[0] == "env" and err["type"] == "value_error":
                add(("env",), _message(err))
            else:
                add(loc, _message(err))
        seen, unique = set(), []
        for i in issues:  # unions report one problem per member; say it once
            if (i.path, i.message) not in seen:
                seen.add((i.path, i.message))
                unique.append(i)
        raise PolicyError(filename, sorted(unique, key=lambda i: (i.line or 0, i.column or 0))) from None
    if issues:
        raise PolicyError(filename, issues)
    return spec
