"""C++ CPU kernels, built on first use, for any plugin that ships one.

torch's ``cpp_extension`` compiles a kernel's source with the machine's C++ compiler (the
one inductor uses) into its per-user cache, once per source version (~15 s on two
cores); later processes load the cached library in a fraction of a second. A kernel
registers its ops with ``TORCH_LIBRARY``. Where one cannot be built (no compiler, no
ninja), :func:`load_kernel` says why once and the caller keeps its torch-ops path.

``-march=native``: a kernel is built for the machine that runs it (AVX2/FMA where there
are); ``-fopenmp``: ``at::parallel_for`` is inline OpenMP, so without it a kernel runs
on one thread. ``csrc/`` here is on every kernel's include path, so any kernel may
``#include "claims.h"`` (work split by atomic claims instead of a static partition) or
``row_passes.h`` (the few-row kernels' passes over a weight matrix).

Each build lives in its own folder under ``$MODSERVE_CACHE`` (default
``~/.cache/modserve``)``/kernels``, named by a hash of the source's path and text, the
headers, the flags, torch's version, the interpreter and the CPU's model and flags: two
checkouts or venvs never rebuild each other's kernels, a changed source never loads a stale
library, and a cache carried to another CPU (a disk image, a home directory on shared
storage) never loads code built for instructions this one lacks.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger("modserve")

INCLUDE = Path(__file__).parent / "csrc"
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)


def cpu_identity() -> bytes:
    """What ``-march=native`` builds for: the CPU's model name and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return b"unknown CPU"
    first = {}
    for line in lines:
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    return f"{first.get('model name', '')}|{first.get('flags', '')}".encode()


def build_directory(name: str, source: str) -> Path:
    """The cache folder of this exact build: same source file (path and text), headers, flags,
    torch, Python and CPU. The path counts because ninja's build file names the source by it:
    two checkouts sharing one folder would each rebuild the other's library on every switch."""
    digest = hashlib.sha256()
    code = Path(source).read_bytes() if Path(source).is_file() else source.encode()  # missing: the build says so
    for part in (code, str(Path(source).resolve()).encode(), *(h.read_bytes() for h in sorted(INCLUDE.glob("*.h"))),
                 " ".join(CFLAGS + LDFLAGS).encode(), torch_version().encode(), sys.executable.encode(),
                 sys.version.encode(), cpu_identity()):
        digest.update(part)
    root = Path(os.environ.get("MODSERVE_CACHE", Path.home() / ".cache" / "modserve"))
    return root / "kernels" / f"{name}-{digest.hexdigest()[:16]}"


def torch_version() -> str:
    """torch's version from its package metadata: a kernel's cache folder is found without
    importing torch (the demo's start plan runs before the server's imports)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path: no metadata
        import torch

        return torch.__version__


def op_by_name(qualified: str) -> Callable[..., Any]:
    """The registered op ``"namespace::name"`` (what ``Quantizer.native_op`` and
    ``AttentionBackend.native_decode`` name), callable from Python: ``torch.ops.namespace.name``."""
    import torch

    namespace, _, name = qualified.partition("::")
    return getattr(getattr(torch.ops, namespace), name)


@functools.cache
def load_kernel(name: str, source: str) -> str | None:
    """Build (or load from the cache) library ``name`` from ``source``; None once its ops
    are registered, else why not (logged as a warning)."""
    start = time.perf_counter()
    try:
        from torch.utils import cpp_extension

        if shutil.which("ninja") is None:  # the PyPI wheel's binary, when the venv is not on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        folder = build_directory(name, source)
        if not (folder / f"{name}.so").exists():
            logger.info("building C++ kernel %s (once per source version; ~20 s on 2 cores) in %s", name, folder)
        folder.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name=name, sources=[source], is_python_module=False, extra_include_paths=[str(INCLUDE)],
                           extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), build_directory=str(folder))
    except Exception as e:  # a missing compiler, ninja or headers: all mean the torch-ops path
        text = str(e).strip()
        last_line = text.splitlines()[-1] if text else repr(e)
        problem = f"{type(e).__name__}: {last_line}"
        logger.warning("C++ kernel %s could not be built (%s); using torch ops instead", name, problem)
        return problem
    logger.info("C++ kernel %s loaded in %.1f s (a first build takes longer)", name, time.perf_counter() - start)
    return None
