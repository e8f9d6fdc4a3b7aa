"""``filesystem``: adapter ``NAME`` is the directory ``cache_dir/NAME`` (vLLM's lora_filesystem_resolver)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from modserve.api import LoRARequest, LoRAResolver

CACHE_DIR_ENV = "VLLM_LORA_RESOLVER_CACHE_DIR"  # vLLM's variable, read when cache_dir is unset
HF_SNAPSHOT = "snapshots"  # huggingface_hub's cache: models--ORG--NAME/snapshots/REVISION


class FilesystemOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cache_dir: str | None = Field(None, description=f"the adapters' directory; unset: ${CACHE_DIR_ENV}")


class FilesystemResolver(LoRAResolver):
    """An adapter directory under ``cache_dir`` named as the request names it, whose
    ``adapter_config.json`` is a LoRA of the served model (``base_model_name_or_path``)."""

    def __init__(self, options: FilesystemOptions | None = None) -> None:
        super().__init__(options)
        cache_dir = (options.cache_dir if options is not None else None) or os.environ.get(CACHE_DIR_ENV)
        if not cache_dir:
            raise ValueError(f"the filesystem LoRA resolver needs its cache_dir option or {CACHE_DIR_ENV}")
        if not os.path.isdir(cache_dir):
            raise ValueError(f"the filesystem LoRA resolver's cache_dir {cache_dir!r} is not a directory")
        self.root = Path(cache_dir).resolve()

    def resolve(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        path = self._inside(lora_name)
        if path is None or not (path / "adapter_config.json").is_file():
            return None
        try:
            config = json.loads((path / "adapter_config.json").read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"LoRA adapter {lora_name!r}: its adapter_config.json cannot be read ({e})") from None
        if config.get("peft_type") != "LORA":
            raise ValueError(f"LoRA adapter {lora_name!r} is a {config.get('peft_type')!r} adapter, not LORA")
        base = config.get("base_model_name_or_path")
        if not isinstance(base, str) or not same_model(base, base_model_name):
            raise ValueError(f"LoRA adapter {lora_name!r} was trained on base model {base!r}, not on the served "
                             f"model {base_model_name!r}")
        return LoRARequest(lora_name, 1, str(path))

    def _inside(self, lora_name: str) -> Path | None:
        """``cache_dir/lora_name`` where that stays inside ``cache_dir`` (no ``..``, no absolute path)."""
        if not lora_name or "\x00" in lora_name or os.path.isabs(lora_name):
            return None
        path = (self.root / lora_name).resolve()
        return path if path != self.root and path.is_relative_to(self.root) else None


def same_model(named: str, served: str) -> bool:
    """Whether an adapter's ``base_model_name_or_path`` names the served checkpoint: the same
    string, the same directory, or the Hugging Face id of the cache snapshot served."""
    if named == served:
        return True
    if os.path.isdir(named) and os.path.isdir(served):
        return os.path.samefile(named, served)
    snapshot = Path(served)
    repo = snapshot.parent.parent.name
    return snapshot.parent.name == HF_SNAPSHOT and repo.startswith("models--") \
        and repo[len("models--"):].replace("--", "/") == named
