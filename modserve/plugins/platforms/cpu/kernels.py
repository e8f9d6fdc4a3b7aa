"""The CPU platform's C++ kernels (``csrc/``), built on first use by :func:`modserve.api.load_kernel`."""

from __future__ import annotations

from pathlib import Path

from modserve.api.cpp import load_kernel

CSRC = Path(__file__).parent / "csrc"
LINEAR_KERNELS = CSRC / "bf16_linear.cpp"

__all__ = ["CSRC", "LINEAR_KERNELS", "bf16_linear_ready", "load_kernel"]


def bf16_linear_ready() -> bool:
    """Whether ``torch.ops.modserve_cpu.bf16_linear`` (few rows x bf16 weights) is loaded."""
    return load_kernel("modserve_cpu_kernels", str(LINEAR_KERNELS)) is None
