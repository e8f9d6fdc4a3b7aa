"""A plugin that breaks its contract is named where it happens, and the engine goes on.

At every seam where the core calls a plugin (scheduler, attention backend, sampler, KV
allocator, proposer, grammar backend, quantizer), a broken built-in stand-in returns the
wrong type or shape, or raises. The error must name the kind, the name, the distribution and
its version, and say what was expected and what came back; the request in the failing step
fails with that message, no KV block leaks (conftest checks every engine after each test)
and the engine serves the next request. Then: option typos fail before any weight loads, and
over HTTP a broken plugin's request gets a 500 that names it while the others get a 200.
"""

from __future__ import annotations

import json
import re
import shutil
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from pydantic import BaseModel, ConfigDict

from modserve import LLM, SamplingParams
from modserve.core.hookspecs import hookimpl
from modserve.core.contracts.proposer import Proposal
from modserve.core.contracts.scheduler import Schedule
from modserve.core.registry import PluginError, Registry
from modserve.core.structured_outputs import StructuredOutputs

from server_process import launch, stop, wait_healthy

DIST, VERSION, PLUGIN = "broken-dist", "9.9", "broken-plugin"
ORIGIN = f"'broken' from {DIST} {VERSION} (plugin {PLUGIN!r})"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
MAGIC_TOP_K = 13  # the sampler breaks only on rows with this top_k: one request's input
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
FAULT: dict[str, str | None] = {}  # seam -> the fault its broken plugin plants now (None: behaves)


@pytest.fixture(autouse=True)
def no_fault():
    FAULT.clear()
    yield
    FAULT.clear()


# -- broken stand-ins: a built-in that misbehaves when FAULT says so ------------------------------
def _scheduler():
    from modserve.plugins.schedulers.fcfs import FCFSScheduler

    class BrokenScheduler(FCFSScheduler):
        def schedule(self, view):
            good = super().schedule(view)
            fault = FAULT.get("scheduler")
            if fault == "dict":
                return {"tokens": good.tokens, "preempt": []}
            if fault == "zero":
                return Schedule(tokens={seq: 0 for seq in good.tokens})
            if fault == "raise":
                raise KeyError("no such queue")
            return good

    return BrokenScheduler


def _attention():
    from modserve.attention_backends.paged import PagedAttention

    class BrokenAttention(PagedAttention):
        def forward(self, q, k, v, kv_cache, meta, state):
            out = super().forward(q, k, v, kv_cache, meta, state)
            fault = FAULT.get("attention")
            if fault == "tuple":
                return out, None
            elif fault == "shape":
                return out[:, :1]
            elif fault == "dtype":
                return out.to(torch.float16)
            elif fault == "raise":
                raise IndexError("index 99 is out of bounds")
            return out

        def prepare(self, meta):
            if FAULT.get("attention") == "prepare-raise":
                raise ZeroDivisionError("no rows")
            return super().prepare(meta)

    return BrokenAttention


def _sampler():
    from modserve.samplers.default import DefaultSampler

    class BrokenSampler(DefaultSampler):
        def __call__(self, logits, batch):
            out = super().__call__(logits, batch)
            fault = FAULT.get("sampler")
            if fault is None or not bool((batch.top_k == MAGIC_TOP_K).any()):
                return out
            if fault == "shape":
                out.token_ids = out.token_ids.unsqueeze(1)  # [B, 1]
            elif fault == "vocab":
                out.token_ids = out.token_ids + self.vocab_size
            elif fault == "dict":
                return {"token_ids": out.token_ids}
            elif fault == "raise":
                raise RuntimeError("CUDA error: device-side assert triggered")
            return out

        def probs(self, logits, batch):
            probs = super().probs(logits, batch)
            return probs[:, :-1] if FAULT.get("probs") == "shape" else probs

    return BrokenSampler


