"""An engine-core process sends token ids, never text; the API server's output processor makes
what the user sees, the offline engine's very text (modserve/engine/output.py,
engine/output_processor.py, engine/core_process.py, server/engine_process.py).

- The engine as the core process builds it steps with no detokenizer call and hands out
  CoreOutputs; an OutputProcessor fed with them, its stop strings sent back as StopSequence,
  shows what ``LLM`` shows, and every KV block comes back.
- A real engine-core process behind an EngineProcess: the messages it sends hold no string but
  request ids, finish reasons and the stop strings the server named; the server's outputs equal
  the offline engine's (stop strings with and without include_stop_str_in_output, logprobs,
  prompt logprobs, n=2), and a stop string found by the server ends the sequence in the core
  (it does not sample on to max_tokens).
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from modserve import LLM, SamplingParams
from modserve.core.config import EngineConfig
from modserve.engine import core_process, core_protocol as p
from modserve.engine.output_processor import OutputProcessor
from modserve.engine.tokenizer import IncrementalDecoder, Tokenizer

PROMPTS = [[(5 * i + j) % 190 + 7 for j in range(6 + 2 * i)] for i in range(4)]
MAX_TOKENS = 160  # far past the stop strings: a core that missed its StopSequence samples on to here
OVERRIDES = dict(num_threads=1, num_kv_blocks=96, max_model_len=512, dtype="float32")
FINISH_REASONS = {"stop", "length", "abort", "error"}
LOGPROB_KEYS = {"token_id", "logprob", "rank", "top"}


@pytest.fixture(scope="module")
def offline(llama_dir):
    with LLM(llama_dir, progress=False, **OVERRIDES) as llm:
        yield llm


@pytest.fixture(scope="module")
def cases(offline) -> list[tuple[list[int], SamplingParams]]:
    """Stop strings cut from each prompt's greedy text, so that each one is found."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    texts = [o.outputs[0].text for o in offline.generate(PROMPTS, greedy, use_tqdm=False)]
    stops = [next(t[k:k + 3] for k in range(10, len(t) - 3) if t.index(t[k:k + 3]) >= 6 and "\ufffd" not in t[k:k + 3])
             for t in texts]
    base = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [
        (PROMPTS[0], SamplingParams(**base, stop=[stops[0], "\u00a7never\u00a7"])),
        (PROMPTS[1], SamplingParams(**base, stop=[stops[1]], include_stop_str_in_output=True, logprobs=2)),
        (PROMPTS[2], SamplingParams(**base, stop=[stops[2]], prompt_logprobs=1, min_tokens=2)),
        (PROMPTS[3], SamplingParams(**{**base, "temperature": 1.0}, n=2, seed=11, stop=[stops[3], "s"], min_tokens=3,
                                      logprobs=0)),
    ]


@pytest.fixture(scope="module")
def expected(offline, cases):
    """The offline engine's outputs (in-process, its own output processor), all cases in one batch."""
    engine, finals = offline.engine, {}
    for i, (prompt, params) in enumerate(cases):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step())
    return [finals[f"r{i}"] for i in range(len(cases))]


def shown(out) -> tuple[list, list[float]]:
    """What a user sees of a request's output: all of it but the logprob values, and those."""
    values: list[float] = []

    def entry(e):
        if e is None:
            return None
        values.append(e["logprob"])
        values.extend(e["top"].values())
        return e["token_id"], e["rank"], list(e["top"])

    prompt = None if out.prompt_logprobs is None else [entry(e) for e in out.prompt_logprobs]
    samples = [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason,
                None if c.logprobs is None else [entry(e) for e in c.logprobs])
               for c in sorted(out.outputs, key=lambda c: c.index)]
    return [out.finished, prompt, samples], values


