"""The built-in demo model: a random-weight Llama made locally on first use, then cached.

Its text is random (the weights are), but everything else is real: a trained
byte-level BPE tokenizer, a ChatML chat template, safetensors weights. It lets
``modserve serve`` run with no download and no arguments.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger("modserve.server")

DEMO_NAME = "modserve-demo"
# "small" (~88M parameters, 12 layers) takes ~10 s to make on 2 CPU cores and
# streams a few dozen tokens/s there: big enough to look like a model, quick to create.
DEMO_ARCH, DEMO_PRESET = "llama", "small"
# Defaults for flags the user did not give. 0.5 GiB of KV is ~21k tokens of this model:
# plenty for a demo, where the engine's usual 20% of free memory could be gigabytes to zero.
# compile off: `auto` would compile this model (336 MiB of float32 weights), which cost 46-86 s
# at a first start and ~10 s at every later one, for nothing measurable here: a float32
# checkpoint gets no 16-bit decode weights, and the C++ kernels and packed GEMMs run either
# way. Eager ran as fast (one thread, two alternating pairs of processes: 38 against 34-36
# tok/s single-stream, 155-175 against 144-161 at 8 sequences) with the same greedy tokens
# (8 prompts x 64 tokens). `--compile on` still compiles it.
DEMO_DEFAULTS = {"served_model_name": DEMO_NAME, "kv_cache_memory_gb": "0.5", "compile": "off"}
KV_SIZE_FIELDS = ("num_kv_blocks", "kv_cache_memory_gb", "kv_cache_memory_fraction")


def demo_cache_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("modserve")) / "demo"


def demo_model_dir() -> Path:
    """The demo checkpoint's directory, made now if this machine has none yet."""
    from modserve.testing import cached_checkpoint

    root = demo_cache_dir()
    made = any(root.glob(f"{DEMO_ARCH}-{DEMO_PRESET}-*"))
    log_start_plan(made)
    if not made:
        logger.info("making the demo model (random weights, one time, ~10 s) under %s", root)
    return cached_checkpoint(DEMO_ARCH, DEMO_PRESET, cache_dir=root)


def log_start_plan(model_made: bool) -> None:
    """One line before anything is made: what this start builds, and about how long it takes."""
    todo = [] if model_made else ["making the demo model (~10 s)"]
    if kernels := missing_kernels():
        todo.append(f"building {len(kernels)} C++ kernel{'s' * (len(kernels) > 1)} ({', '.join(kernels)}; "
                    "~10-20 s each on 2 cores)")
    if todo:
        logger.info("demo start: %s, once, then loading (~10 s); later starts take ~10 s", " and ".join(todo))
    else:
        logger.info("demo start: model and C++ kernels cached; serving in ~10 s on 2 cores")


def missing_kernels() -> list[str]:
    """The C++ kernels a CPU demo loads that are not built yet (their names as in the log)."""
    from modserve.api.cpp import build_directory
    from modserve.attention_backends.paged import DECODE_KERNEL
    from modserve.plugins.platforms.cpu.kernels import LINEAR_KERNELS

    kernels = {"modserve_paged_decode": DECODE_KERNEL, "modserve_cpu_kernels": LINEAR_KERNELS}
    return [name for name, source in kernels.items()
            if not (build_directory(name, str(source)) / f"{name}.so").exists()]
