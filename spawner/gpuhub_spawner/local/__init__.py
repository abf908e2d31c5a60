"""The one-machine backend: local processes, NVML (or virtual) GPUs, in-hub admission
(``broker``: the admission view), the spawner, batch jobs (``job_manager``, ``job_launcher``).
Never imports ``kube/`` (tests/unit/test_architecture.py)."""
