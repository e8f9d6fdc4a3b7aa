"""Multi-LoRA: tokens and logits equal transformers + peft (float32), adapters mixed in one batch,
prefix caching kept apart per adapter, more adapters than slots."""

from __future__ import annotations

import pytest
import torch

from hf_oracle import PROMPTS
from lora_oracle import ALL, ATTN, make_adapter, peft_greedy
from modserve import LLM, LoRARequest, SamplingParams
from modserve.plugins.platforms.cpu.lora import CppLoRAKernel, lora_kernel_problem

MAX_NEW = 8
# (rank, targets, rslora) per adapter: several ranks and target sets, rsLoRA on one
ADAPTERS = [(8, ATTN, False), (4, ALL, True), (16, ["q_proj", "v_proj", "down_proj"], False)]


@pytest.fixture(scope="module")
def lora_setup(checkpoint_dir, tmp_path_factory):
    """Per arch: the base path, its prompts, the adapters and each one's (and the base's) HF tokens."""
    out = {}
    root = tmp_path_factory.mktemp("adapters")
    for arch in ("llama", "qwen2"):
        base = checkpoint_dir(arch)
        adapters = [make_adapter(base, root / f"{arch}-{i}", r, t, seed=i + 1, rslora=rs)
                    for i, (r, t, rs) in enumerate(ADAPTERS)]
        from transformers import AutoTokenizer
        ids = [AutoTokenizer.from_pretrained(base).encode(p) for p in PROMPTS[:4]]
        refs = {a: peft_greedy(base, a, ids, MAX_NEW) for a in [None, *adapters]}
        out[arch] = (base, ids, adapters, refs)
    return out


def _llm(base: str, **kw) -> LLM:
    return LLM(base, **{"dtype": "float32", "num_kv_blocks": 128, "progress": False, "enable_lora": True, **kw})


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mixed_batch_matches_peft(lora_setup, arch):
    """Prompt i runs under adapter i % 4 (the 4th: the base model), all in one batch."""
    base, ids, adapters, refs = lora_setup[arch]
    llm = _llm(base, max_loras=3, max_lora_rank=16)
    choices = [None, *adapters]
    requests = [None, *(LoRARequest(f"a{i}", i + 1, a) for i, a in enumerate(adapters))]
    prompts = [p for p in ids for _ in choices]
    loras = [r for _ in ids for r in requests]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    got = [o.outputs[0].token_ids for o in outs]
    want = [refs[c][0][i] for i in range(len(ids)) for c in choices]
    assert got == want
    assert refs[None][0] != refs[adapters[0]][0]  # the adapters change the tokens: a real check
    assert llm.engine.stats()["steps"] == MAX_NEW  # every adapter in the same steps
    if llm.engine.runner.device.type == "cpu" and lora_kernel_problem() is None:  # the cpu platform's C++ kernel
        assert all(isinstance(layer.kernel, CppLoRAKernel) for layer in llm.engine.runner.lora.layers.values())


def test_compiled_layers_match_peft(lora_setup):
    """compile: on: a layer is one graph, the update an opaque op reading each step's adapters
    eagerly; a batch of three adapters and the base model gives peft's tokens, and steps of other
    row mappings and batch sizes run the same graphs."""
    from torch._dynamo.utils import counters

    base, ids, adapters, refs = lora_setup["llama"]
    llm = _llm(base, max_loras=3, max_lora_rank=16, compile="on")
    assert llm.engine.runner.compiled
    requests = [None, *(LoRARequest(f"a{i}", i + 1, a) for i, a in enumerate(adapters))]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([p for p in ids for _ in requests], params, use_tqdm=False,
                        lora_request=[r for _ in ids for r in requests])
    assert [o.outputs[0].token_ids for o in outs] == [refs[c][0][i] for i in range(len(ids)) for c in [None, *adapters]]
    graphs = counters["stats"]["unique_graphs"]
    out = llm.generate(ids[:2], params, use_tqdm=False, lora_request=requests[2])  # other rows, another adapter
    assert [o.outputs[0].token_ids for o in out] == refs[adapters[1]][0][:2]
    assert counters["stats"]["unique_graphs"] == graphs, "a step of other adapters compiled again"


