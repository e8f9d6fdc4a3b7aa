"""How many KV blocks the cache gets: a count, a size, or a share of the memory left once the
weights are loaded; and how many host blocks swap preemption gets."""

from __future__ import annotations

import logging

from modserve.core.config import EngineConfig
from modserve.runner.model_runner import ModelRunner
from modserve.runner.pooling import pooling_blocks

logger = logging.getLogger("modserve")


def kv_cache_blocks(config: EngineConfig, runner: ModelRunner) -> int:
    """Blocks per rank; a ValueError naming the setting when they cannot hold max_model_len."""
    per_block = runner.kv_bytes_per_block()
    if config.runner == "pooling":  # one batch of prompts, never a decode: no share of the memory
        blocks, field = pooling_blocks(config, runner.max_model_len), "runner"
    elif config.num_kv_blocks:
        blocks, field = config.num_kv_blocks, "num_kv_blocks"
    elif config.kv_cache_memory_gb:
        blocks, field = int(config.kv_cache_memory_gb * 2**30 // per_block), "kv_cache_memory_gb"
    else:
        budget = config.kv_cache_memory_fraction * runner.platform.available_memory()
        if runner.platform.shares_host_memory():
            budget /= config.world_size  # every rank's cache in this one memory
        blocks, field = int(budget // per_block), "kv_cache_memory_fraction"
    if blocks * config.block_size < runner.max_model_len:
        raise ValueError(
            f"{field}: the KV cache holds {blocks * config.block_size} tokens, fewer than "
            f"max_model_len={runner.max_model_len}; give it more memory or lower max_model_len"
        )
    logger.info("KV cache: %d blocks x %d tokens = %.3f GiB (%s)", blocks, config.block_size,
                blocks * per_block / 2**30, str(runner.attn_spec.kv_cache_dtype).removeprefix("torch."))
    return blocks


def swap_blocks(config: EngineConfig, runner: ModelRunner) -> int:
    """Host blocks for swap preemption: none unless preemption_mode is swap."""
    if config.preemption_mode != "swap":
        return 0
    if config.num_swap_blocks is not None:
        return config.num_swap_blocks
    return int(config.swap_space_gb * 2**30 // runner.kv_bytes_per_block())