def _allocator():
    from modserve.plugins.kv_allocators.contiguous import ContiguousAllocator

    class BrokenAllocator(ContiguousAllocator):
        def allocate(self, seq, num_tokens):
            ok = super().allocate(seq, num_tokens)
            fault = FAULT.get("kv_allocator")
            if fault == "none":
                return None
            if fault == "range" and ok:
                seq.block_ids[-1] = self.num_blocks + 7  # free() reads only the first id: it still works
            if fault == "raise":
                raise AssertionError("slab table corrupt")
            return ok

    return BrokenAllocator


def _proposer():
    from modserve.plugins.proposers.ngram import NgramProposer

    class BrokenProposer(NgramProposer):
        def propose(self, seqs, num_tokens):
            fault = FAULT.get("proposer")
            if fault == "long":
                return Proposal([[1] * (k + 2) for k in num_tokens])
            if fault == "vocab":
                return Proposal([[self.context.vocab_size + 5] for _ in seqs])
            if fault == "list":
                return [[1] for _ in seqs]
            if fault == "raise":
                raise ValueError("n-gram table empty")
            return Proposal([[1] * k for k in num_tokens])  # always drafts: verification runs

    return BrokenProposer


def _grammar():
    from modserve.plugins.grammars.xgrammar_backend import XGrammarBackend

    class BrokenGrammar(XGrammarBackend):
        def compile(self, spec):
            if FAULT.get("grammar") == "compile-raise":
                raise TypeError("'NoneType' object is not subscriptable")
            return super().compile(spec)

        def matcher(self, compiled, max_rollback):
            m = super().matcher(compiled, max_rollback)
            if FAULT.get("grammar") == "matcher-type":
                return object()
            if FAULT.get("grammar") == "accept-raise":
                def accept_token(token_id):
                    raise RuntimeError("matcher state lost")

                m.accept_token = accept_token
            return m

    return BrokenGrammar


def _quantizer():
    from modserve.quantizers.int8 import Int8

    class BrokenInt8(Int8):
        def apply(self, layer, x):
            out = super().apply(layer, x)
            if FAULT.get("quantizer") == "shape":
                return out[..., :-1]
            if FAULT.get("quantizer") == "raise":
                raise RuntimeError("kernel not found")
            return out

    return BrokenInt8


def broken_registry() -> Registry:
    """The built-ins, and one third-party distribution registering a broken stand-in per kind."""
    hooks = {"register_schedulers": _scheduler, "register_attention_backends": _attention,
             "register_samplers": _sampler, "register_kv_allocators": _allocator,
             "register_proposers": _proposer, "register_grammar_backends": _grammar,
             "register_quantizers": _quantizer}
    reg = Registry()
    reg.load_entrypoints({"modserve"})
    plugin = types.SimpleNamespace(**{
        hook: hookimpl(lambda register, factory=factory: register("broken", factory))
        for hook, factory in hooks.items()})
    reg.add_plugin(plugin, PLUGIN, distribution=DIST, version=VERSION)
    return reg


def make_llm(**overrides) -> LLM:
    return LLM(registry=broken_registry(), num_kv_blocks=128, max_model_len=256, max_num_seqs=8,
               progress=False, **overrides)


def assert_names(error: str | None, kind: str, *parts: str) -> None:
    """``error`` starts with the plugin's kind, name, distribution and version, and holds each part
    (what was expected, what came back)."""
    assert error is not None and error.startswith(f"{kind} {ORIGIN}: "), error
    for part in parts:
        assert part in error, (part, error)


def assert_alive(llm: LLM) -> None:
    """With the fault gone, the same engine serves a request, and every KV block is free after it."""
    FAULT.clear()
    (out,) = llm.generate([[20, 21, 22]], GREEDY, use_tqdm=False)
    assert out.error is None and out.outputs[0].finish_reason == "length"
    assert llm.engine.allocator.num_free_blocks() == llm.engine.allocator.num_blocks
    assert not llm.engine.requests and not llm.engine.isolation.active


def failed_with(llm: LLM, params: SamplingParams = GREEDY, prompts: list | None = None) -> list:
    outs = llm.generate(prompts or PROMPTS[:1], params, use_tqdm=False)
    for out in outs:
        assert out.finished and out.outputs[0].finish_reason == "error" and out.error_kind == "plugin", out
    return [o.error for o in outs]


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    """Broken scheduler, attention backend, sampler and KV allocator, all behaving until told."""
    return make_llm(model=llama_dir, scheduler="broken", attention_backend="broken", sampler="broken",
                    kv_allocator="broken")


