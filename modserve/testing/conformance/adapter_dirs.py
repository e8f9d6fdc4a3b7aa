"""The adapters the kit resolves: a directory of PEFT adapter configs, one of them of another
base model, and one beside the directory that no name may reach. No weights: a resolver finds
adapters, the engine reads them."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

KIT_BASE = "modserve-kit/base-model"  # the base model the kit's resolves ask for
ADAPTER = "kit-adapter"  # an adapter of KIT_BASE, in the directory
OTHER_BASE = "kit-other-base"  # an adapter of another model, in the directory
OUTSIDE = "kit-outside"  # an adapter of KIT_BASE beside the directory: out of every name's reach


@functools.cache
def kit_adapters() -> Path:
    """The directory (made once per process, removed at exit): ``ADAPTER`` and ``OTHER_BASE`` in
    it, ``../OUTSIDE`` beside it."""
    root = Path(tempfile.mkdtemp(prefix="modserve-kit-lora-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    for where, base in ((root / "adapters" / ADAPTER, KIT_BASE), (root / "adapters" / OTHER_BASE, "another/model"),
                        (root / OUTSIDE, KIT_BASE)):
        where.mkdir(parents=True)
        config = {"peft_type": "LORA", "base_model_name_or_path": base, "r": 4, "lora_alpha": 8,
                  "target_modules": ["q_proj", "v_proj"], "bias": "none"}
        (where / "adapter_config.json").write_text(json.dumps(config))
    return root / "adapters"
