"""A user's view of their jobs through the hub's API (docs/jobs.md), as the job tests read it."""

from __future__ import annotations

from support.hub import wait_for


def record(user, job_id: str) -> dict:
    """The job's record as its owner reads it (``GET /hub/api/gpuhub/jobs/ID``)."""
    r = user.api.get(user.url(f"/gpuhub/jobs/{job_id}"))
    r.raise_for_status()
    return r.json()


def wait_state(user, job_id: str, *states: str, timeout: float = 90) -> dict:
    """The record once the job is in one of ``states``; a failed wait names the states."""
    return wait_for(
        lambda: (rec := record(user, job_id))["state"] in states and rec, timeout, f"{job_id} to be {'/'.join(states)}"
    )


def logs(user, job_id: str) -> str:
    """The job's log (every attempt) as its owner reads it."""
    return user.api.get(user.url(f"/gpuhub/jobs/{job_id}/logs")).json()["text"]
