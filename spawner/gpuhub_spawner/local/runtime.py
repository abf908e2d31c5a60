"""What a one-machine server or job runs in, for the ``gpuhub.runtime`` tag of its MLflow runs.

On one machine a server runs in the hub's own Python environment, not in the profile's
container image (that is what Kubernetes runs), so its runs must not claim the image.
"""

from __future__ import annotations

import sys


def one_machine_runtime() -> str:
    return f"one machine: Python {sys.version.split()[0]} at {sys.prefix}"
