"""Reads a Hugging Face checkpoint directory: config, weights, generation config. No network."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig

from modserve.core.config import EngineConfig
from modserve.runner.checkpoint import DTYPES, CheckpointReads, CheckpointTensor

logger = logging.getLogger("modserve")


def load_hf_config(model_dir: str | Path) -> Any:
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {path} has no config.json")
    return AutoConfig.from_pretrained(path, local_files_only=True)


def checkpoint_dtype(hf_config: Any) -> torch.dtype:
    """The dtype the checkpoint's config says its weights are stored in (float32 if unsaid)."""
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def weight_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's weight files: the sharded index if present, else every safetensors file."""
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        files = sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise ValueError(f"model directory {path} has no *.safetensors or pytorch_model*.bin weights")
    return files


def checkpoint_digest(model_dir: str | Path) -> str:
    """A short digest naming these weights: config.json, and each weight file's size and
    first and last MiB (two random-weight checkpoints of one shape differ there)."""
    digest = hashlib.sha256((Path(model_dir) / "config.json").read_bytes())
    for path in weight_files(model_dir):
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(1 << 20)
            f.seek(max(0, size - (1 << 20)))
            digest.update(f"{path.name}:{size}".encode() + head + f.read())
    return digest.hexdigest()[:16]


def iter_weights(model_dir: str | Path, progress: bool = True,
                 reads: CheckpointReads | None = None) -> Iterator[tuple[str, CheckpointTensor]]:
    """(name, handle) for every tensor of the checkpoint, one file at a time: a handle reads
    only the part its consumer narrows it to (:mod:`modserve.runner.checkpoint`), into
    ``reads``, which also gets the checkpoint's size in bytes of tensor data."""
    reads = reads if reads is not None else CheckpointReads()
    files = weight_files(model_dir)
    bar = tqdm(total=len(files), desc="Loading weights", unit="file", disable=not progress)
    for file in files:
        if file.suffix == ".safetensors":
            header = safetensors_header(file)
            reads.size += sum(end - start for start, end in (t["data_offsets"] for t in header.values()))
            source = safe_open(str(file), framework="pt")  # NOTE: open while any of its handles lives
            for name, t in header.items():
                yield name, CheckpointTensor(source, name, tuple(t["shape"]), DTYPES.get(t["dtype"]), reads)
        else:
            tensors = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            reads.size += sum(t.numel() * t.element_size() for t in tensors.values())
            for name, t in tensors.items():
                yield name, CheckpointTensor(t, name, tuple(t.shape), t.dtype, reads)
        bar.update(1)
    bar.close()


def safetensors_header(file: Path) -> dict[str, Any]:
    """A safetensors file's tensors: name -> {dtype, shape, data_offsets}, in the file's order."""
    size = file.stat().st_size
    with file.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if not 0 < length <= size - 8:  # a corrupt length must not size the read
            raise ValueError(f"{file}: not a safetensors file (a {length}-byte header in {size} bytes)")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise ValueError(f"{file}: not a safetensors file (its header is not JSON: {e})") from None
    header.pop("__metadata__", None)
    return dict(sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]))


def generation_eos_ids(model_dir: str | Path) -> set[int]:
    """EOS ids from generation_config.json (an int or a list), if the file exists."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return set()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


def resolve_max_model_len(config: EngineConfig, hf_config: Any) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True):
        # NOTE: the attention backends attend to the full context; past the window
        # that would differ from the model, so the context is capped at the window.
        if window < limit:
            logger.info("max_model_len capped at the sliding window (%d tokens)", window)
        limit = min(limit, window)
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit of {limit} tokens")
    return config.max_model_len
