"""AsyncEngine in-process: the engine thread survives failures and frees what it held.

In-process, so conftest's KV-leak guard checks every block came back.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

from modserve.core.config import EngineConfig
from modserve.engine.engine import LLMEngine
from modserve.core.sampling_params import SamplingParams
from modserve.server.async_engine import AsyncEngine, EngineError

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(llama_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=64, max_model_len=256), progress=False)


def run(engine: LLMEngine, body) -> None:
    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            await asyncio.wait_for(body(ae), 60)
        finally:
            ae.stop()
            assert not ae.alive

    asyncio.run(main())


async def final(ae: AsyncEngine, prompt: list[int], params: SamplingParams = PARAMS):
    last = None
    async for out in ae.submit([prompt], params):
        last = out
    return last


def test_outputs_are_cumulative_and_end_finished(engine):
    async def body(ae: AsyncEngine) -> None:
        seen = [out async for out in ae.submit([[5, 6, 7]], PARAMS)]
        assert seen[-1].finished and len(seen[-1].outputs[0].token_ids) == 8
        lengths = [len(o.outputs[0].token_ids) for o in seen]
        assert lengths == sorted(lengths)
        assert ae.num_waiting == 0

    run(engine, body)


MARKER: contextvars.ContextVar[str] = contextvars.ContextVar("marker")


def test_the_engine_thread_computes_alone_in_the_callers_context(engine, monkeypatch):
    """start() gives up the calling thread's OpenMP team (that thread loaded the model; the
    engine thread runs every kernel from now on: tests/test_intra_op_threads.py) and runs the
    engine thread in the caller's context, where torch keeps its compile settings."""
    released = []
    monkeypatch.setattr("modserve.server.async_engine.release_intra_op_threads",
                        lambda: released.append(threading.current_thread().name))
    seen: dict[str, str | None] = {}
    real_step = engine.step

    def step():
        seen.setdefault("thread", threading.current_thread().name)
        seen.setdefault("marker", MARKER.get(None))
        return real_step()

    monkeypatch.setattr(engine, "step", step)

    async def body(ae: AsyncEngine) -> None:
        assert (await final(ae, [5, 6, 7])).finished

    token = MARKER.set("the caller's")
    try:
        run(engine, body)
    finally:
        MARKER.reset(token)
    assert released == [threading.current_thread().name]
    assert seen == {"thread": "modserve-engine", "marker": "the caller's"}


def test_add_failure_goes_to_its_caller_only(engine):
    async def body(ae: AsyncEngine) -> None:
        good = asyncio.create_task(final(ae, [5, 6, 7]))
        with pytest.raises(EngineError, match="outside the vocabulary"):
            await final(ae, [10**8])
        assert (await good).finished
        assert (await final(ae, [8, 9])).finished

    run(engine, body)


def test_step_failure_fails_in_flight_requests_and_the_loop_goes_on(engine, monkeypatch):
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine, "step", flaky_step)

    async def body(ae: AsyncEngine) -> None:
        with pytest.raises(EngineError, match="boom"):
            await final(ae, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
        assert ae.alive
        assert (await final(ae, [8, 9])).finished

    run(engine, body)


def test_close_aborts_and_stop_frees_everything(engine):
    async def body(ae: AsyncEngine) -> None:
        stream = ae.submit([[5, 6, 7], [8, 9]], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        await stream.__anext__()
        stream.close()
        stream.close()  # twice is fine
        stats = await ae.stats()
        assert stats["num_running"] + stats["num_waiting"] == 0
        # Left running at shutdown: the engine thread aborts it on its way out.
        ae.submit([[1, 2, 3]], SamplingParams(max_tokens=200, ignore_eos=True))
        await asyncio.sleep(0.05)

    run(engine, body)
