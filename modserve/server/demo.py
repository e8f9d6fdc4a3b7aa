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
DEMO_DEFAULTS = {"served_model_name": DEMO_NAME, "kv_cache_memory_gb": "0.5"}
KV_SIZE_FIELDS = ("num_kv_blocks", "kv_cache_memory_gb", "kv_cache_memory_fraction")


def demo_cache_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("modserve")) / "demo"


def demo_model_dir() -> Path:
    """The demo checkpoint's directory, made now if this machine has none yet."""
    from modserve.testing import cached_checkpoint

    root = demo_cache_dir()
    if not any(root.glob(f"{DEMO_ARCH}-{DEMO_PRESET}-*")):
        logger.info("making the demo model (random weights, one time, ~10 s) under %s", root)
    return cached_checkpoint(DEMO_ARCH, DEMO_PRESET, cache_dir=root)