POISON = SamplingParams(temperature=0.0, top_k=MAGIC_TOP_K, max_tokens=6, ignore_eos=True)


# -- each seam ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault, parts", [
    ("dict", ["schedule() returned dict", "expected a Schedule"]),
    ("zero", ["schedule() returned an invalid schedule: sequence", "gets 0 tokens"]),
    ("raise", ["schedule() raised KeyError: 'no such queue'"]),
])
def test_scheduler(llm, fault, parts):
    FAULT["scheduler"] = fault
    # It fails for every request: each fails cleanly with the plugin's message, none hangs.
    for error in failed_with(llm, prompts=PROMPTS):
        assert_names(error, "scheduler", *parts)
    assert_alive(llm)


@pytest.mark.parametrize("fault, parts", [
    ("tuple", ["forward() returned a tuple (a tensor of shape [", "expected a tensor of q's shape ["]),
    ("shape", ["forward() returned a tensor of shape [4, 1, 16] and dtype float32",
               "expected a tensor of q's shape [4, 4, 16] and dtype float32"]),
    ("dtype", ["dtype float16; expected a tensor of q's shape [4, 4, 16] and dtype float32"]),
    ("raise", ["forward() raised IndexError: index 99 is out of bounds"]),
    ("prepare-raise", ["prepare() raised ZeroDivisionError: no rows"]),
])
def test_attention_backend(llm, fault, parts):
    FAULT["attention"] = fault
    (error,) = failed_with(llm, prompts=[PROMPTS[0]])
    assert_names(error, "attention_backend", *parts)
    assert_alive(llm)


@pytest.mark.parametrize("fault, parts", [
    ("shape", ["__call__() returned token_ids a tensor of shape [1, 1] and dtype int64",
               "expected a SamplerOutput whose token_ids is an int64 tensor of shape [1]"]),
    ("vocab", ["__call__() returned token_ids [", "expected token ids in [0, "]),
    ("dict", ["__call__() returned dict {'token_ids': tensor("]),
    ("raise", ["__call__() raised RuntimeError: CUDA error: device-side assert triggered"]),
])
def test_sampler(llm, fault, parts):
    FAULT["sampler"] = fault
    (error,) = failed_with(llm, POISON)
    assert_names(error, "sampler", *parts)
    assert_alive(llm)


def test_a_plugin_failing_on_one_request_fails_only_that_one(llm):
    clean = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    FAULT["sampler"] = "shape"
    outs = llm.generate([PROMPTS[0], [30, 31], *PROMPTS[1:]], [GREEDY, POISON, GREEDY, GREEDY], use_tqdm=False)
    poisoned = outs.pop(1)
    assert poisoned.outputs[0].finish_reason == "error" and poisoned.error_kind == "plugin"
    assert_names(poisoned.error, "sampler", "returned token_ids a tensor of shape [1, 1]")
    assert [o.outputs[0].token_ids for o in outs] == clean
    assert all(o.error is None for o in outs)
    assert_alive(llm)


@pytest.mark.parametrize("fault, parts", [
    ("none", ["allocate() returned NoneType None; expected True (it reported the blocks of sequence"]),
    ("range", ["allocate() returned block table list [", "expected block ids in [0, 128)"]),
    ("raise", ["allocate() raised AssertionError: slab table corrupt"]),
])
def test_kv_allocator(llm, fault, parts):
    FAULT["kv_allocator"] = fault
    (error,) = failed_with(llm)
    assert_names(error, "kv_allocator", *parts)
    assert_alive(llm)


@pytest.fixture(scope="module")
def spec_llm(llama_dir) -> LLM:
    return make_llm(model=llama_dir, sampler="broken",
                    speculative={"proposer": "broken", "num_speculative_tokens": 2})


