"""Each data-parallel rank's config: its seed, rendezvous port, device and share of the memory.

NOTE: imports neither torch nor the engine: ``modserve serve`` computes its ranks' configs and
starts their cores before its own heavy imports (server/core_launch.py).
"""

from __future__ import annotations

from modserve.core.config import EngineConfig


def replica_config(config: EngineConfig, index: int) -> EngineConfig:
    """Replica ``index``'s config: ``config`` with its own sampling seed (seed + index: unseeded
    requests on two replicas must not draw the same numbers), its own device when ``device``
    is a bare ``cuda`` (replica i on ``cuda:i``), and on one shared memory (CPU, or a device
    with an index, which every replica then shares) 1/N of ``kv_cache_memory_fraction``.
    ``kv_cache_memory_gb`` and ``num_kv_blocks`` are each engine's own already: kept."""
    n = config.data_parallel_size
    replica = config.model_copy(deep=True)
    replica.seed = config.seed + index
    if config.master_port is not None:  # each replica's ranks rendezvous on a port of their own
        replica.master_port = config.master_port + index
    if spreads_over_devices(config):
        if config.tensor_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 with tensor_parallel_size > 1 on device cuda needs each "
                             "replica's ranks on devices of their own, which the tensor-parallel workers cannot "
                             "place yet; give device cuda:K to put every replica on device K")
        replica.device = f"cuda:{index}"
    elif not (config.num_kv_blocks or config.kv_cache_memory_gb):
        replica.kv_cache_memory_fraction = config.kv_cache_memory_fraction / n
    return replica


def spreads_over_devices(config: EngineConfig) -> bool:
    """A bare ``cuda`` device: each replica gets a device of its own (one memory each)."""
    return config.device == "cuda"


def replica_configs(config: EngineConfig) -> list[EngineConfig]:
    """Each data-parallel rank's config (one per engine-core process)."""
    n = config.data_parallel_size
    return [config] if n == 1 else [replica_config(config, i) for i in range(n)]
