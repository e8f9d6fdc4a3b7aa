"""The ``hf`` baseline: transformers ``generate`` on static, left-padded batches.

This is how one serves a model without an engine: requests are cut into batches
of ``batch_size`` in workload order; each batch is left-padded to its longest
prompt and generates as many tokens as its longest request wants (EOS suppressed
until then), greedily. Throughput counts only the tokens each request asked for,
so the rows that wait for the batch's longest request are the baseline's cost.

:class:`HFRunner` runs it in a worker process of its own (:mod:`.hf_worker`, with as
many torch threads as modserve's), as the ``vllm`` baseline runs: in modserve's process
it would share what the engine sets process-wide, such as glibc's malloc thresholds
(:mod:`modserve.plugins.platforms.cpu.host_memory`), which made it 1-10% faster than a plain
transformers process is.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Sequence

import torch
from transformers import GenerationConfig

from modserve.bench.offline import Run
from modserve.bench.workloads import BenchRequest
from modserve.bench.worker_process import WorkerProcess


class HFRunner(WorkerProcess):
    """The baseline as the benchmark runs it: :class:`StaticBatches` in a worker process."""

    name = "hf"

    def __init__(self, model_dir: str, dtype: torch.dtype, batch_size: int = 16) -> None:
        settings = dict(model=str(model_dir), dtype=str(dtype).removeprefix("torch."), batch_size=batch_size,
                        threads=torch.get_num_threads())
        super().__init__([sys.executable, "-m", "modserve.bench.hf_worker", json.dumps(settings)], None,
                         "the transformers worker")
        try:
            self.receive()  # loaded
        except BaseException:
            self.close()
            raise

    def run(self, requests: Sequence[BenchRequest]) -> Run:
        reply = self.send({"cmd": "generate", "requests": [
            {"prompt_token_ids": list(r.prompt_token_ids), "output_len": r.output_len} for r in requests]})
        token_ids = reply["token_ids"]
        return Run(reply["wall"], sum(r.prompt_len for r in requests), sum(r.output_len for r in requests),
                   token_ids=token_ids)


class StaticBatches:
    """transformers ``generate`` over static batches, in this process."""

    def __init__(self, model_dir: str, dtype: torch.dtype, batch_size: int = 16) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True).eval()
        self.batch_size = batch_size
        gen = self.model.generation_config
        self.pad_id = gen.pad_token_id if gen.pad_token_id is not None else 0
        self.special_ids = dict(pad_token_id=self.pad_id, eos_token_id=gen.eos_token_id,
                                bos_token_id=gen.bos_token_id)

    @torch.inference_mode()
    def run(self, requests: Sequence[BenchRequest]) -> Run:
        token_ids: list[list[int]] = []
        start = time.perf_counter()
        for i in range(0, len(requests), self.batch_size):
            token_ids.extend(self._batch(requests[i : i + self.batch_size]))
        wall = time.perf_counter() - start
        return Run(wall, sum(r.prompt_len for r in requests), sum(r.output_len for r in requests),
                   token_ids=token_ids)

    def _batch(self, batch: Sequence[BenchRequest]) -> list[list[int]]:
        width = max(r.prompt_len for r in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.int64)  # [B, S]
        mask = torch.zeros((len(batch), width), dtype=torch.int64)  # [B, S]
        for row, r in enumerate(batch):
            input_ids[row, width - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
            mask[row, width - r.prompt_len :] = 1
        new = max(r.output_len for r in batch)
        config = GenerationConfig(do_sample=False, max_new_tokens=new, min_new_tokens=new, **self.special_ids)
        out = self.model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
        return [out[row, width : width + r.output_len].tolist() for row, r in enumerate(batch)]