@pytest.mark.parametrize("seam, fault, kind, parts", [
    ("proposer", "long", "proposer", ["propose() returned list [1, 1, 1, 1]", "expected at most 2 token ids in [0, "]),
    ("proposer", "vocab", "proposer", ["propose() returned list [", "expected at most 2 token ids in [0, "]),
    ("proposer", "list", "proposer", ["propose() returned list [[1]]", "expected a Proposal with token_ids for 1"]),
    ("proposer", "raise", "proposer", ["propose() raised ValueError: n-gram table empty"]),
    ("probs", "shape", "sampler", ["probs() returned a tensor of shape [3, ", "expected a tensor of shape [3, "]),
])
def test_proposer_and_sampler_probs(spec_llm, seam, fault, kind, parts):
    FAULT[seam] = fault
    (error,) = failed_with(spec_llm)
    assert_names(error, kind, *parts)
    assert_alive(spec_llm)


@pytest.fixture(scope="module")
def grammar_llm(llama_dir) -> LLM:
    # Threads: FAULT switches the backend in this process. A worker process's faults come back
    # as the same PluginError (tests/test_grammar_isolation.py).
    return make_llm(model=llama_dir, grammar_backend="broken", grammar_compile_isolation="thread")


REGEX = SamplingParams(temperature=0.0, max_tokens=6, structured_outputs=StructuredOutputs(regex="[ab]{3}"))


def test_grammar_backend_compile_crash_is_the_plugins_fault_not_a_refused_spec(grammar_llm):
    FAULT["grammar"] = "compile-raise"
    with pytest.raises(PluginError) as e:  # not the ValueError of a refused spec (a 400)
        grammar_llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(
            regex="[0-9]{2}")), use_tqdm=False)
    assert_names(str(e.value), "grammar_backend", "compile() raised TypeError: 'NoneType' object is not")
    assert isinstance(e.value.__cause__, TypeError)
    assert_alive(grammar_llm)


def test_grammar_backend_matcher(grammar_llm):
    FAULT["grammar"] = "matcher-type"
    with pytest.raises(PluginError) as e:
        grammar_llm.generate(["x"], REGEX, use_tqdm=False)
    assert_names(str(e.value), "grammar_backend", "matcher() returned object <object",
                 "expected a GrammarMatcher")
    assert not grammar_llm.engine.requests
    FAULT["grammar"] = "accept-raise"
    (error,) = failed_with(grammar_llm, REGEX, prompts=["y"])
    assert_names(error, "grammar_backend", "matcher.accept_token() raised RuntimeError: matcher state lost")
    assert_alive(grammar_llm)


@pytest.mark.parametrize("fault, parts", [
    ("shape", ["apply() returned a tensor of shape [4, ", "; expected a tensor of shape [4, "]),
    ("raise", ["apply() raised RuntimeError: kernel not found"]),
])
def test_quantizer(llama_dir, fault, parts):
    FAULT["quantizer"] = fault  # before the first forward: the shape is checked at each layer's first call
    llm = make_llm(model=llama_dir, quantization="broken")
    (error,) = failed_with(llm)
    assert_names(error, "quantizer", *parts)
    assert_alive(llm)


# -- options: checked before any weight loads ---------------------------------------------------------
class TiledOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tile: int = 8


@pytest.mark.parametrize("kind, field", [("kv_allocator", "kv_allocator"), ("scheduler", "scheduler"),
                                         ("proposer", "speculative")])
def test_plugin_options_are_validated_before_the_weights_load(llama_dir, tmp_path, kind, field):
    """The weights file is garbage: any error but the options one means the weights were read first."""
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    for weights in model.glob("*.safetensors"):
        weights.write_bytes(b"\x00 not a safetensors file")
    reg = Registry()
    reg.load_entrypoints({"modserve"})
    plugin = types.SimpleNamespace(**{f"register_{k}s": hookimpl(
        lambda register, k=k: register("tiled", f"no_such_module_{k}:Cls", options=TiledOptions))
        for k in ("kv_allocator", "scheduler", "proposer")})
    reg.add_plugin(plugin, "tiled", distribution="tiled-dist", version="1.0")
    choice = {"name": "tiled", "options": {"colour": 1}}
    value = {"proposer": choice} if field == "speculative" else choice
    with pytest.raises(ValueError, match=rf"invalid options for {kind} 'tiled': unknown option 'colour'"):
        LLM(str(model), registry=reg, num_kv_blocks=128, progress=False, **{field: value})
    with pytest.raises(Exception, match="(?i)safetensors|header|deserializ"):  # the check above is not vacuous
        LLM(str(model), registry=reg, num_kv_blocks=128, progress=False)


