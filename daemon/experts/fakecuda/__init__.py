"""The fake CUDA device (ARCHITECTURE §9.2): the real CUDA code path on a CPU machine, with device
placement checked, device bytes counted against a simulated card and host syncs counted."""

from .accelerator import FakeCudaAccelerator
from .executor import FakeCpuExecutor, InlinePool
from .session import FakeCudaSession

__all__ = ["FakeCpuExecutor", "InlinePool", "FakeCudaAccelerator", "FakeCudaSession"]
