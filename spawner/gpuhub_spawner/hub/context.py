"""The application object, as the hub's handlers, pages and template variables reach it.

One per hub process, made by the composition root (``wiring/app.py``) and handed in through
JupyterHub's ``tornado_settings["gpuhub"]`` (handlers: ``self.settings``; spawners:
``self.user.settings``), as JupyterHub hands its own shared objects to handlers. It carries
what used to live in module-level registries: which backend's admission view, jobs and Ray
manager this hub has, and the state the hub's own APIs keep between requests (policy
evaluations in flight, GPU long polls held). Nothing here is a module global, so two hubs in one
process (the tests) never see each other's state, and the import graph shows every reach.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from tornado import web

SETTINGS_KEY = "gpuhub"


class PolicyChanges:
    """What the policy API keeps between requests (hub/policy_api.py): the versions store
    (set at hub start), one apply at a time, one evaluation per user, the masked text of recent
    versions, and the one thread evaluations run in (never the hub's loop, never the default
    pool that spawns and the culler share)."""

    MASKED_KEPT = 16

    def __init__(self) -> None:
        self.versions: Any = None  # usage.policy_versions.PolicyVersions, once the hub has started
        self.apply_lock: Any = None  # asyncio.Lock, made on the hub's loop at the first apply
        self.in_flight: set[str] = set()  # users with an evaluation queued or running
        self.masked: dict[str, str | None] = {}  # file hash -> masked text (None: does not parse)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuhub-policy")


class GpuHubApp:
    """The hub's shared objects. ``admission``, ``jobs`` and ``ray`` are the composition root's
    choice of backend (a callable of the hub's config each); the rest is state of the hub's own
    APIs."""

    def __init__(
        self,
        admission: Callable[[Any], Any] | None = None,
        jobs: Callable[[Any], Any] | None = None,
        ray: Callable[[Any], Any] | None = None,
        backend_changes: Callable[[Any, Any], list | None] | None = None,
        end_processes: Callable[[Any], str] | None = None,
    ) -> None:
        self._admission, self._jobs, self._ray = admission, jobs, ray
        self._backend_changes = backend_changes
        # One machine: end every process of a user's account (off-boarding's last step), given
        # their spawner; blocking (run it off the loop). None: the backend has no accounts.
        self.end_processes = end_processes
        # Kubernetes: delete a leaver's own LocalQueues (fairShare.users), given their spawner;
        # a coroutine function. Set by wiring/kube.py; None: the backend has none.
        self.delete_user_queues: Callable[[Any], Any] | None = None
        self.policy_changes = PolicyChanges()
        self.gpu_waiters: dict[str, int] = {}  # user -> GPU long polls held (hub/culling_api.py)
        # Off-boarding (hub/offboarding.py), set by wiring/offboarding.py: the block file and
        # where archived homes go (both in the hub's data directory).
        self.offboarding_file: str = ""
        self.offboarding_archive_dir: str = ""
        self.mlflow_state_dir: str = ""  # the managed MLflow service's state (wiring/mlflow.py)

    def __deepcopy__(self, memo):  # a service, not configuration: traitlets copies configs
        return self

    def admission_view(self, config=None):
        """The admission view of this hub (the backend that admits: admission/view.py)."""
        if self._admission is None:
            raise RuntimeError("no admission backend wired into this hub (wiring.app.app_of(c) wires one)")
        return self._admission(config)

    def backend_changes(self, current, policy) -> list[tuple[str, set[str]]] | None:
        """What a policy edit changes in the backend's own objects, as ``(words, teams)``
        (Kubernetes: the Kueue objects, ``kube/kueue_diff.py``); None where the backend has none.
        May raise ValueError with the reason the backend refuses the edit."""
        return self._backend_changes(current, policy) if self._backend_changes is not None else None

    def policy_warnings(self, config, policy) -> list[str]:
        """What ``gpuhub validate`` warns about ``policy`` on this hub: the backend's own checks
        (one machine: its GPUs, the activity interval: ``policy_warnings`` of the broker); none
        where the backend has none."""
        try:
            view = self.admission_view(config)
        except RuntimeError:
            return []
        check = getattr(view, "policy_warnings", None)
        return list(check(policy)) if check is not None else []

    def jobs(self, config=None):
        """This hub's jobs backend (``local.job_manager`` or ``kube.job_manager``)."""
        if self._jobs is None:
            raise web.HTTPError(404, "batch jobs are not enabled on this hub")
        return self._jobs(config)

    def ray(self, config=None):
        """This hub's Ray clusters backend (``local.ray_manager`` or ``kube.ray_manager``)."""
        if self._ray is None:
            raise web.HTTPError(404, "Ray clusters are not enabled on this hub")
        return self._ray(config)


def app_of(holder) -> GpuHubApp:
    """The application object of a handler (``settings``), a spawner's user (``settings``), or
    a settings dict; a clear error where the hub was configured without gpuhub's wiring."""
    settings = holder if isinstance(holder, dict) else getattr(holder, "settings", None) or {}
    app = settings.get(SETTINGS_KEY)
    if app is None:
        raise RuntimeError(
            f"no gpuhub application object in this hub's tornado_settings[{SETTINGS_KEY!r}]: "
            "hub configs call gpuhub_spawner.wiring (configure_local, or the chart's extraConfig)"
        )
    return app