def test_prefill_logits_match_peft(lora_setup):
    """The prompt's logits under each adapter within 1e-4 of peft's (prompt_logprobs read them)."""
    base, ids, adapters, refs = lora_setup["llama"]
    llm = _llm(base, max_loras=3, max_lora_rank=16)
    runner = llm.engine.runner
    from modserve.runner.lora import LoRAStep, lora_mapping
    from modserve.runner.batch import build_batch

    for i, a in enumerate(adapters):
        p = ids[1]
        step = LoRAStep([LoRARequest(f"a{i}", i + 1, a)], [list(range(len(p)))], len(p))
        input_ids, meta = build_batch([p], [0], [[0, 1, 2, 3]], runner.block_size, runner.device)
        runner.allocate_kv_cache(8)
        with torch.inference_mode(), lora_mapping(runner.lora.activate(step)):
            logits = runner.model.compute_logits(runner._forward(input_ids, meta))
        torch.testing.assert_close(logits, refs[a][1][1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("allocator", ["paged", "radix"])
def test_prefix_cache_keeps_adapters_apart(lora_setup, allocator):
    """paged salts its block keys with the adapter, radix keeps a tree per adapter."""
    base, ids, adapters, refs = lora_setup["llama"]
    llm = _llm(base, max_loras=2, max_lora_rank=16, block_size=4, max_model_len=256, kv_allocator=allocator)
    shared = ids[3]  # a long prompt: several full blocks
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    a0, a1 = (LoRARequest(f"a{i}", i + 1, adapters[i]) for i in range(2))
    first = llm.generate([shared], params, use_tqdm=False, lora_request=a0)[0]
    second = llm.generate([shared], params, use_tqdm=False, lora_request=a1)[0]
    again = llm.generate([shared], params, use_tqdm=False, lora_request=a1)[0]
    assert first.outputs[0].token_ids == refs[adapters[0]][0][3]
    assert second.outputs[0].token_ids == refs[adapters[1]][0][3]
    assert second.num_cached_tokens == 0  # another adapter's blocks are not its
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == second.outputs[0].token_ids


def test_more_adapters_than_slots_all_complete(lora_setup):
    base, ids, adapters, refs = lora_setup["llama"]
    llm = _llm(base, max_loras=1, max_lora_rank=16, max_cpu_loras=2)
    requests = [LoRARequest(f"a{i}", i + 1, a) for i, a in enumerate(adapters)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([ids[0]] * 3 + [ids[1]], params, use_tqdm=False, lora_request=[*requests, None])
    assert [o.outputs[0].token_ids for o in outs] == [refs[a][0][0] for a in adapters] + [refs[None][0][1]]
    assert len(llm.engine.runner.lora.host) <= 2


def test_running_and_waiting_adapters_are_reported(lora_setup):
    """vLLM's lora_requests_info: with max_loras=1, the first adapter runs and the second waits;
    the engine's stats say so, replicas' stats join, and both metric namings render it."""
    from prometheus_client import CollectorRegistry, generate_latest

    from modserve.server.metrics import EngineStatsCollector
    from modserve.server.replicas import sum_stats

    base, ids, adapters, _ = lora_setup["llama"]
    llm = _llm(base, max_loras=1, max_lora_rank=16)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    assert engine.stats()["lora"] == {"max_lora": 1, "running": [], "waiting": []}
    for i, name in enumerate(("first", "second")):
        engine.add_request(f"r{i}", ids[0], params, lora_request=LoRARequest(name, i + 1, adapters[i]))
    engine.add_request("base", ids[1], params)
    assert engine.stats()["lora"] == {"max_lora": 1, "running": [], "waiting": ["first", "second"]}
    engine.step()
    stats = engine.stats()
    assert stats["lora"] == {"max_lora": 1, "running": ["first"], "waiting": ["second"]}
    other = {**stats, "lora": {"max_lora": 1, "running": ["third"], "waiting": []}}
    assert sum_stats([stats, other])["lora"] == {"max_lora": 1, "running": ["first", "third"], "waiting": ["second"]}
    registry = CollectorRegistry()
    metrics = EngineStatsCollector()
    metrics.stats = stats
    registry.register(metrics)
    text = generate_latest(registry).decode()
    assert 'modserve_lora_requests_info{max_lora="1",running_lora_adapters="first",' \
           'waiting_lora_adapters="second"}' in text
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["lora"] == {"max_lora": 1, "running": [], "waiting": []}
    assert "lora" not in LLM(base, dtype="float32", num_kv_blocks=128, progress=False).engine.stats()


def test_unusable_adapters_refused(lora_setup, tmp_path):
    base, ids, adapters, _ = lora_setup["llama"]
    llm = _llm(base, max_lora_rank=8)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="max_lora_rank=8"):  # adapter 2 has r=16
        llm.generate([ids[0]], params, use_tqdm=False, lora_request=LoRARequest("big", 3, adapters[2]))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate([ids[0]], params, use_tqdm=False, lora_request=LoRARequest("none", 4, str(tmp_path)))
    plain = LLM(base, dtype="float32", num_kv_blocks=128, progress=False)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate([ids[0]], params, use_tqdm=False, lora_request=LoRARequest("a", 1, adapters[0]))


def test_server_serves_adapters_by_name(lora_setup, tmp_path):
    """One real server: --lora-modules in both forms, /v1/models, adapter tokens equal peft's,
    load and unload at run time under load, unknown adapters 404."""
    import concurrent.futures

    import httpx
    import openai

    from server_process import serving

    base, ids, adapters, refs = lora_setup["llama"]
    llm = _llm(base, max_loras=3, max_lora_rank=16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    offline = {(a, i): llm.generate([ids[i]], params, use_tqdm=False,
                                    lora_request=a and LoRARequest(a, adapters.index(a) + 1, a))[0]
               for a in (None, *adapters) for i in (2, 3)}
    json_form = f'{{"name": "second", "path": "{adapters[1]}", "base_model_name": "tiny"}}'
    flags = ["--model", base, "--served-model-name", "tiny", "--dtype", "float32", "--num-kv-blocks", "128",
             "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "2",
             "--lora-modules", f"first={adapters[0]}", json_form]
    with serving(tmp_path, "lora", *flags, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as server:
        client = server.client()
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"tiny", "first", "second"}
        assert cards["first"].parent == "tiny" and cards["second"].parent == "tiny"

        def complete(model: str, prompt: list[int]) -> str:
            out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0.0,
                                            extra_body={"ignore_eos": True})
            assert out.model == model and out.usage.completion_tokens == MAX_NEW
            return out.choices[0].text

        def want(adapter: str | None, i: int) -> str:  # offline modserve's text, its tokens peft's
            out = offline[adapter, i].outputs[0]
            assert out.token_ids == refs[adapter][0][i]
            return out.text

        assert complete("first", ids[2]) == want(adapters[0], 2)
        assert complete("second", ids[2]) == want(adapters[1], 2)
        assert complete("tiny", ids[2]) == want(None, 2)
        assert len({want(a, 2) for a in (None, *adapters)}) == 4  # four different answers: a real check
        chat = client.chat.completions.create(model="first", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0.0)
        assert chat.model == "first" and chat.choices[0].message.content is not None

        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model="third", prompt="x", max_tokens=2)
        assert err.value.body["code"] == "model_not_found"
        # what runs on the base model only refuses an adapter rather than ignore it
        embed = httpx.post(f"{server.url}/v1/embeddings", json={"model": "first", "input": "x"})
        assert embed.status_code == 400 and embed.json()["error"]["param"] == "model"
        beams = httpx.post(f"{server.url}/v1/completions", json={"model": "first", "prompt": "x", "max_tokens": 2,
                                                                 "use_beam_search": True, "n": 2})
        assert beams.status_code == 400 and beams.json()["error"]["param"] == "use_beam_search"
        # load a third adapter while requests under the others run (max_loras=2: it waits for a slot)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            running = [pool.submit(complete, m, ids[3]) for m in ("first", "second", "tiny")]
            loaded = httpx.post(f"{server.url}/v1/load_lora_adapter",
                                json={"lora_name": "third", "lora_path": adapters[2]}, timeout=60)
            assert loaded.status_code == 200, loaded.text
            third = pool.submit(complete, "third", ids[3])
            assert [f.result() for f in running] == [want(a, 3) for a in (adapters[0], adapters[1], None)]
            assert third.result() == want(adapters[2], 3)
        again = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "third", "lora_path": adapters[2]})
        assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
        bad = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "third"}).status_code == 200
        assert "third" not in {m.id for m in client.models.list().data}
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="third", prompt="x", max_tokens=2)
        gone = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "third"})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "lora_adapter_not_found"


