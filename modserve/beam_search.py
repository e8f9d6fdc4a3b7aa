"""Beam search as vLLM builds it on top of the engine (its ``vllm/beam_search.py``): no beam
state inside the engine, only one-token requests.

Each step, every live beam (its prompt and tokens so far) goes to the engine as a request
for one token with the top ``2 * beam_width`` logprobs; each beam grows by each of those
tokens (and the sampled one, which temperature 0 makes the top one), and the best
``beam_width`` of all the grown beams live on. A beam that grows by EOS is finished (unless
``ignore_eos``). After ``max_tokens`` steps the finished and the live beams are ranked
together by ``cum_logprob / len(tokens) ** length_penalty`` (the prompt counted, a final EOS
not: vLLM's score) and the best ``beam_width`` are the answer. The prefix cache makes the
prefill of a beam's shared prefix cheap; the caller drives the steps (``LLM.beam_search``
offline, the server's routes through its EngineClient).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from modserve.core.sampling_params import SamplingParams

# |length_penalty| at most this: a length of a million tokens to its power stays a finite float.
MAX_LENGTH_PENALTY = 10.0


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: ``LLM.beam_search``'s settings."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY:
            raise ValueError(f"length_penalty must be within [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}], "
                             f"got {self.length_penalty}")

    def step_params(self) -> SamplingParams:
        """What each beam's one-token request asks of the engine."""
        return SamplingParams(max_tokens=1, logprobs=2 * self.beam_width, temperature=self.temperature,
                              ignore_eos=True)


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam, as vLLM's: ``tokens`` holds the prompt's, then the generated ones (a final EOS
    included); ``logprobs`` one entry per generated token."""

    tokens: list[int]
    logprobs: list[Any] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None  # filled when the search ends
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | str | None = None  # the EOS id that ended it


@dataclass(slots=True)
class BeamSearchOutput:
    """vLLM's: the best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(tokens: list[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float) -> float:
    """vLLM's ranking: the whole sequence's length (prompt included, a final EOS not)."""
    length = len(tokens) - (1 if tokens[-1] == eos_token_id else 0)
    return cum_logprob / (length ** length_penalty)


def candidates(entry: dict[str, Any]) -> dict[int, float]:
    """A step's token choices from the engine's logprob entry: the sampled token, then the top ones."""
    found = {entry["token_id"]: entry["logprob"]}
    for token_id, logprob in entry["top"].items():
        found.setdefault(token_id, logprob)
    return found


class BeamSearch:
    """One prompt's search. The caller sends ``live_prompts()`` to the engine (one request
    each, ``params.step_params()``), hands their logprob entries to ``advance`` in the same
    order, and repeats until ``done``; ``best()`` then ranks."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_id: int | None) -> None:
        self.prompt_len = len(prompt_token_ids)
        self.params = params
        self.eos = None if params.ignore_eos else eos_token_id
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.beams or self.steps >= self.params.max_tokens

    def live_prompts(self) -> list[list[int]]:
        return [beam.tokens for beam in self.beams]

    def _key(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam.tokens, beam.cum_logprob, self.eos, self.params.length_penalty)

    def advance(self, entries: list[dict[str, Any]]) -> None:
        """Grow each live beam by its step's candidates (``entries[i]``: beam i's one token's
        logprob entry) and keep the best ``beam_width`` that did not end."""
        if len(entries) != len(self.beams):
            raise ValueError(f"{len(entries)} step outputs for {len(self.beams)} beams")
        grown = []
        for beam, entry in zip(self.beams, entries):
            for token_id, logprob in candidates(entry).items():
                seq = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [entry],
                                         beam.cum_logprob + logprob)
                if token_id == self.eos:
                    seq.finish_reason, seq.stop_reason = "stop", token_id
                    self.completed.append(seq)
                else:
                    grown.append(seq)
        grown.sort(key=self._key, reverse=True)  # stable: ties keep the engine's order
        self.beams = grown[:self.params.beam_width]
        self.steps += 1

    def best(self) -> list[BeamSearchSequence]:
        """The best ``beam_width`` of the finished and the live beams, best first."""
        for beam in self.beams:
            beam.finish_reason = "length"
        ranked = sorted(self.completed + self.beams, key=self._key, reverse=True)
        return ranked[:self.params.beam_width]

    def output_tokens(self, beam: BeamSearchSequence) -> list[int]:
        """The generated tokens a response shows: a final EOS only with include_stop_str_in_output."""
        tokens = beam.tokens[self.prompt_len:]
        if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            tokens = tokens[:-1]
        return tokens


def step_entry(out: Any) -> Any:
    """A one-token step request's logprob entry, from its finished RequestOutput; a RuntimeError
    with the engine's reason when the engine failed it (finish_reason "error")."""
    sample = out.outputs[0]
    if sample.finish_reason == "error" or not sample.logprobs:
        raise RuntimeError(f"the engine failed a beam-search step: {out.error or sample.finish_reason}")
    return sample.logprobs[0]


def check_beam_search(params: BeamSearchParams, prompt_len: int, max_model_len: int, max_logprobs: int) -> None:
    """The bounds a search must fit (each ValueError starts with the field at fault): every step
    asks ``2 * beam_width`` logprobs (so max_logprobs bounds the width, as in vLLM), and the
    longest beam must fit the context."""
    if 2 * params.beam_width > max_logprobs:
        raise ValueError(f"beam_width must be at most max_logprobs/2={max_logprobs // 2} (each step asks the top "
                         f"2*beam_width logprobs), got {params.beam_width}")
    if prompt_len + params.max_tokens > max_model_len:
        raise ValueError(f"max_tokens is too large: {params.max_tokens}. This model's maximum context length is "
                         f"{max_model_len} tokens and the prompt has {prompt_len} tokens")
