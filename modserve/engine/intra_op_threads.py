"""Which thread owns torch's intra-op threads.

Every thread that runs a parallel CPU kernel gets an OpenMP team of its own, kept for the
thread's life. A second team on a machine with as many cores as one team has threads makes
GNU OpenMP (the runtime of torch's Linux wheels) stop spinning between parallel regions:
each of a step's many parallel kernels then waits for a sleeping thread to wake. A thread
that hands the model's work to another (the server's engine thread) gives its team up.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

_RUNTIMES = ("libgomp", "libiomp5", "libomp")  # GNU, Intel and LLVM OpenMP: each has omp_pause_resource_all


def loaded_openmp_runtimes() -> list[str]:
    """The OpenMP runtimes this process has loaded (paths; none where /proc is absent)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return []
    paths = {line.split()[-1] for line in maps.read_text().splitlines() if "/" in line}
    return sorted(p for p in paths if Path(p).name.startswith(_RUNTIMES) and ".so" in Path(p).name)


def release_intra_op_threads() -> None:
    """Free the calling thread's OpenMP team, if it has one; it makes a new one if it runs a
    parallel kernel again."""
    for path in loaded_openmp_runtimes():
        runtime = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        pause = getattr(runtime, "omp_pause_resource_all", None)  # OpenMP 5.0
        if pause is not None:
            pause(1)  # omp_pause_soft: the threads end, the settings stay
