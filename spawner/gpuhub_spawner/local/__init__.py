"""The one-machine backend: local processes, NVML (or virtual) GPUs, in-hub admission."""
