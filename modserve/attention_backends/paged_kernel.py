"""Builds the paged backend's C++ decode kernel (``csrc/paged_decode.cpp``) on first use.

torch's ``cpp_extension`` compiles it with the machine's C++ compiler (the one inductor
uses) into its per-user cache, once per source version (~15 s on two cores); later
processes load the cached library in milliseconds. Where it cannot be built, the
backend says why once and attends in plain torch ops instead.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from pathlib import Path

import torch

logger = logging.getLogger("modserve")

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"


@functools.cache
def decode_kernel_problem() -> str | None:
    """None once ``torch.ops.modserve_paged.decode`` is loaded, else why it is not."""
    start = time.perf_counter()
    try:
        from torch.utils import cpp_extension

        if shutil.which("ninja") is None:  # the PyPI wheel's binary, when the venv is not on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

        # -fopenmp: at::parallel_for is inline OpenMP, so without it the kernel runs on one thread
        cpp_extension.load(name="modserve_paged_decode", sources=[str(SOURCE)], is_python_module=False,
                           extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
        torch.ops.modserve_paged.decode  # noqa: B018  (raises if the library registered nothing)
    except Exception as e:  # a missing compiler, ninja or headers: all mean the torch-ops path
        problem = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e}"
        logger.warning("paged attention: the C++ decode kernel could not be built (%s); decoding with "
                       "torch ops instead", problem)
        return problem
    logger.info("paged attention: C++ decode kernel loaded in %.1f s (a first build takes longer)",
                time.perf_counter() - start)
    return None
