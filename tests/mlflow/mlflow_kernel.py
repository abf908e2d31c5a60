"""Kept for the MLflow tests' imports: the kernel client lives in ``support.kernel``."""

from support.kernel import KernelSession  # noqa: F401