# -- over HTTP ------------------------------------------------------------------------------------------
BROKEN_MODULE = '''
"""A sampler that returns token ids of the wrong shape on rows whose top_k is 13, and a
grammar backend whose compile crashes."""
from modserve.api import hookimpl


def _sampler():
    from modserve.samplers.default import DefaultSampler

    class BrokenDemoSampler(DefaultSampler):
        def __call__(self, logits, batch):
            out = super().__call__(logits, batch)
            if bool((batch.top_k == 13).any()):
                out.token_ids = out.token_ids.unsqueeze(1)
            return out

    return BrokenDemoSampler


def _grammar():
    from modserve.plugins.grammars.xgrammar_backend import XGrammarBackend

    class CrashingGrammar(XGrammarBackend):
        def compile(self, spec):
            raise KeyError("root")

    return CrashingGrammar


@hookimpl
def register_samplers(register):
    register("broken-demo", _sampler)


@hookimpl
def register_grammar_backends(register):
    register("broken-demo", _grammar)
'''


def _install(site: Path) -> None:
    """``modserve-broken-demo`` 0.1 as an installed distribution on ``site`` (for PYTHONPATH)."""
    (site / "modserve_broken_demo.py").write_text(BROKEN_MODULE)
    info = site / "modserve_broken_demo-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: modserve-broken-demo\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[modserve]\nbroken = modserve_broken_demo\n")


def test_server_answers_a_broken_plugin_with_a_500_naming_it_and_serves_the_rest(llama_dir, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    _install(site)
    env = {"PYTHONPATH": str(site), "MODSERVE_LOAD_PLUGINS": "modserve,modserve-broken-demo"}
    server = launch(tmp_path, "broken", "--model", llama_dir, "--served-model-name", "m", "--num-threads", "1",
                    "--max-model-len", "256", "--num-kv-blocks", "64", "--sampler", "broken-demo",
                    "--grammar-backend", "broken-demo", env=env)
    good = {"model": "m", "prompt": "a good request", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    bad = {**good, "prompt": "a bad one", "max_tokens": 8, "top_k": 13}

    def post(body: dict) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)

    try:
        wait_healthy(server)
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(post, body) for body in (good, bad, good, bad)]
            responses = [f.result() for f in futures]
        for r in responses[0::2]:
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] == "length"
        for r in responses[1::2]:
            assert r.status_code == 500, r.text
            error = r.json()["error"]
            assert error["code"] == "plugin_error" and error["type"] == "server_error"
            assert error["message"].startswith(
                "sampler 'broken-demo' from modserve-broken-demo 0.1 (plugin 'modserve-broken-demo:broken'): "
                "__call__() returned token_ids a tensor of shape [1, 1]"), error
        streamed = httpx.post(f"{server.url}/v1/completions", json={**bad, "stream": True}, timeout=60).text
        events = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "plugin_error" and "broken-demo" in events[-1]["error"]["message"]
        # A crash in a grammar backend's compile is the plugin's fault, not a refused spec (400).
        r = post({**good, "guided_regex": "[ab]+"})
        assert r.status_code == 500 and r.json()["error"]["code"] == "plugin_error", r.text
        assert r.json()["error"]["message"].startswith("grammar_backend 'broken-demo' from modserve-broken-demo 0.1 "
                                                       "(plugin 'modserve-broken-demo:broken'): compile() raised "
                                                       "KeyError: 'root'"), r.text
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        assert post(good).status_code == 200
        metrics = httpx.get(f"{server.url}/metrics", timeout=5).text
        assert re.search(r"^modserve_kv_blocks_used 0\.0$", metrics, re.M), metrics
    finally:
        stop(server)
