"""Structured output after reasoning: the constraint starts once the reasoning's end marker
(``StructuredOutputs.start_after``, the server sets it to the reasoning parser's ``</think>``)
is in the output, as vLLM applies it.

The engine runs with a sampler that writes a scripted reasoning (whatever the mask says), then
samples as the default one: the script's tokens pass only if the grammar is inactive until the
marker, and the answer after it must be valid JSON for the schema whatever the random weights.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from modserve import LLM, SamplingParams
from modserve.api import hookimpl
from modserve.core.registry import get_registry
from modserve.core.structured_outputs import StructuredOutputs
from modserve.engine.grammar_gate import AfterMarker
from modserve.samplers.default import DefaultSampler

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
                                             "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}


class ScriptedSampler(DefaultSampler):
    """The first tokens of SCRIPT, one per call (one sequence at a time), then the default."""

    script: list[int] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def __call__(self, logits, batch):
        out = super().__call__(logits, batch)
        if self.calls < len(self.script):
            out.token_ids[:] = self.script[self.calls]
        self.calls += 1
        return out


class Plugin:
    @hookimpl
    def register_samplers(self, register):
        register("scripted", lambda: ScriptedSampler)


@pytest.fixture(scope="module")
def qwen_dir(checkpoint_dir) -> str:
    return checkpoint_dir("qwen2")


def run_scripted(path: str, script: list[int], start_after: tuple[int, ...] | None):
    ScriptedSampler.script = script
    with get_registry().plugin(Plugin(), "scripted-sampler"):
        with LLM(path, sampler="scripted", num_kv_blocks=64, max_model_len=512, progress=False, num_threads=1,
                 grammar_compile_isolation="thread") as llm:
            params = SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=StructuredOutputs(
                json=WEATHER, start_after=start_after))
            return llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0]


def test_the_constraint_starts_after_the_reasoning_marker(qwen_dir):
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    marker = tok.encode("</think>", add_special_tokens=False)
    reasoning = tok.encode("<think>\nweigh it {not json", add_special_tokens=False)
    out = run_scripted(qwen_dir, reasoning + marker, tuple(marker))
    assert out.token_ids[:len(reasoning) + len(marker)] == reasoning + marker  # not masked before the marker
    assert out.finish_reason == "stop"
    thought, _, answer = out.text.partition("</think>")
    assert thought == "<think>\nweigh it {not json"
    jsonschema.validate(json.loads(answer), WEATHER)  # constrained after it


def test_the_constraint_holds_after_the_marker(qwen_dir):
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    marker = tok.encode("</think>", add_special_tokens=False)
    # A token the schema forbids right after the marker: the grammar refuses it, the request ends.
    out = run_scripted(qwen_dir, marker + tok.encode("x", add_special_tokens=False), tuple(marker))
    assert out.finish_reason == "abort" and out.text == "</think>"


class Recorder:
    """A fake inner matcher: what it was given, and a rule of tokens it refuses."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 7

    def accept_token(self, token_id):
        if token_id < 0:
            return False
        self.accepted.append(token_id)
        return True

    def rollback(self, n):
        del self.accepted[len(self.accepted) - n:]

    def is_terminated(self):
        return False

    def reset(self):
        self.accepted.clear()


def test_after_marker_masks_and_rolls_back_across_the_marker():
    inner = Recorder()
    gate = AfterMarker(inner, (8, 9))
    mask = torch.zeros(1, 2, dtype=torch.int32)
    for t in (1, 8, 5, 8):
        assert gate.accept_token(t)
    gate.fill_bitmask(mask, 0)
    assert mask.tolist() == [[-1, -1]] and inner.accepted == []  # inactive: every token
    assert gate.accept_token(9) and gate.accept_token(4) and not gate.accept_token(-1)
    gate.fill_bitmask(mask, 0)
    assert mask.tolist() == [[7, 7]] and inner.accepted == [4]  # active from the marker's last token
    gate.rollback(2)  # back past the marker: inactive again, the inner matcher at its start
    assert inner.accepted == [] and not gate.active and gate.tokens == [1, 8, 5, 8]
    assert gate.accept_token(9) and gate.active and gate.accept_token(3) and inner.accepted == [3]
    gate.rollback(1)  # back to the marker: still active, the inner matcher at its start
    assert gate.active and inner.accepted == [] and not gate.is_terminated()
    gate.reset()
    assert gate.tokens == [] and not gate.active