def test_what_lora_cannot_combine_with_is_refused(llama_dir):
    from modserve import EngineConfig

    with pytest.raises(ValueError, match="not with cuda_graph_sizes"):
        EngineConfig(model=llama_dir, enable_lora=True, cuda_graph_sizes=[1, 2])
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        EngineConfig(model=llama_dir, lora_modules=[{"name": "a", "path": "/a"}])
    from modserve.engine.scheduler import SchedulerCore
    from modserve.plugins.kv_allocators.radix import RadixAllocator, RadixOptions

    class OneTree(RadixAllocator):  # a caching allocator plugin that keeps adapters' KV together
        keys_by_adapter = False

    with pytest.raises(ValueError, match="OneTree does not keep adapters' prefix-cache blocks apart"):
        SchedulerCore(None, OneTree(16, 4, 64), None, "fcfs", max_loras=1)
    SchedulerCore(None, OneTree(16, 4, 64, RadixOptions(enable_prefix_caching=False)), None, "fcfs", max_loras=1)


def test_tensor_parallel_shards_adapters(lora_setup):
    """TP=2 (gloo): B split with the column-parallel outputs, A with the row-parallel inputs."""
    base, ids, adapters, refs = lora_setup["llama"]
    llm = _llm(base, max_loras=3, max_lora_rank=16, tensor_parallel_size=2, num_threads=1)
    try:
        requests = [None, *(LoRARequest(f"a{i}", i + 1, a) for i, a in enumerate(adapters))]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        outs = llm.generate([ids[1]] * 4, params, use_tqdm=False, lora_request=requests)
        assert [o.outputs[0].token_ids for o in outs] == [refs[a][0][1] for a in (None, *adapters)]
    finally:
        llm.engine.shutdown()


