"""Ranks read only what they keep: bytes read from the checkpoint per rank at TP=2, PP=2, EP=2.

Two parts:

- In-process, no workers: every rank of each layout (TP=2, PP=2, TP=2 x PP=2, EP=2; MQA,
  tied embeddings, both expert layouts, AWQ, GPTQ act order) loaded as the engine loads it
  (``prepare_rank``, ``build_runner`` with that rank's ``TensorParallel`` / ``PipelineStage``:
  loading needs no process group), with safetensors' ``safe_open`` patched to count the bytes
  of every tensor and slice it returns. Each rank's count must stay within the bound computed
  here from the checkpoint's own header (its share of each tensor it splits, its stage's
  layers, its experts; whole only the tensors every rank keeps), and equal the loader's own
  count (``runner.checkpoint_reads``), which the engine logs per rank.
- End to end, the ``mp`` executor, one thread per rank: greedy tokens at TP=2, PP=2 and EP=2
  equal one rank's, rank 0 (in this process) read exactly what its in-process twin read, and
  rank 0 logged a line per rank (the others' counts gathered), each within that rank's bound.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from modserve import LLM, SamplingParams
from modserve.core.config import EngineConfig
from modserve.core.registry import get_registry
from modserve.runner import loader
from modserve.runner.build import build_runner, prepare_rank
from modserve.runner.checkpoint import CheckpointReads
from modserve.runner.parallel import PipelineStage, TensorParallel
from modserve.testing import cached_checkpoint, cached_quantized_checkpoint
from test_moe_models import to_fused_layout

N = 2
# name -> (how to get the checkpoint from the cache root, tp, pp, enable_expert_parallel)
LAYOUTS: dict[str, tuple[Any, int, int, bool]] = {
    "llama-tp2": (lambda root: cached_checkpoint("llama", cache_dir=root), N, 1, False),
    "llama-pp2": (lambda root: cached_checkpoint("llama", cache_dir=root), 1, N, False),
    "llama-tp2-pp2": (lambda root: cached_checkpoint("llama", cache_dir=root), N, N, False),
    "llama-mqa-tp2": (lambda root: cached_checkpoint("llama", cache_dir=root, num_key_value_heads=1), N, 1, False),
    "qwen2-tied-pp2": (lambda root: cached_checkpoint("qwen2", cache_dir=root), 1, N, False),
    "qwen2_moe-ep2": (lambda root: cached_checkpoint("qwen2_moe", cache_dir=root), N, 1, True),
    "mixtral-ep2": (lambda root: cached_checkpoint("mixtral", cache_dir=root), N, 1, True),
    "qwen2_moe-tp2": (lambda root: cached_checkpoint("qwen2_moe", cache_dir=root), N, 1, False),
    "mixtral-fused-ep2": (lambda root: fused_experts(root), N, 1, True),
    "mixtral-fused-tp2": (lambda root: fused_experts(root), N, 1, False),
    "awq-tp2": (lambda root: cached_quantized_checkpoint("awq", cache_dir=root), N, 1, False),
    "gptq-act-order-tp2": (lambda root: cached_quantized_checkpoint("gptq", cache_dir=root, desc_act=True),
                           N, 1, False),
}
ENGINE = dict(dtype="float32", num_threads=1, max_model_len=128, progress=False)


def fused_experts(root: str) -> Path:
    """Mixtral with transformers 5's fused 3-D expert tensors (``experts.gate_up_proj``
    ``[E, 2I, H]``): a rank reads its experts' rows (EP) or its share of each expert's (TP)."""
    out = Path(root, "mixtral-fused")
    return out if out.is_dir() else to_fused_layout(cached_checkpoint("mixtral", cache_dir=root), out)


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("sliced"))


# -- the bound, from the checkpoint's header ----------------------------------------------------
def header(path: str) -> dict[str, tuple[int, list[int]]]:
    """name (without ``model.``) -> (bytes, shape), from the safetensors header itself."""
    out = {}
    for file in Path(path).glob("*.safetensors"):
        with file.open("rb") as f:
            meta = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        meta.pop("__metadata__", None)
        out.update({name.removeprefix("model."): (t["data_offsets"][1] - t["data_offsets"][0], t["shape"])
                    for name, t in meta.items()})
    return out


def share(count: int, rank: int, ranks: int) -> tuple[int, int]:
    """(first, count) of ``count`` items over ``ranks``, the first ones one more when uneven."""
    base, extra = divmod(count, ranks)
    return rank * base + min(rank, extra), base + (rank < extra)


def tp_whole(name: str, cfg: Any, quant: dict[str, Any], tp: int) -> bool:
    """Tensors every tensor-parallel rank keeps whole: norms, the router and the shared-expert
    gate, row-parallel biases, KV projections with fewer KV heads than ranks, and (GPTQ with
    act order) every group's scales and zeros of a row-parallel layer, and g_idx of a
    column-parallel one."""
    leaf = name.rpartition(".")[2]
    module = name.rpartition(".")[0].rpartition(".")[2]
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    row = module in ("o_proj", "down_proj", "w2")
    return (name.endswith("norm.weight") or module in ("gate", "shared_expert_gate")
            or (row and leaf == "bias") or (module in ("k_proj", "v_proj") and kv_heads < tp)
            or (quant.get("desc_act") and ((row and leaf in ("scales", "qzeros")) or (not row and leaf == "g_idx"))))


def allowed_bytes(path: str, tp: int, pp: int, ep: bool, rank: int) -> int:
    """What global rank ``rank`` (tensor-parallel rank ``rank % tp`` of stage ``rank // tp``)
    may read: of its stage's layers and non-layer tensors, 1/tp of each tensor it splits, its
    experts, and whole the tensors every tensor-parallel rank keeps."""
    cfg = loader.load_hf_config(path)
    quant = getattr(cfg, "quantization_config", None) or {}
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    stage, tp_rank = divmod(rank, tp)
    first, count = share(cfg.num_hidden_layers, stage, pp)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0
    total = 0
    for name, (size, _) in header(path).items():
        layer = re.match(r"layers\.(\d+)\.", name)
        in_stage = (first <= int(layer[1]) < first + count if layer else
                    name.startswith("embed_tokens.") and (stage == 0 or tied and stage == pp - 1) or
                    name.startswith(("norm.", "lm_head.")) and stage == pp - 1)
        if not in_stage:
            continue
        if tp == 1:
            total += size
        elif ep and (m := re.search(r"\.experts\.(\d+)\.", name)):  # whole experts, this rank's
            lo, n = share(experts, tp_rank, tp)
            total += size if lo <= int(m[1]) < lo + n else 0
        elif ep and re.search(r"\.experts\.(gate_up_proj|down_proj)$", name):  # fused [E, ...]
            total += size * share(experts, tp_rank, tp)[1] // experts
        elif tp_whole(name, cfg, quant, tp):
            total += size
        else:
            total += -(-size // tp)
    return total


# -- counting what safetensors returns -------------------------------------------------------------
class Tally:
    def __init__(self) -> None:
        self.bytes = 0

    def add(self, t: Any) -> Any:
        self.bytes += t.numel() * t.element_size()
        return t


class CountingSlice:
    def __init__(self, real: Any, tally: Tally) -> None:
        self.real, self.tally = real, tally

    def __getitem__(self, key: Any) -> Any:
        return self.tally.add(self.real[key])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class CountingFile:
    """A real ``safe_open`` handle that counts the bytes of every tensor it hands out."""

    def __init__(self, real: Any, tally: Tally) -> None:
        self.real, self.tally = real, tally

    def get_tensor(self, name: str) -> Any:
        return self.tally.add(self.real.get_tensor(name))

    def get_slice(self, name: str) -> CountingSlice:
        return CountingSlice(self.real.get_slice(name), self.tally)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@pytest.fixture
def tally(monkeypatch) -> Tally:
    counted = Tally()
    real = loader.safe_open
    monkeypatch.setattr(loader, "safe_open", lambda *a, **k: CountingFile(real(*a, **k), counted))
    return counted


def load_rank(path: str, tp: int, pp: int, ep: bool, rank: int, tally: Tally) -> tuple[int, int, int]:
    """(bytes safetensors returned, bytes the loader counted, checkpoint size) for global rank
    ``rank`` loaded in this process."""
    config = EngineConfig(model=path, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                          enable_expert_parallel=ep, **{k: v for k, v in ENGINE.items() if k != "progress"})
    setup = prepare_rank(config, get_registry(), rank)
    before = tally.bytes
    runner = build_runner(setup, TensorParallel(rank % tp, tp), PipelineStage(rank // tp, pp, rank, tp))
    return tally.bytes - before, runner.checkpoint_reads.read, runner.checkpoint_reads.size


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_rank_reads_its_share_only(layout, cache_root, tally):
    make, tp, pp, ep = LAYOUTS[layout]
    path = str(make(cache_root))
    whole = sum(size for size, _ in header(path).values())
    for rank in range(tp * pp):
        returned, counted, size = load_rank(path, tp, pp, ep, rank, tally)
        bound = allowed_bytes(path, tp, pp, ep, rank)
        print(f"{layout} rank {rank}: read {returned} of {whole} bytes ({returned / whole:.1%}), bound {bound}")
        assert counted == returned, f"rank {rank}: the loader counted {counted} bytes, safetensors returned {returned}"
        assert size == whole
        assert returned <= bound, f"rank {rank} read {returned} bytes of {whole}; its share is at most {bound}"
        assert bound < whole  # the bound is a real one: below what reading everything costs


def test_one_rank_reads_the_whole_checkpoint_once(cache_root, tally):
    path = str(cached_checkpoint("qwen2_moe", cache_dir=cache_root))
    returned, counted, size = load_rank(path, 1, 1, False, 0, tally)
    assert returned == counted == size == sum(s for s, _ in header(path).values())


# -- end to end: tokens over two ranks, and what each read --------------------------------------------
E2E = {"llama-tp2": "llama", "llama-pp2": "llama", "qwen2_moe-ep2": "qwen2_moe"}


@pytest.fixture(scope="module")
def one_rank_tokens(cache_root) -> dict[str, list[list[int]]]:
    tokens = {}
    for arch in sorted(set(E2E.values())):
        llm = LLM(str(cached_checkpoint(arch, cache_dir=cache_root)), **ENGINE)
        try:
            tokens[arch] = generate(llm)
        finally:
            llm.engine.shutdown()
    return tokens


def generate(llm: LLM) -> list[list[int]]:
    prompts = [[5, 17, 300, 42, 9], [100, 200, 300], list(range(40, 70))]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("layout", E2E)
def test_two_ranks_read_their_share_and_give_one_ranks_tokens(layout, cache_root, one_rank_tokens, tally, caplog):
    make, tp, pp, ep = LAYOUTS[layout]
    path = str(make(cache_root))
    twin, _, _ = load_rank(path, tp, pp, ep, 0, tally)
    caplog.set_level(logging.INFO, logger="modserve")
    caplog.clear()
    llm = LLM(path, **ENGINE, tensor_parallel_size=tp, pipeline_parallel_size=pp, enable_expert_parallel=ep)
    try:
        assert generate(llm) == one_rank_tokens[E2E[layout]]
        assert llm.engine.runner.checkpoint_reads.read == twin  # rank 0 loads in this process
    finally:
        llm.engine.shutdown()
    logged = dict(re.findall(r"rank (\d+) read ([\d.]+) MiB of the checkpoint", caplog.text))
    assert sorted(logged) == [str(r) for r in range(tp * pp)], logged
    for rank, mib in logged.items():
        assert float(mib) <= allowed_bytes(path, tp, pp, ep, int(rank)) / 2**20 + 0.05


# -- the handle itself -------------------------------------------------------------------------
@pytest.mark.parametrize("ops", [
    lambda t: t.narrow(1, 2, 3), lambda t: t.narrow(2, 1, 4).narrow(1, 1, 2)[1], lambda t: t[-1, 1:4],
    lambda t: t[1:][0][2:100], lambda t: t.chunk(2, dim=1)[1][0], lambda t: t.chunk(3, dim=2)[-1],
    lambda t: t[:, 3], lambda t: t[0].narrow(0, 4, 0), lambda t: t.narrow(1, 1, 4).narrow(1, 2, 2),
    lambda t: t.chunk(2, dim=2)[1][1:][:, 1:].chunk(2, dim=2)[1]], ids=range(10))
def test_a_handle_reads_what_torch_would_give(tmp_path, ops):
    """Narrowing, indexing and chunking a handle, then reading it, gives what the same ops give
    on the whole tensor, and counts that many bytes."""
    whole = torch.arange(3 * 5 * 6, dtype=torch.float32).reshape(3, 5, 6)
    save_file({"w": whole}, str(tmp_path / "model.safetensors"))
    reads = CheckpointReads()
    (name, handle), = loader.iter_weights(tmp_path, progress=False, reads=reads)
    part, expected = ops(handle), ops(whole)
    assert (name, reads.read, reads.size) == ("w", 0, whole.numel() * 4)  # nothing read before read()
    assert part.shape == expected.shape
    got = part.read()
    assert torch.equal(got, expected) and reads.read == expected.numel() * 4
