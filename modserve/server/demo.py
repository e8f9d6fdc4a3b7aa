"""The built-in demo model: a 5M-parameter Llama trained on the King James Bible, shipped
inside the package (modserve/server/demo_model/, made by scripts/train_demo_model.py).

Small enough to ship (10 MB of bfloat16) and to serve at once, with a real byte-level BPE
tokenizer and ChatML template; it writes verse-like English, not answers. Its 2-layer
draft (demo_model/draft) shares the tokenizer, for speculative decoding
(configs/demo-speculative.yaml). It lets ``modserve serve`` run with no download and no arguments.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

logger = logging.getLogger("modserve.server")

DEMO_NAME = "modserve-demo"
DEMO_ROOT = Path(__file__).parent / "demo_model"  # main/, draft/, heldout.txt, heldout_cloze.jsonl
# Defaults for flags the user did not give. 0.5 GiB of KV is plenty for a demo, where the
# engine's usual 20% of free memory could be gigabytes to zero.
# compile off: measured on the earlier 88M random-weight demo, compiling cost 46-86 s at a
# first start and ~10 s at every later one for no measurable speed-up; this model is smaller
# still. `--compile on` still compiles it.
DEMO_DEFAULTS = {"served_model_name": DEMO_NAME, "kv_cache_memory_gb": "0.5", "compile": "off"}
KV_SIZE_FIELDS = ("num_kv_blocks", "kv_cache_memory_gb", "kv_cache_memory_fraction")


def demo_model_dir() -> Path:
    """The shipped demo checkpoint's directory."""
    log_start_plan()
    return DEMO_ROOT / "main"


def demo_draft_dir() -> Path:
    """The demo model's draft (same tokenizer) for the draft_model proposer."""
    return DEMO_ROOT / "draft"


def log_start_plan() -> None:
    """One line before anything is built: what this start may build, and about how long it takes.
    NOTE: imports no torch (about a second), so the server's engine core starts that much sooner."""
    if kernels := missing_kernels():
        logger.info("demo start: C++ kernels not built yet: %s (a start builds those this CPU's routes use, "
                    "~10-20 s each on 2 cores, once), then loading (~10 s); later starts take ~10 s",
                    ", ".join(kernels))
    else:
        logger.info("demo start: C++ kernels cached; serving in ~10 s on 2 cores")


def missing_kernels() -> list[str]:
    """The C++ kernels a CPU demo loads that are not built yet (their names as in the log)."""
    from modserve.api.cpp import build_directory
    from modserve.attention_backends import DECODE_KERNEL
    from modserve.plugins.platforms.cpu.kernels import LINEAR_KERNELS

    kernels = {"modserve_paged_decode": DECODE_KERNEL, "modserve_cpu_kernels": LINEAR_KERNELS}
    return [name for name, source in kernels.items()
            if not (build_directory(name, str(source)) / f"{name}.so").exists()]


# vLLM's flags that size the KV cache: given one, the demo keeps its own KV size off.
VLLM_KV_SIZE_FLAGS = ("gpu_memory_utilization", "num_gpu_blocks_override", "kv_cache_memory_bytes")


def use_demo_model(args: argparse.Namespace) -> None:
    """Point ``args`` at the demo model, with its defaults for the flags the user did not give."""
    logger.info("no --config or model: using the demo model (built in, trained on the King James Bible)")
    args.cfg_model = str(demo_model_dir())
    sized = any(getattr(args, f"cfg_{name}", None) is not None for name in KV_SIZE_FIELDS) or \
        any(getattr(args, f"vllm_{name}", None) is not None for name in VLLM_KV_SIZE_FLAGS)
    for name, value in DEMO_DEFAULTS.items():
        if getattr(args, f"cfg_{name}") is None and not (sized and name in KV_SIZE_FIELDS):
            setattr(args, f"cfg_{name}", value)
