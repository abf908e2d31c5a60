"""The server's identity as the hub set it (``PolicySpawnerMixin.choice_environment``)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerIdentity:
    user: str
    team: str
    profile: str
    image: str
    gpu_count: int
    gpu_flavor: str
    server_name: str
    runtime: str = ""  # one machine: the Python environment the server runs in

    @property
    def image_digest(self) -> str:
        """``sha256:...`` when the image reference is pinned by digest (or the hub said so)."""
        explicit = os.environ.get("GPUHUB_IMAGE_DIGEST", "")
        if explicit:
            return explicit
        if "@" in self.image:
            return self.image.rsplit("@", 1)[1]
        return ""

    @property
    def has_gpu(self) -> bool:
        return self.gpu_count > 0


def current(environ=None) -> ServerIdentity | None:
    """The identity from the environment, or None outside a gpuhub server."""
    env = os.environ if environ is None else environ
    user = env.get("GPUHUB_USER") or env.get("JUPYTERHUB_USER")
    if not user:
        return None
    try:
        gpu_count = int(env.get("GPUHUB_GPU_COUNT") or 0)
    except ValueError:
        gpu_count = 0
    return ServerIdentity(
        user=user,
        team=env.get("GPUHUB_TEAM", ""),
        profile=env.get("GPUHUB_PROFILE", ""),
        image=env.get("GPUHUB_IMAGE", ""),
        gpu_count=gpu_count,
        gpu_flavor=env.get("GPUHUB_GPU_FLAVOR", ""),
        server_name=env.get("GPUHUB_SERVER_NAME", env.get("JUPYTERHUB_SERVER_NAME", "")),
        runtime=env.get("GPUHUB_RUNTIME", ""),
    )
