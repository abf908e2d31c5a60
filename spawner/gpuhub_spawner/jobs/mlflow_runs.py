"""A job attempt's MLflow identity: its own short-lived token, and the runs it logged.

Each attempt gets a fresh token of the job's user, scoped to the MLflow service only and
revoked when the attempt ends, so a job's credential is never the user's long-lived one
and never outlives the work. The runs are then listed with that same token (the proxy's
per-user rules apply to it), by the ``gpuhub.job.*`` tags the attempt's environment set.
"""

from __future__ import annotations

import json
import logging
import time
from urllib.parse import quote

from . import records as R

log = logging.getLogger("JupyterHub.gpuhub.jobs")


def tracking_uri(env: dict) -> str | None:
    return env.get("GPUHUB_MLFLOW_TRACKING_URI") or None


def new_token(rec: R.JobRecord, env: dict, configured: dict) -> str | None:
    """A token of the job's own user, good only for the MLflow service, put into ``env``."""
    uri = tracking_uri(configured)
    if not uri:
        return None
    try:
        from jupyterhub.app import JupyterHub

        user = JupyterHub.instance().users[rec.user]
        service = uri.rstrip("/").rsplit("/services/", 1)[-1].split("/")[0] if "/services/" in uri else "mlflow"
        token = user.new_api_token(
            note=f"gpuhub {rec.id} attempt {len(rec.attempts)}",
            scopes=[f"access:services!service={service}"],
            expires_in=int(rec.time_limit + 3600) if rec.time_limit else None,
        )
    except Exception:  # noqa: BLE001 - MLflow then needs the user's own setup
        log.exception("Cannot make an MLflow token for %s", rec.id)
        return None
    env["JUPYTERHUB_API_TOKEN"] = token
    if "MLFLOW_TRACKING_TOKEN" in configured:  # images without gpuhub-notebook (token_env)
        env["MLFLOW_TRACKING_TOKEN"] = token
    return token


def revoke(token: str | None) -> None:
    if not token:
        return
    try:
        from jupyterhub import orm
        from jupyterhub.app import JupyterHub

        db = JupyterHub.instance().db
        found = orm.APIToken.find(db, token)
        if found is not None:
            db.delete(found)
            db.commit()
    except Exception:  # noqa: BLE001
        log.exception("Cannot revoke a job token")


def end_status(outcome: str | None) -> str:
    """MLflow's status for a run its attempt left RUNNING: the process was stopped (preempted,
    cancelled, time limit, memory: KILLED) or it died without MLflow ending the run (FAILED).
    A run of an attempt that exited 0 but never ended its run is FINISHED."""
    if outcome == "succeeded":
        return "FINISHED"
    if outcome in ("failed", None):
        return "FAILED"
    return "KILLED"


async def collect_runs(rec: R.JobRecord, att: R.Attempt, env: dict, token: str | None, outcome: str | None = None) -> None:
    """The MLflow runs this attempt logged (tag gpuhub.job.attempt), asked with its own token.

    A run still RUNNING once its process is gone would stay RUNNING forever in MLflow's UI
    (a killed process runs no ``atexit``): it is ended with ``end_status(outcome)``, at the
    attempt's end time, with the same token (so only the user's own runs)."""
    uri = tracking_uri(env)
    if not uri or not token:
        return
    from tornado.httpclient import AsyncHTTPClient

    client = AsyncHTTPClient()
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    experiment = env.get("MLFLOW_EXPERIMENT_NAME") or f"users/{rec.user}"
    try:
        r = await client.fetch(
            f"{uri}/api/2.0/mlflow/experiments/get-by-name?experiment_name={quote(experiment)}",
            headers=headers,
            raise_error=False,
            request_timeout=10,
        )
        if r.code != 200:
            return
        exp_id = json.loads(r.body)["experiment"]["experiment_id"]
        body = {
            "experiment_ids": [exp_id],
            "max_results": 100,
            "filter": f"tags.`gpuhub.job.id` = '{rec.id}' and tags.`gpuhub.job.attempt` = '{att.number}'",
        }
        r = await client.fetch(
            f"{uri}/api/2.0/mlflow/runs/search",
            method="POST",
            body=json.dumps(body),
            headers=headers,
            raise_error=False,
            request_timeout=10,
        )
        if r.code != 200:
            return
        runs = json.loads(r.body).get("runs", [])
        att.mlflow_run_ids = [run["info"]["run_id"] for run in runs]
        end_time = int((att.finished or time.time()) * 1000)
        for run in runs:
            if run["info"].get("status") != "RUNNING":
                continue
            update = {"run_id": run["info"]["run_id"], "status": end_status(outcome), "end_time": end_time}
            done = await client.fetch(
                f"{uri}/api/2.0/mlflow/runs/update",
                method="POST",
                body=json.dumps(update),
                headers=headers,
                raise_error=False,
                request_timeout=10,
            )
            if done.code != 200:
                log.warning("Cannot end MLflow run %s of %s: %s", update["run_id"], rec.id, done.code)
    except Exception:  # noqa: BLE001 - evidence is best effort here; the tags stay on the runs
        log.warning("Cannot list MLflow runs of %s attempt %d", rec.id, att.number, exc_info=True)
