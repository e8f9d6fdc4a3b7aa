"""The pooling runner (``runner: pooling``): one vector per prompt from the decoder's final
hidden states (final norm applied), without the LM head and without decode.

How a prompt is pooled comes from ``pooler_config``, else, as vLLM reads it, from a
sentence-transformers checkpoint (``modules.json``, its Pooling module's ``config.json``,
a Normalize module), else LAST and normalize for a decoder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from modserve.core.config import EngineConfig, PoolerConfig
from modserve.core.plugin_calls import calling
from modserve.runner.batch import build_batch
from modserve.runner.model_runner import ModelRunner

# sentence-transformers' Pooling modes -> vLLM's pooling types: its `pooling_mode` (since v6), or the flag keys before
ST_MODES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS", "pooling_mode_lasttoken": "LAST",
            "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
ST_MODULES = ("Transformer", "Pooling", "Normalize")  # what modserve runs; a Dense layer, say, it does not


@dataclass(frozen=True, slots=True)
class PoolerSpec:
    pooling_type: str  # LAST, MEAN or CLS
    normalize: bool
    matryoshka: bool  # the model says a vector's leading part is a vector too (``dimensions``)
    matryoshka_dimensions: tuple[int, ...] | None = None  # the only cuts it supports, if it names them


def sentence_transformers_pooling(model_dir: str | Path) -> dict[str, Any]:
    """``{pooling_type, normalize}`` of a sentence-transformers checkpoint; {} without ``modules.json``."""
    root = Path(model_dir)
    if not (root / "modules.json").is_file():
        return {}
    modules = json.loads((root / "modules.json").read_text())
    kinds = [m["type"].rpartition(".")[2] for m in modules]
    if unknown := sorted(set(kinds) - set(ST_MODULES)):
        raise ValueError(f"modules.json: sentence-transformers modules {unknown} are not supported "
                         f"(only {', '.join(ST_MODULES)})")
    found: dict[str, Any] = {"normalize": "Normalize" in kinds}
    for module, kind in zip(modules, kinds):
        if kind == "Pooling":
            config = json.loads((root / module["path"] / "config.json").read_text())
            on = [config["pooling_mode"]] if "pooling_mode" in config else \
                [k for k, v in config.items() if k.startswith("pooling_mode_") and v]
            if len(on) != 1 or on[0] not in ST_MODES:
                raise ValueError(f"{module['path']}/config.json: pooling modes {on} are not supported: one of "
                                 f"{sorted(ST_MODES)}")
            found["pooling_type"] = ST_MODES[on[0]]
    return found


def as_pooling_model(hf_config: Any) -> None:
    """The checkpoint's config as the pooling runner loads it: a bare ``*Model`` decoder (what
    sentence-transformers saves) is its ``*ForCausalLM``, and the LM head, never computed, is the
    embedding's (tied: no ``lm_head`` weights needed, any there are not read)."""
    archs = getattr(hf_config, "architectures", None) or []
    hf_config.architectures = [a.removesuffix("Model") + "ForCausalLM" if a.endswith("Model") else a for a in archs]
    hf_config.tie_word_embeddings = True


def resolve_pooler(config: EngineConfig, hf_config: Any) -> PoolerSpec:
    asked = config.pooler_config or PoolerConfig()
    st = sentence_transformers_pooling(config.model)
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return PoolerSpec(asked.pooling_type or st.get("pooling_type", "LAST"),
                      asked.normalize if asked.normalize is not None else st.get("normalize", True),
                      bool(getattr(hf_config, "is_matryoshka", False)) or dims is not None,
                      tuple(dims) if dims is not None else None)


def pooling_blocks(config: EngineConfig, max_model_len: int) -> int:
    """KV blocks for one batch of prompts (a pooling runner never decodes): the larger of the step
    budget and one whole prompt, plus a partly filled block per sequence."""
    return -(-max(config.max_num_batched_tokens, max_model_len) // config.block_size) + config.max_num_seqs


def check_dimensions(spec: PoolerSpec, dimensions: int | None) -> None:
    """ValueError, as vLLM's, for a ``dimensions`` this model does not support."""
    if dimensions is None:
        return
    if not spec.matryoshka:
        raise ValueError("dimensions is not supported: the model does not support matryoshka representation "
                         "(is_matryoshka or matryoshka_dimensions in its config.json), and cut vectors would be poor")
    if dimensions < 1:
        raise ValueError(f"dimensions must be at least 1, got {dimensions}")
    if spec.matryoshka_dimensions is not None and dimensions not in spec.matryoshka_dimensions:
        raise ValueError(f"dimensions must be one of the model's matryoshka_dimensions "
                         f"{list(spec.matryoshka_dimensions)}, got {dimensions}")


class PoolingRunner:
    """Runs prompts through a ModelRunner's model into the KV cache of ``pooling_blocks`` blocks,
    each batch from block 0 again (nothing is kept between batches), and pools each prompt."""

    def __init__(self, runner: ModelRunner, spec: PoolerSpec) -> None:
        self.runner, self.spec = runner, spec
        self.num_blocks = pooling_blocks(runner.config, runner.max_model_len)

    def embed(self, prompts: list[list[int]], normalize: bool | None = None,
              dimensions: int | None = None) -> list[torch.Tensor]:
        """Each prompt's vector, float32 on the CPU: pooled, cut to ``dimensions``, then
        normalized (``normalize`` None: the spec's)."""
        check_dimensions(self.spec, dimensions)
        vectors = [v for batch in self._batches(prompts) for v in self._pool(batch)]
        vectors = [v[:dimensions] for v in vectors] if dimensions else vectors
        if self.spec.normalize if normalize is None else normalize:
            vectors = [torch.nn.functional.normalize(v, dim=-1) for v in vectors]
        return vectors

    def _batches(self, prompts: list[list[int]]) -> list[list[list[int]]]:
        """Consecutive prompts, as many as fit the cache's blocks and ``max_num_seqs``."""
        batches: list[list[list[int]]] = []
        used, size = self.num_blocks, self.runner.block_size  # as if full: the first prompt opens a batch
        for ids in prompts:
            need = -(-len(ids) // size)
            if used + need > self.num_blocks or len(batches[-1]) == self.runner.config.max_num_seqs:
                batches.append([])
                used = 0
            batches[-1].append(ids)
            used += need
        return batches

    @torch.inference_mode()
    def _pool(self, batch: list[list[int]]) -> list[torch.Tensor]:
        runner, size, start, tables = self.runner, self.runner.block_size, 0, []
        for ids in batch:
            tables.append(list(range(start, start + -(-len(ids) // size))))
            start += len(tables[-1])
        input_ids, meta = build_batch(batch, [0] * len(batch), tables, size, runner.device)
        with calling(runner.attn, "attention_backend", "prepare()"):
            state = runner.attn.prepare(meta)
        hidden = runner.model(input_ids, meta.positions, runner.kv_caches, meta, state)  # [T, hidden], normed
        ends = meta.query_start_loc.tolist()
        rows = [hidden[a:b].float() for a, b in zip(ends, ends[1:])]  # [len, hidden] per prompt
        kind = self.spec.pooling_type
        pooled = [r[-1] if kind == "LAST" else r[0] if kind == "CLS" else r.mean(dim=0) for r in rows]
        return [v.cpu() for v in pooled]
