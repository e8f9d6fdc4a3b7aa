"""Asynchronous scheduling (``async_scheduling``): the same tokens, texts and stops as the
synchronous engine, never a token past a stop, no block freed under a running forward."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Iterator

import pytest

from lora_oracle import ALL, make_adapter
from modserve import LLM, LoRARequest, SamplingParams, StructuredOutputs
from modserve.plugins.platforms.cpu.native_decode import NativeDecodeStep
from server_process import serving

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "Hello",
    "café naïve 日本語 😀 and then some more words here",
    "one two three four five six seven eight nine ten eleven twelve",
    "a b c",
]


@pytest.fixture(autouse=True)
def no_step_failed(caplog):
    """Culprit isolation would hide a fault by rerunning the requests: no step may fail here."""
    yield
    failed = [m for r in caplog.get_records("call") if "step failed" in (m := r.getMessage()) or "failed alone" in m]
    assert not failed, failed


def make_llm(path: str, async_scheduling: bool, **overrides) -> LLM:
    overrides.setdefault("num_kv_blocks", 128)
    overrides.setdefault("max_model_len", 256)
    overrides.setdefault("dtype", "float32")
    return LLM(path, progress=False, async_scheduling=async_scheduling, **overrides)


@pytest.fixture(scope="module")
def pair(llama_dir) -> Iterator[dict[bool, LLM]]:
    """The synchronous engine (False) and the asynchronous one (True), same weights."""
    llms = {mode: make_llm(llama_dir, mode) for mode in (False, True)}
    yield llms
    for llm in llms.values():
        llm.shutdown()  # the output thread ends with its engine


def seen(outs) -> list[list[tuple]]:
    """Everything a user sees of each output."""
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outs]


def both(pair, prompts, params) -> list[list[list[tuple]]]:
    return [seen(pair[mode].generate(prompts, params, use_tqdm=False)) for mode in (False, True)]


def streams(llm: LLM, prompts, params) -> dict[str, list[list[tuple]]]:
    """Each request's outputs, step after step, as a streaming user sees them."""
    eng = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params if isinstance(params, list) else [params] * len(prompts))):
        eng.add_request(f"s{i}", prompt, p)
    out: dict[str, list[list[tuple]]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            out.setdefault(o.request_id, []).append(seen([o])[0] + [o.finished])
    return out


def test_plain_batch_identical(pair):
    params = [SamplingParams(temperature=0, max_tokens=3 + 7 * i, ignore_eos=True, logprobs=2)
              for i in range(len(PROMPTS))]
    sync, overlapped = (streams(pair[mode], PROMPTS, params) for mode in (False, True))
    assert overlapped == sync  # every output on the way, not only the last
    assert [len(sync[f"s{i}"][-1][0][0]) for i in range(len(PROMPTS))] == [3 + 7 * i for i in range(len(PROMPTS))]


def test_stop_strings_end_at_the_same_token(pair):
    free = seen(pair[False].generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                     use_tqdm=False))
    # A stop string from the middle of each text: the step after it has already run when it is found.
    stops = [o[0][1][len(o[0][1]) // 2:len(o[0][1]) // 2 + 2] for o in free]
    stops = [s for s in stops if s.strip()]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stops)
    sync, overlapped = both(pair, PROMPTS, params)
    assert overlapped == sync
    stopped = [o[0] for o in sync if o[0][2] == "stop"]
    assert len(stopped) >= 3 and all(len(o[0]) < 24 for o in stopped)
    with_stop = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stops,
                               include_stop_str_in_output=True)
    sync, overlapped = both(pair, PROMPTS, with_stop)
    assert overlapped == sync and any(o[0][2] == "stop" for o in sync)


def test_stop_token_ids_and_eos(pair):
    free = seen(pair[False].generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                     use_tqdm=False))
    stop_ids = [o[0][0][5] for o in free]  # each text's sixth token
    sync, overlapped = both(pair, PROMPTS, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=stop_ids))
    assert overlapped == sync
    assert sum(o[0][2] == "stop" for o in sync) >= len(PROMPTS)
    eos = pair[False].engine.eos_token_ids
    forced = SamplingParams(temperature=0, max_tokens=16, logit_bias={next(iter(eos)): 100.0}, min_tokens=4)
    sync, overlapped = both(pair, PROMPTS, forced)  # EOS once min_tokens allow it
    assert overlapped == sync and all(len(o[0][0]) == 5 and o[0][2] == "stop" for o in sync)