def test_pipeline_stages_apply_their_layers_adapters(lora_setup):
    """PP=2 (gloo), batches in flight, prefills cut in two micro-batches: each stage applies its
    own layers' adapters to the rows of each micro-batch (the step's row map, renumbered)."""
    base, ids, adapters, refs = lora_setup["llama"]
    llm = _llm(base, max_loras=3, max_lora_rank=16, pipeline_parallel_size=2, pipeline_micro_batches=2,
               num_threads=1)
    try:
        requests = [None, *(LoRARequest(f"a{i}", i + 1, a) for i, a in enumerate(adapters))]
        prompts = [p for p in ids for _ in requests]
        loras = [r for _ in ids for r in requests]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        assert [o.outputs[0].token_ids for o in outs] == \
            [refs[c][0][i] for i in range(len(ids)) for c in (None, *adapters)]
    finally:
        llm.engine.shutdown()


def test_the_platform_fills_the_lora_kernel_seam(lora_setup, monkeypatch):
    """A platform's lora_kernel() is what the linears call: here a counting wrapper of the reference."""
    from modserve.plugins.platforms.cpu.platform import CpuPlatform
    from modserve.runner.lora import TorchLoRAKernel

    class Counting(TorchLoRAKernel):
        calls = 0

        def add(self, y, x, a, b, scaling, mapping) -> None:
            Counting.calls += 1
            super().add(y, x, a, b, scaling, mapping)

    monkeypatch.setattr(CpuPlatform, "lora_kernel", lambda self: Counting())
    base, ids, adapters, refs = lora_setup["llama"]
    llm = _llm(base)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    out = llm.generate([ids[0]], params, use_tqdm=False, lora_request=LoRARequest("a", 1, adapters[0]))[0]
    assert out.outputs[0].token_ids == refs[adapters[0]][0][0]
    assert Counting.calls == MAX_NEW * 2 * 4  # every step, 2 layers x 4 projections