def strings_in(value) -> set[str]:
    if isinstance(value, str):
        return {value}
    if isinstance(value, dict):
        return set().union(*(strings_in(k) | strings_in(v) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return set().union(set(), *map(strings_in, value))
    return set()


def assert_no_text(outputs: list[p.CoreOutput], cases) -> None:
    allowed = FINISH_REASONS | LOGPROB_KEYS | {s for _, params in cases for s in params.stop}
    assert outputs and all(isinstance(o, p.CoreOutput) for o in outputs)
    for out in outputs:
        strings = strings_in(msgspec.to_builtins(out)) - {out.request_id}
        assert strings <= allowed, f"the core sent text: {sorted(strings - allowed)}"


def test_the_core_engine_steps_without_detokenizing(llama_dir, cases, expected, monkeypatch):
    config = EngineConfig(model=llama_dir, **OVERRIDES)
    engine = core_process._build(config.model_dump_json(), 0)  # as the core process builds it
    in_core = [False]
    decode = IncrementalDecoder.step

    def step(self, token_id):
        assert not in_core[0], "the engine core detokenized a token"
        return decode(self, token_id)

    monkeypatch.setattr(IncrementalDecoder, "step", step)
    core = core_process.EngineCore(engine, None, None)
    server = OutputProcessor(Tokenizer(llama_dir))
    finals, sent = {}, []
    try:
        for i, (prompt, params) in enumerate(cases):
            server.add(f"r{i}", prompt, params, 0.0)
            engine.add_request(f"r{i}", prompt, params)
        while engine.has_unfinished_requests():
            in_core[0] = True
            try:
                outputs = engine.step()
            finally:
                in_core[0] = False
            sent += outputs
            shown_now, stops = server.process(p.decode_from_core(p.encode(p.Outputs(outputs))).outputs)
            finals.update((o.request_id, o) for o in shown_now)
            for hit in stops:  # as EngineProcess sends them, and the core applies them
                core._apply(p.StopSequence(hit.request_id, hit.index, hit.stop, hit.num_output_tokens))
        assert_no_text(sent, cases)
        assert [shown(finals[f"r{i}"]) for i in range(len(cases))] == [shown(o) for o in expected]
        assert all(finals[f"r{i}"].finished for i in range(len(cases))) and not server.requests
        assert engine.allocator.num_free_blocks() == engine.allocator.num_blocks
    finally:
        for rid in list(engine.requests):  # a failed check leaves none behind
            engine.abort_request(rid)
        engine.shutdown()


def test_a_core_process_sends_token_ids_and_the_server_shows_the_offline_text(llama_dir, cases, expected):
    from modserve.server.engine_process import start_engine_processes

    config = EngineConfig(model=llama_dir, **OVERRIDES)
    (engine,) = start_engine_processes([config])
    received: list[p.CoreOutput] = []
    handle = engine._handle

    def recording(message):
        if isinstance(message, p.Outputs):
            received.extend(message.outputs)
        handle(message)

    engine._handle = recording

    async def run():
        engine.start()
        streams = [engine.submit([prompt], params) for prompt, params in cases]
        finals = []
        for stream in streams:
            async for out in stream:
                last = out
            finals.append(last)
        for _ in range(50):  # the core applies the last StopSequences (a core that missed one samples on)
            stats = await engine.call_utility("stats")
            if stats["num_running"] == 0:
                break
            await asyncio.sleep(0.1)
        return finals, stats

    try:
        finals, stats = asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        engine.stop()
        engine.shutdown_engine()
    assert_no_text(received, cases)
    for got, want in zip(map(shown, finals), map(shown, expected)):
        assert got[0] == want[0]
        # NOTE: the core batches the requests as they arrive, not as the offline engine did:
        # the logits, not the tokens, may differ in their last bits.
        assert got[1] == pytest.approx(want[1], rel=1e-5, abs=1e-5)
    shown_tokens = sum(len(c.token_ids) for o in expected for c in o.outputs)
    stopped = sum(c.finish_reason == "stop" for o in expected for c in o.outputs)
    assert stopped >= 4
    # The core may sample a few tokens past a stop before the server's StopSequence reaches it,
    # never on to max_tokens.
    assert stats["generation_tokens"] <= shown_tokens + 12 * stopped, (stats["generation_tokens"], shown_tokens)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["num_running"] == 0

