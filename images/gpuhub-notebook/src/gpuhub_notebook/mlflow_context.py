"""MLflow run-context provider: every run from a gpuhub server is tagged with where
it came from, with no code in the notebook.

Registered as entry point ``mlflow.run_context_provider`` (``gpuhub``). MLflow
instantiates it when its context registry loads (``import mlflow``); that is also
when GPU servers turn on system-metrics logging (GPU utilisation and memory through
nvidia-ml-py), unless the user already chose otherwise.
"""

from __future__ import annotations

import os

from . import gitinfo, identity

# MLflow's registries only call in_context() and tags(), so the provider needs no
# MLflow base class - and importing none keeps this module free of an import cycle
# (MLflow loads this entry point while ``import mlflow`` is still running).

TAG_PREFIX = "gpuhub."


def tags_for(ident: identity.ServerIdentity | None, git: gitinfo.GitState | None, notebook: str | None = None) -> dict[str, str]:
    tags: dict[str, str] = {}
    if notebook:
        # MLflow's own source is the kernel launcher; the notebook is what users recognise.
        tags["mlflow.source.name"] = notebook
        tags[f"{TAG_PREFIX}notebook"] = notebook
    if ident is not None:
        tags.update(
            {
                "mlflow.user": ident.user,
                f"{TAG_PREFIX}user": ident.user,
                f"{TAG_PREFIX}team": ident.team,
                f"{TAG_PREFIX}profile": ident.profile,
                f"{TAG_PREFIX}gpu.flavor": ident.gpu_flavor or "none",
                f"{TAG_PREFIX}gpu.count": str(ident.gpu_count),
                f"{TAG_PREFIX}server": ident.server_name or "default",
            }
        )
        if ident.image:  # Kubernetes: the pod's image; one machine runs in no image
            tags[f"{TAG_PREFIX}image"] = ident.image
        if ident.runtime:
            tags[f"{TAG_PREFIX}runtime"] = ident.runtime
        if ident.image_digest:
            tags[f"{TAG_PREFIX}image.digest"] = ident.image_digest
    if git is not None:
        tags.update(
            {
                "mlflow.source.git.commit": git.commit,
                f"{TAG_PREFIX}git.commit": git.commit,
                f"{TAG_PREFIX}git.dirty": "true" if git.dirty else "false",
            }
        )
        if git.branch and git.branch != "HEAD":
            tags["mlflow.source.git.branch"] = git.branch
    return tags


def enable_gpu_system_metrics(ident: identity.ServerIdentity | None, environ=None) -> bool:
    """On GPU servers, log system metrics unless the user set the variable themselves."""
    env = os.environ if environ is None else environ
    if ident is None or not ident.has_gpu:
        return False
    env.setdefault("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "true")
    return env["MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING"].lower() in ("true", "1")


def public_link(text: str, environ=None) -> str:
    """MLflow's "View run … at: <tracking URI>/#/…" with the hub's public MLflow address.

    The tracking URI is the hub's internal address (the kernel talks to MLflow directly);
    a browser opening it got 403. ``GPUHUB_MLFLOW_UI_URL`` (set by the hub) is the address
    a browser reaches with the hub login.
    """
    env = os.environ if environ is None else environ
    internal = (env.get("GPUHUB_MLFLOW_TRACKING_URI") or "").rstrip("/")
    public = (env.get("GPUHUB_MLFLOW_UI_URL") or "").rstrip("/")
    if not internal or not public:
        return text
    return text.replace(internal + "/#", public + "/#")


_patched = False


def print_public_run_links() -> None:
    """Wrap MLflow's run-link printer once so the links it prints open in a browser.

    MLflow (3.17) prints them from ``TrackingServiceClient._log_url`` when a run ends and
    offers no hook; the wrapper lets it print, then rewrites the address. Any surprise in
    MLflow's internals leaves its own output untouched."""
    global _patched
    if _patched:
        return
    try:
        from mlflow.tracking._tracking_service.client import TrackingServiceClient
    except ImportError:
        return
    original = getattr(TrackingServiceClient, "_log_url", None)
    if original is None:
        return

    def _log_url(self, run_id, _original=original):
        import contextlib
        import io
        import sys

        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                _original(self, run_id)
        finally:
            sys.stdout.write(public_link(buf.getvalue()))

    TrackingServiceClient._log_url = _log_url
    _patched = True


class GpuhubRunContext:
    """Implements mlflow.tracking.context.abstract_context.RunContextProvider."""

    def __init__(self):
        self._ident = identity.current()
        enable_gpu_system_metrics(self._ident)
        if self._ident is not None:
            print_public_run_links()

    def in_context(self) -> bool:
        return self._ident is not None

    def tags(self) -> dict[str, str]:
        return tags_for(self._ident, gitinfo.state(), os.environ.get("JPY_SESSION_NAME") or None)
