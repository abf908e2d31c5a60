"""Send this server's hub token to the hub's MLflow service, and only there.

The hub sets ``GPUHUB_MLFLOW_TRACKING_URI`` (and ``MLFLOW_TRACKING_URI``) to its
MLflow service. When MLflow talks to exactly that URI and no MLflow credential is
configured, requests carry ``Authorization: Bearer $JUPYTERHUB_API_TOKEN`` - the
token the hub already gave this server, scoped to this user and to the service.
If the user points MLflow elsewhere, the token is not sent.
"""

from __future__ import annotations

import os


def _norm(uri: str) -> str:
    return uri.rstrip("/")


def hub_token_for(tracking_uri: str, environ=None) -> str | None:
    env = os.environ if environ is None else environ
    target = env.get("GPUHUB_MLFLOW_TRACKING_URI")
    token = env.get("JUPYTERHUB_API_TOKEN")
    if not target or not token or _norm(tracking_uri) != _norm(target):
        return None
    if env.get("MLFLOW_TRACKING_TOKEN") or env.get("MLFLOW_TRACKING_USERNAME"):
        return None  # the user configured their own credentials: MLflow sends those
    return token


class HubTokenHeaderProvider:
    """Implements MLflow's RequestHeaderProvider (in_context, request_headers); no base
    class import, so loading it while ``import mlflow`` runs cannot cycle."""

    def _token(self) -> str | None:
        import mlflow

        return hub_token_for(mlflow.get_tracking_uri())

    def in_context(self) -> bool:
        return self._token() is not None

    def request_headers(self) -> dict[str, str]:
        token = self._token()
        return {"Authorization": f"Bearer {token}"} if token else {}
