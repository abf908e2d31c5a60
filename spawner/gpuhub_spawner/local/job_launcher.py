"""Launch one job attempt through the one-machine spawner's own launcher.

``JobProcess`` *is* ``local.isolation.IsolatedProcessSpawner`` (the class every
one-machine server starts through), with only what differs for a job overridden:
the command (``jobs.entry`` then the job's argv instead of ``jupyterhub-singleuser``),
the environment (built from scratch: no server token, no OAuth client), the devices
(the job's admission) and its cgroup leaf. So a job gets exactly what a server of the
same profile gets — its user's Unix account and private home, a cgroup with the
profile's CPU and memory, a private ``/dev`` with only its GPUs, ``no_new_privs`` —
and a change to that launcher applies to jobs at once.

The job's environment (``get_env``: its ``env``, the profile's, gpuhub's) never reaches a
privileged process: like a server's, it travels to the root sandbox launcher on a pipe
and is applied only by the final ``execve``, after the switch to the user's account
(``local.sandbox``). The launcher itself runs with a fixed minimal environment, so a
job's ``LD_PRELOAD``/``LD_LIBRARY_PATH``/``LD_AUDIT``/``GCONV_PATH`` only ever reach its
own processes. ``workingDir``, ``checkpointDir`` and ``command`` are used by
``jobs.entry``, which already runs as the user. The caller's ``pass_fds`` (the evidence
pipe) are kept next to the launcher's spec pipe.

Seam: this depends on ``IsolatedProcessSpawner``'s hooks ``device_nodes``,
``resource_limits``, ``user_env``, ``_cgroup_leaf``, ``popen_kwargs``, ``cmd`` +
``get_args`` and on ``start``/``stop``/``on_process_exit``/``stop_reason``.
"""

from __future__ import annotations

import copy
import sys
from types import SimpleNamespace

from .isolation import IsolatedProcessSpawner

# Config sections a job's launcher inherits, in order (later wins): the spawner the hub
# uses for servers, so home directories, device trees, account prefixes and cgroup
# settings are the same for jobs.
SERVER_SECTIONS = ("LocalGpuSpawner",)


def launcher_config(config):
    cfg = copy.deepcopy(config)
    for name in SERVER_SECTIONS:
        if name in cfg:
            cfg.JobProcess.merge(cfg[name])
    return cfg


class JobProcess(IsolatedProcessSpawner):
    """One attempt of one job, as its user; see the module docstring."""

    serves_http = False  # it runs once started: no port to wait for

    def __init__(
        self,
        *,
        user_name: str,
        job_id: str,
        argv: list[str],
        env: dict[str, str],
        devices: list[str],
        device_nodes: list[str],
        limits: tuple[int | None, int | None],
        worker: int = 0,
        scope: tuple | None = None,
        **kwargs,
    ):
        # Spawner.name is read from orm_spawner (a name= argument went to object.__init__: a
        # traitlets DeprecationWarning today, a TypeError in a later release); logs say user:job.
        super().__init__(
            user=SimpleNamespace(name=user_name, url=f"/user/{user_name}/", escaped_name=user_name),
            orm_spawner=SimpleNamespace(name=job_id if not worker else f"{job_id}.w{worker}", server=None),
            **kwargs,
        )
        self.job_id = job_id
        self.worker = worker
        self.job_argv = list(argv)
        self.job_env = dict(env)
        self.job_devices = list(devices)
        self._nodes = list(device_nodes)
        self._limits = limits
        self._scope = scope  # (policy, team, profile): the grants the job's team and profile get
        self.cmd = [sys.executable, "-I", "-m", "gpuhub_spawner.jobs.entry", "--", *self.job_argv]

    def granted_scope(self):
        return self._scope

    @property
    def grant_key(self) -> str:
        return f"job:{self.job_id}"

    def get_args(self):
        return []

    def device_nodes(self) -> list[str]:
        return list(self._nodes)

    def resource_limits(self):
        return self._limits

    def _cgroup_leaf(self) -> str:
        # Server leaves are "<account>" or "<account>.<name>.<hash>"; jobs never collide; a
        # job's further workers (rank 1...) each have a leaf of their own.
        return f"{self.account_name}.{self.job_id}" + (f".w{self.worker}" if self.worker else "")

    def get_env(self):
        """From scratch: the hub's kept variables, the servers' configured environment
        (MLflow, ...), the account's identity, then the job's own (already filtered)."""
        env = {}
        import os

        for key in self.env_keep:
            if key in os.environ:
                env[key] = os.environ[key]
        for key, value in self.environment.items():
            env[key] = value(self) if callable(value) else value
        env = self.user_env(env)
        env.update(self.job_env)
        devices = ",".join(self.job_devices)
        env["CUDA_VISIBLE_DEVICES"] = devices  # always set: a CPU job must not see GPUs
        env["GPUHUB_DEVICES"] = devices
        return env