def test_an_int8_base_gets_the_same_update(lora_setup):
    """Under a quantizer the layer's output moves by exactly the adapter's update, slice by slice."""
    from modserve.runner.lora import LoRAStep, lora_mapping

    base, _, adapters, _ = lora_setup["llama"]
    llm = _llm(base, quantization="int8", max_lora_rank=16)
    runner = llm.engine.runner
    request = LoRARequest("all", 2, adapters[1])  # every projection, rsLoRA
    mapping = runner.lora.activate(LoRAStep([request], [[0, 2]], 3))  # rows 0 and 2; row 1: the base
    adapter = runner.lora.adapter(request)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    for module, (a, b) in adapter.weights.items():
        if not module.startswith("layers.0."):
            continue
        target, shard = runner.model.locate(module)
        layer = dict(runner.model.named_modules())[target]
        assert type(layer.quantizer).__name__ == "Int8"
        inputs = x if layer.spec.in_features == 64 else torch.randn(3, layer.spec.in_features)
        with torch.inference_mode():
            plain = layer(inputs)
            with lora_mapping(mapping):
                lifted = layer(inputs)
        start, size = layer.spec.shard_offset(shard), layer.spec.shard_sizes[shard]
        want = (inputs @ a.T) @ b.T * adapter.scaling  # [3, out_i]
        torch.testing.assert_close((lifted - plain)[[0, 2], start:start + size], want[[0, 2]], atol=1e-5, rtol=1e-5)
        assert torch.equal(lifted[1], plain[1])  # a row of no adapter is the base's, bit for bit


def test_server_resolves_adapters_by_name(lora_setup, tmp_path):
    """One real server with the filesystem resolver, its directory from VLLM_LORA_RESOLVER_CACHE_DIR
    (vLLM's): an adapter first named by three concurrent requests loads once and gives peft's
    tokens; a name not in the directory is a 404; another base model's adapter a 400 saying so."""
    import concurrent.futures
    import shutil

    import httpx
    import openai

    from server_process import serving

    base, ids, adapters, refs = lora_setup["llama"]
    cache = tmp_path / "adapters"
    shutil.copytree(adapters[1], cache / "found")
    shutil.copytree(lora_setup["qwen2"][2][0], cache / "qwen-lora")  # trained on the qwen2 checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    offline = _llm(base, max_lora_rank=16).generate([ids[2]], params, use_tqdm=False,
                                                    lora_request=LoRARequest("found", 1, adapters[1]))[0].outputs[0]
    assert offline.token_ids == refs[adapters[1]][0][2] != refs[None][0][2]
    flags = ["--model", base, "--served-model-name", "tiny", "--dtype", "float32", "--num-kv-blocks", "128",
             "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--lora-resolvers", "filesystem"]
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_LORA_RESOLVER_CACHE_DIR": str(cache)}
    with serving(tmp_path, "resolver", *flags, env=env) as server:
        client = server.client()
        assert [m.id for m in client.models.list().data] == ["tiny"]

        def complete(model: str) -> str:
            out = client.completions.create(model=model, prompt=ids[2], max_tokens=MAX_NEW, temperature=0.0,
                                            extra_body={"ignore_eos": True})
            assert out.model == model
            return out.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            assert list(pool.map(complete, ["found"] * 3)) == [offline.text] * 3
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"tiny", "found"} and cards["found"].parent == "tiny"
        assert server.log.read_text().count("LoRA adapter 'found' resolved by") == 1  # loaded once
        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model="missing", prompt="x", max_tokens=2)
        assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
        refused = httpx.post(f"{server.url}/v1/chat/completions",
                             json={"model": "qwen-lora", "messages": [{"role": "user", "content": "hi"}]})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "model" and error["type"] == "invalid_request_error"
        assert f"trained on base model {lora_setup['qwen2'][0]!r}, not on the served model" in error["message"]
        assert "qwen-lora" not in {m.id for m in client.models.list().data}


