"""What a rank settles before it loads its shard (modserve/runner/build.py), and the device
questions its platform answers: where each rank runs, where its KV cache lives."""

from __future__ import annotations

import torch

from modserve.core.config import EngineConfig
from modserve.core.registry import Registry
from modserve.plugins.platforms.cpu.platform import CpuPlatform
from modserve.plugins.platforms.cuda.platform import CudaPlatform
from modserve.runner.build import prepare_rank


def builtin_registry() -> Registry:
    registry = Registry()
    registry.load_entrypoints({"modserve"})
    return registry


def test_gpu_ranks_take_one_gpu_each_unless_the_device_names_one_and_cpu_ranks_share_it():
    assert CudaPlatform(torch.device("cuda")).device_for_rank(3) == torch.device("cuda", 3)
    assert CudaPlatform(torch.device("cuda:1")).device_for_rank(3) == torch.device("cuda", 1)
    assert CpuPlatform(torch.device("cpu")).device_for_rank(3) == torch.device("cpu")


def test_a_cpu_kv_cache_is_host_memory_and_a_gpu_pins_its_swap_space():
    cpu, cuda = CpuPlatform(torch.device("cpu")), CudaPlatform(torch.device("cuda"))
    assert (cpu.shares_host_memory(), cpu.pin_memory()) == (True, False)
    assert (cuda.shares_host_memory(), cuda.pin_memory()) == (False, True)


def test_a_worker_of_a_gpu_engine_makes_its_platform_on_its_own_gpu(llama_dir):
    """No GPU needed: nothing before the weights touches the device."""
    config = EngineConfig(model=llama_dir, device="cuda", tensor_parallel_size=4, dtype="float32")
    worker = prepare_rank(config, builtin_registry(), rank=2)
    assert worker.platform.device == torch.device("cuda", 2) and worker.config.device == "cuda:2"
    rank0 = prepare_rank(config, builtin_registry())
    assert rank0.platform.device == torch.device("cuda") and rank0.config is config and config.device == "cuda"
    assert (worker.dtype, worker.max_model_len) == (rank0.dtype, rank0.max_model_len)
