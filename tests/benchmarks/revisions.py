"""The package at another git revision, for the benchmarks' ``--before REV`` baselines."""

from __future__ import annotations

import subprocess
import tarfile
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def extract(rev: str, into: Path) -> Path:
    """``spawner/`` as it was at ``rev`` (``git archive``) under ``into``; put the returned path
    first on ``PYTHONPATH`` to run that version of the package."""
    tar = subprocess.run(["git", "-C", str(REPO), "archive", rev, "spawner"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    return into / "spawner"