def _peft_update_hooks(model: torch.nn.Module, adapter_dir: str) -> list:
    """Forward hooks that add PEFT's update ``(x @ A.T) @ B.T * scaling`` to each target's output
    slice, from adapter_config.json and adapter_model.safetensors read here (not by modserve's
    loader). The model's own ``locate`` says which fused linear and slice a module is."""
    import json
    import math
    from pathlib import Path

    from safetensors.torch import load_file

    cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    scaling = cfg["lora_alpha"] / (math.sqrt(cfg["r"]) if cfg.get("use_rslora") else cfg["r"])
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(Path(adapter_dir) / "adapter_model.safetensors")).items():
        module, kind = key.removeprefix("base_model.model.model.").split(".lora_")
        pairs.setdefault(module, {})[kind[0]] = tensor
    layers, by_target = dict(model.named_modules()), {}
    for module, pair in pairs.items():
        target, shard = model.locate(module)
        by_target.setdefault(target, []).append((shard, pair["A"], pair["B"]))

    def hook(layer, inputs, out):  # out [T, sum(out_i)], inputs[0] [T, in]
        out = out.clone()
        for shard, a, b in by_target[layer.hook_name]:
            start, size = layer.spec.shard_offset(shard), layer.spec.shard_sizes[shard]
            out[:, start:start + size] += (inputs[0] @ a.T) @ b.T * scaling  # [T, r] -> [T, out_i]
        return out

    handles = []
    for target in by_target:
        layers[target].hook_name = target
        handles.append(layers[target].register_forward_hook(hook))
    return handles


@pytest.mark.parametrize("method, quantizer", [("awq", "AWQ"), ("gptq", "GPTQ"), ("fp8", "FP8Weights")])
def test_a_quantized_base_gets_the_peft_update(lora_setup, method, quantizer):
    """AWQ (4-bit, group 32), GPTQ (4-bit, desc_act) or fp8 base weights, three adapters and the
    base model in one batch. The oracle: the same quantized model with no adapter loaded, whose
    linears add PEFT's update computed in torch from the adapter's files (hooks); each adapter's
    greedy tokens must be the oracle's. (On the float base the same hooks give peft's tokens:
    test_the_update_hooks_are_peft.)"""
    from pathlib import Path

    from modserve.testing import cached_quantized_checkpoint

    base, ids, adapters, refs = lora_setup["llama"]
    if method == "fp8":  # quantized at load from the float checkpoint
        checkpoint, quant = base, {"quantization": "fp8"}
    else:  # a checkpoint of this very base
        quant = {"desc_act": True} if method == "gptq" else {}
        checkpoint, quant = str(cached_quantized_checkpoint(method, cache_dir=Path(base).parent, **quant)), {}
    llm = _llm(checkpoint, max_loras=3, max_lora_rank=16, **quant)
    assert type(llm.engine.runner.quantizer).__name__ == quantizer
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    requests = [None, *(LoRARequest(f"a{i}", i + 1, a) for i, a in enumerate(adapters))]
    outs = llm.generate([p for p in ids for _ in requests], params, use_tqdm=False,
                        lora_request=[r for _ in ids for r in requests])
    got = {(i, j): o.outputs[0].token_ids for i, o in enumerate(outs) for i, j in [divmod(i, len(requests))]}
    # NOTE: its own engine, no prefix cache: KV computed under one adapter's hooks is no other's
    oracle = _llm(checkpoint, max_lora_rank=16, kv_allocator={"name": "paged", "options": {"enable_prefix_caching": False}},
                  **quant)
    model = oracle.engine.runner.model
    for j, adapter in enumerate([None, *adapters]):
        handles = _peft_update_hooks(model, adapter) if adapter else []
        try:
            want = [o.outputs[0].token_ids for o in oracle.generate(ids, params, use_tqdm=False)]
        finally:
            for h in handles:
                h.remove()
        assert [got[i, j] for i in range(len(ids))] == want, f"adapter {j}"
    assert len({tuple(got[0, j]) for j in range(len(requests))}) == len(requests)  # each adapter tells
    assert [got[i, 0] for i in range(len(ids))] != refs[None][0]  # quantized weights: not the float model's


def test_the_update_hooks_are_peft(lora_setup):
    """The AWQ test's oracle is sound: on the float base, the hooks give transformers + peft's tokens."""
    base, ids, adapters, refs = lora_setup["llama"]
    oracle = _llm(base, max_lora_rank=16, kv_allocator={"name": "paged", "options": {"enable_prefix_caching": False}})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for adapter in adapters:
        handles = _peft_update_hooks(oracle.engine.runner.model, adapter)
        try:
            assert [o.outputs[0].token_ids for o in oracle.generate(ids, params, use_tqdm=False)] == refs[adapter][0]
        finally:
            for h in handles:
                h.remove()