def test_n_samples_seeded(pair):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    sync, overlapped = both(pair, PROMPTS[:3], params)
    assert overlapped == sync and len(sync[0]) == 3
    # one sample stopped by a stop string while the others go on: every output on the way the same
    stops = [c[1][len(c[1]) // 2:len(c[1]) // 2 + 2] for o in sync for c in o[:1] if c[1].strip()]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, stop=stops)
    sync, overlapped = (streams(pair[mode], PROMPTS[:3], params) for mode in (False, True))
    assert overlapped == sync
    assert any(c[2] == "stop" for o in sync.values() for c in o[-1][:-1])


def test_structured_outputs_json_schema(pair):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}},
              "required": ["a", "b"], "additionalProperties": False}
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=60,
                            structured_outputs=StructuredOutputs(json=schema))
    sync, overlapped = both(pair, PROMPTS[:2], params)
    assert overlapped == sync
    assert any(c[2] == "stop" for o in sync for c in o)  # some finished by the grammar, at the same token


def test_prompt_logprobs(pair):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    outs = {mode: pair[mode].generate(PROMPTS, params, use_tqdm=False) for mode in (False, True)}
    assert [o.prompt_logprobs for o in outs[True]] == [o.prompt_logprobs for o in outs[False]]
    assert seen(outs[True]) == seen(outs[False])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(llama_dir, pair, mode):
    prompts = [f"prompt {i}: " + "the model token cache " * (3 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = seen(pair[False].generate(prompts, params, use_tqdm=False))
    small = make_llm(llama_dir, True, num_kv_blocks=12, max_model_len=192, preemption_mode=mode,
                     num_swap_blocks=64)
    assert seen(small.generate(prompts, params, use_tqdm=False)) == expected
    assert small.engine.stats()[f"preemptions_{mode}"] > 0
    small.shutdown()


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_speculative(llama_dir, checkpoint_dir, pair, proposer):
    """ngram, and a draft model of one layer: it disagrees often (rejected slots go back), and
    its KV of each sequence is caught up at proposal time, on the engine thread, with no
    forward running."""
    prompts = ["a b c d e f a b c d e f a b c", "the model token cache " * 6, *PROMPTS[:3]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    chosen = "ngram" if proposer == "ngram" else \
        {"name": "draft_model", "options": {"model": checkpoint_dir("llama", num_hidden_layers=1)}}
    spec = make_llm(llama_dir, True, speculative={"proposer": chosen, "num_speculative_tokens": 3})
    assert seen(spec.generate(prompts, params, use_tqdm=False)) == \
        seen(pair[False].generate(prompts, params, use_tqdm=False))
    stats = spec.engine.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    spec.shutdown()


def test_abort_mid_generation_frees_every_block(pair):
    eng = pair[True].engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"abort-{i}", p, params)
    shown: dict[str, list[int]] = {}
    for _ in range(4):
        for out in eng.step():
            shown[out.request_id] = out.outputs[0].token_ids
    assert eng.overlap.pending is not None  # a step's tokens applied, not shown yet
    for i in (0, 2):
        assert eng.abort_request(f"abort-{i}").finished
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id not in ("abort-0", "abort-2"), "an aborted request's tokens were shown"
            shown[out.request_id] = out.outputs[0].token_ids
    assert all(len(shown[f"abort-{i}"]) == 40 for i in (1, 3, 4))
    assert eng.allocator.num_free_blocks() == eng.allocator.num_blocks
    for i, p in enumerate(PROMPTS):  # and aborting everything at once, mid-step
        eng.add_request(f"all-{i}", p, params)
    eng.step(), eng.step()
    for i in range(len(PROMPTS)):
        eng.abort_request(f"all-{i}")
    assert eng.step() == [] and not eng.has_unfinished_requests()
    assert eng.allocator.num_free_blocks() == eng.allocator.num_blocks


def test_no_block_freed_under_a_running_forward(pair):
    """While the forward runs, the outputs of the step before find stop strings: the blocks of
    the sequences they end must stay theirs until the forward is done."""
    eng = pair[True].engine
    execute, changed = eng.runner.execute, []

    def slow_execute(scheduled):
        tables = {s: list(s.block_ids) for s in scheduled.seqs}
        time.sleep(0.02)  # the engine thread shows the step before meanwhile
        changed.extend(s.seq_id for s, ids in tables.items() if s.block_ids != ids[:len(s.block_ids)] or
                       s.is_finished)
        return execute(scheduled)

    eng.runner.execute = slow_execute
    try:
        free = seen(pair[False].generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                         use_tqdm=False))
        stops = [o[0][1][len(o[0][1]) // 2:len(o[0][1]) // 2 + 2] for o in free if o[0][1].strip()]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[s for s in stops if s.strip()])
        outs = pair[True].generate(PROMPTS, params, use_tqdm=False)
    finally:
        eng.runner.execute = execute
    assert any(o.outputs[0].finish_reason == "stop" for o in outs)
    assert not changed, f"sequences lost their blocks mid-forward: {changed}"


def test_refused_with_pooling(llama_dir):
    with pytest.raises(ValueError, match="async_scheduling does not work with runner pooling"):
        make_llm(llama_dir, True, runner="pooling")


def test_server_streams_the_same_text(llama_dir, tmp_path):
    sync = make_llm(llama_dir, False, enable_prefix_caching=False)  # as the fresh server, one request at a time
    free = sync.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].text
    stop = free[len(free) // 2:len(free) // 2 + 2]  # ends the first prompt's text halfway
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    expected = [sync.generate(p, params, use_tqdm=False)[0] for p in PROMPTS[:2]]
    sync.shutdown()
    assert expected[0].outputs[0].finish_reason == "stop"
    with serving(tmp_path, "async", "--model", llama_dir, "--dtype", "float32", "--num-kv-blocks", "64",
                 "--max-model-len", "256", "--async-scheduling") as server:
        client = server.client()
        for prompt, want in zip(PROMPTS[:2], expected):
            stream = client.completions.create(model=llama_dir, prompt=prompt, max_tokens=20, temperature=0,
                                               stream=True, stop=[stop], extra_body={"ignore_eos": True},
                                               stream_options={"include_usage": True})
            chunks = list(stream)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert text == want.outputs[0].text and finish == [want.outputs[0].finish_reason]
            assert chunks[-1].usage.completion_tokens == len(want.outputs[0].token_ids)  # none past the stop
        stats = server.metrics()
        assert stats["modserve_num_requests_running"] == 0 and stats["modserve_kv_blocks_used"] == 0


def test_a_failed_forward_blames_its_request_and_loses_no_output(pair, monkeypatch, caplog):
    """The forward of N+1 raises (a planted sampler fault, once the poisoned request has three
    tokens): culprit isolation fails that request alone, and the outputs of step N, built while
    that forward ran, still reach the others' users, one token at a time."""
    healthy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    poison = SamplingParams(temperature=0.5, top_p=0.9, max_tokens=12, ignore_eos=True, seed=7)
    clean = [o.outputs[0].token_ids for o in pair[False].generate(PROMPTS[:3], healthy, use_tqdm=False)]
    llm = pair[True]
    real = llm.engine.runner.sampler

    def sampler(logits, batch):
        late = any(len(s.output_token_ids) >= 3 for r in list(llm.engine.requests.values()) for s in r.seqs
                   if s.params.temperature == 0.5)
        if late and bool((batch.temperature == 0.5).any()):
            raise RuntimeError("planted sampler fault")
        return real(logits, batch)

    monkeypatch.setattr(llm.engine.runner, "sampler", sampler)
    out = streams(llm, [*PROMPTS[:3], "poisoned"], [healthy] * 3 + [poison])
    assert out["s3"][-1][0][2] == "error" and 0 < len(out["s3"][-1][0][0]) < 12
    assert [out[f"s{i}"][-1][0][0] for i in range(3)] == clean
    for i in range(3):
        assert [len(o[0][0]) for o in out[f"s{i}"]] == list(range(1, 13)), f"s{i} skipped an output"
    assert not llm.engine.isolation.active
    assert any("failed alone" in r.getMessage() for r in caplog.records)
    caplog.clear()  # the failed steps were planted: no_step_failed lets them be


@pytest.mark.parametrize("compile_setting", ["off", "on"])
def test_lora_adapters_apply_in_async_steps(llama_dir, tmp_path, compile_setting):
    """The LoRA row mapping is a thread-local of the forward: set and read on the thread that
    runs it, eagerly and by the compiled layers' opaque LoRA op."""
    adapter = make_adapter(llama_dir, tmp_path / "a", 8, ALL, seed=1)
    lora = LoRARequest("a", 1, adapter)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = {}
    for mode in (False, True):
        llm = make_llm(llama_dir, mode, enable_lora=True, max_loras=1, max_lora_rank=8, compile=compile_setting)
        assert llm.engine.runner.compiled == (compile_setting == "on")
        outs = llm.generate(PROMPTS[:4], params, use_tqdm=False, lora_request=[None, lora, None, lora])
        got[mode] = seen(outs)
        base = seen(llm.generate(PROMPTS[1:2], params, use_tqdm=False))[0]  # prompt 1 without the adapter
        llm.shutdown()
        if mode:  # shutdown ends the output thread
            assert not any(t.is_alive() for t in llm.engine.overlap.pool._threads)
    assert got[True] == got[False]
    assert got[False][1][0][0] != base[0][0]  # the adapter changes the tokens: a real check


# -- tensor parallelism and torch.compile: which thread runs what ----------------------------


def mixed_params(llm: LLM) -> list[SamplingParams]:
    """One per prompt of PROMPTS: greedy ones ended by stop strings from the middle of their own
    text, one at max_tokens, and two of n=2 (seeded samples, one also stopped by a string)."""
    free = seen(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False))
    stops = [s for o in free if (s := o[0][1][len(o[0][1]) // 2:len(o[0][1]) // 2 + 2]).strip()]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=stops)
    return [greedy, SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, stop=stops),
            greedy, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
            SamplingParams(n=2, temperature=0.8, seed=9, max_tokens=10, ignore_eos=True)]


def threads_of(llm: LLM) -> set[str]:
    """Record which threads run the step's forward (and, where there is one, the native decode
    step's C++ call) and its output processing from now on; the names come back in the set
    returned. The forward belongs on the engine thread, whose OpenMP team computed everything
    before: a forward on another thread starts a second team, and on a machine with as many
    cores as one team's threads every parallel kernel then waits for a thread to wake."""
    runner, names = llm.engine.runner, set()

    def recorded(fn, what):
        def call(*args):
            names.add(f"{what}@{threading.current_thread().name}")
            return fn(*args)
        return call

    if isinstance(runner.step_forward, NativeDecodeStep):
        runner.step_forward.decoder = SimpleNamespace(forward=recorded(runner.step_forward.decoder.forward, "native"))
        runner.step_forward.forward = recorded(runner.step_forward.forward, "compiled")
    else:
        runner.step_forward = recorded(runner.step_forward, "compiled" if runner.compiled else "eager")
    llm.engine.overlap._show = recorded(llm.engine.overlap._show, "outputs")
    return names


def mixed_batch_both_ways(make) -> tuple[set[str], dict[bool, LLM]]:
    """The mixed batch with async scheduling off, then on (``make(mode)``: one engine at a time,
    as one process holds one tensor-parallel group): every output on the way the same. Returns
    the threads the async engine's forwards ran on, and the engines (shut down)."""
    got, names, llms = {}, set(), {}
    for mode in (False, True):
        llms[mode] = llm = make(mode)
        try:
            if not mode:
                params = mixed_params(llm)
            else:
                names = threads_of(llm)
            got[mode] = streams(llm, PROMPTS, params)
        finally:
            llm.shutdown()
    assert got[True] == got[False]
    last = [c for o in got[False].values() for c in o[-1][:-1]]
    assert {c[2] for c in last} == {"stop", "length"} and len(last) == len(PROMPTS) + 2
    return names, llms


def test_tensor_parallel_mp_identical(llama_dir):
    """TP=2 (the mp executor, gloo): rank 0's engine thread sends the step to rank 1 and runs
    the all-reduces, while the output thread shows the step before."""
    names, _ = mixed_batch_both_ways(lambda mode: make_llm(llama_dir, mode, tensor_parallel_size=2, num_threads=1))
    assert names == {"eager@MainThread", "outputs@modserve-outputs_0"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_forward_and_native_decode_identical(checkpoint_dir, dtype):
    """compile: on: the async engine's forwards run the layers' graphs the synchronous one
    compiled, with no recompile; a bf16 checkpoint's decode steps run as the CPU platform's
    native C++ step, its prefills through the compiled graphs."""
    from torch._dynamo.utils import counters

    path = checkpoint_dir("llama", dtype=dtype)
    graphs = []

    def make(mode: bool) -> LLM:
        # dtype auto: float32 activations, a bf16 checkpoint's linears read in bf16
        llm = make_llm(path, mode, compile="on", dtype="auto")
        graphs.append(counters["stats"]["unique_graphs"])  # after its warm-up
        return llm

    names, llms = mixed_batch_both_ways(make)
    assert all(llm.engine.runner.compiled for llm in llms.values())
    # the async engine's warm-up and steps reuse the graphs the synchronous one made on this thread
    assert counters["stats"]["unique_graphs"] == graphs[0], "the async engine compiled again"
    if dtype == "bfloat16":
        assert isinstance(llms[True].engine.runner.step_forward, NativeDecodeStep)
        assert names == {"native@MainThread", "compiled@MainThread", "outputs@modserve-outputs_0"}
    else:
        assert names == {"compiled@MainThread", "outputs@modserve-outputs_0"}


def test_an_async_engine_compiling_first_makes_the_graphs_a_synchronous_one_makes(checkpoint_dir):
    """An async engine that compiles first (nothing cached by an engine before it) makes as
    many graphs as the synchronous engine: its forwards run under the compile settings the
    platform gave torch (a layer's index a graph input, not a constant), which torch keeps
    per thread, not a set of graphs per layer."""
    import torch
    from torch._dynamo.utils import counters

    path = checkpoint_dir("llama")
    made = {}
    for mode in (True, False):
        torch._dynamo.reset()
        before = counters["stats"]["unique_graphs"]
        llm = make_llm(path, mode, compile="on")
        try:
            llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=4))
        finally:
            llm.shutdown()
        made[mode] = counters["stats"]["unique_graphs"] - before
    torch._dynamo.reset()  # later tests compile afresh, as in a process of their own
    assert made[True] == made[False] > 0
