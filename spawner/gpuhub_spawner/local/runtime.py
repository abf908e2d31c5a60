"""What a one-machine server or job runs in, for the ``gpuhub.runtime`` tag of its MLflow runs.

On one machine a server runs in the hub's own Python environment, not in the profile's
container image (that is what Kubernetes runs), so its runs must not claim the image. The tag
says what a person comparing runs needs (the versions that change results), not where the
environment lies on the hub's disk: a path tells a reader of the run nothing, and tells every
MLflow user the hub's layout.
"""

from __future__ import annotations

import sys
from importlib import metadata

# The distributions whose versions a run's results depend on, as a reader names them.
REPORTED = (
    ("gpuhub-spawner", "gpuhub"),
    ("mlflow", "mlflow"),
    ("torch", "torch"),
    ("tensorflow", "tensorflow"),
    ("jax", "jax"),
    ("ray", "ray"),
)


def one_machine_runtime() -> str:
    """``one machine (the hub's Python environment): Python 3.11.7, gpuhub 0.1.0, mlflow 3.1.0``."""
    parts = [f"Python {sys.version.split()[0]}"]
    for dist, name in REPORTED:
        try:
            parts.append(f"{name} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            continue
    return "one machine (the hub's Python environment): " + ", ".join(parts)
