"""Quality through the engine: rolling-window perplexity and loglikelihood tasks.

Everything here is written against a ``ScoreFn``: a batch of token id lists in, per list
the logprob of each token given the tokens before it (and whether it was the argmax) out.
Two scorers provide one: ``OfflineScorer`` (an ``LLM``'s prompt logprobs) and
``ServerScorer`` (``/v1/completions`` with ``echo``, as lm-eval's ``local-completions``).

Perplexity windows (the convention of Hugging Face's perplexity guide, scored exactly):
the scored sequence is the text's tokens, after ``prefix_token`` when one is given (the CLI
passes the tokenizer's BOS if it has one). Its first token is never scored: nothing
predicts it. Windows are ``seq[begin:end]`` with ``begin = k * stride`` and ``end =
min(begin + max_length, len(seq))``, until one reaches the end; each scores only the
tokens after the previous window's end, so every token from position 1 on is scored
exactly once. The first window scores positions 1..end-1; every later one scores its last
``end - previous_end`` tokens with exactly ``max_length - stride`` tokens of context before
them. ``stride < max_length``, so every scored token has at least one token of context.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class TokenScore(NamedTuple):
    logprob: float  # log p(token | the tokens before it)
    greedy: bool  # the token is the argmax there (ties count)


# For each token list of n tokens: n - 1 scores, entry i - 1 for token i.
ScoreFn = Callable[[Sequence[list[int]]], list[list[TokenScore]]]
Encode = Callable[[str], list[int]]


# -- perplexity -----------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Window:
    tokens: list[int]  # the model's input, at most max_length tokens
    num_scored: int  # its last num_scored tokens are scored; the ones before are context


def rolling_windows(seq: Sequence[int], max_length: int, stride: int) -> list[Window]:
    """The windows of the module docstring."""
    if max_length < 2 or not 1 <= stride < max_length:
        raise ValueError(f"need max_length >= 2 and 1 <= stride < max_length (got {max_length}, {stride})")
    if len(seq) < 2:
        raise ValueError(f"{len(seq)} token(s): perplexity needs at least 2 (the first is never scored)")
    windows, begin, prev_end = [], 0, 1  # NOTE: prev_end starts at 1: position 0 has no prediction
    while True:
        end = min(begin + max_length, len(seq))
        windows.append(Window(list(seq[begin:end]), end - prev_end))
        if end == len(seq):
            return windows
        prev_end, begin = end, begin + stride


class Perplexity(NamedTuple):
    nll: float  # summed negative log-likelihood, nats
    num_tokens: int  # tokens scored
    num_windows: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.num_tokens)


def perplexity(score_fn: ScoreFn, token_ids: Sequence[int], max_length: int, stride: int,
               prefix_token: int | None = None) -> Perplexity:
    seq = ([prefix_token] if prefix_token is not None else []) + list(token_ids)
    windows = rolling_windows(seq, max_length, stride)
    scores = score_fn([w.tokens for w in windows])
    nll = -sum(s.logprob for w, row in zip(windows, scores, strict=True) for s in row[len(row) - w.num_scored:])
    return Perplexity(nll, sum(w.num_scored for w in windows), len(windows))


# -- loglikelihood ------------------------------------------------------------------------------
class Loglikelihood(NamedTuple):
    logprob: float  # sum over the continuation's tokens
    greedy: bool  # every continuation token is the argmax: lm-eval's is_greedy


def loglikelihoods(score_fn: ScoreFn, pairs: Sequence[tuple[list[int], list[int]]]) -> list[Loglikelihood]:
    """Each (context ids, continuation ids) pair, scored in one batch."""
    for ctx, cont in pairs:
        if not ctx or not cont:
            raise ValueError("loglikelihood needs a non-empty context and continuation")
    scores = score_fn([ctx + cont for ctx, cont in pairs])
    out = []
    for (ctx, cont), row in zip(pairs, scores, strict=True):
        part = row[len(ctx) - 1:]  # row i - 1 predicts token i: these predict the continuation
        out.append(Loglikelihood(sum(s.logprob for s in part), all(s.greedy for s in part)))
    return out


def loglikelihood(score_fn: ScoreFn, context_ids: list[int], continuation_ids: list[int]) -> Loglikelihood:
    return loglikelihoods(score_fn, [(context_ids, continuation_ids)])[0]


def encode_pair(encode: Encode, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's ``_encode_pair``: trailing spaces of the context move to the continuation,
    the whole string is encoded once, and the continuation is what follows the context's ids."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = encode(context + continuation), encode(context)
    return ctx, whole[len(ctx):]


# -- tasks --------------------------------------------------------------------------------------
class _Example(BaseModel):
    model_config = ConfigDict(extra="forbid")
    context: str

    @field_validator("context")
    @classmethod
    def _context_is_text(cls, context: str) -> str:
        if not context.strip():  # encode_pair moves trailing spaces out: nothing would be left
            raise ValueError("the context is empty or only spaces")
        return context


class MultipleChoice(_Example):
    """``context + choice`` is scored for each choice (write the space into the choices)."""
    choices: list[str] = Field(min_length=2)
    answer: int = Field(ge=0)

    @model_validator(mode="after")
    def _answer_is_a_choice(self) -> "MultipleChoice":
        if self.answer >= len(self.choices):
            raise ValueError(f"answer {self.answer} is not an index of the {len(self.choices)} choices")
        if not all(self.choices):
            raise ValueError("a choice is empty")
        return self


class Cloze(_Example):
    continuation: str = Field(min_length=1)


class TaskFileError(ValueError):
    pass


def load_task(path: str | Path) -> list[MultipleChoice] | list[Cloze]:
    """A JSONL task: every line one kind, multiple choice or cloze; errors say FILE:LINE."""
    examples: list[Any] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskFileError(f"{where}: not JSON: {e.msg} (column {e.colno})") from None
        kind: type[_Example] = MultipleChoice if isinstance(data, dict) and "choices" in data else Cloze
        try:
            example = kind.model_validate(data)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'line'}: {err['msg']}" for err in e.errors())
            raise TaskFileError(f"{where}: not a {kind.__name__.lower()} example: {problems}") from None
        if examples and type(example) is not type(examples[0]):
            raise TaskFileError(f"{where}: a {kind.__name__.lower()} example in a file of "
                                f"{type(examples[0]).__name__.lower()} examples")
        examples.append(example)
    if not examples:
        raise TaskFileError(f"{path}: no examples")
    return examples


def score_task(score_fn: ScoreFn, encode: Encode, examples: Sequence[MultipleChoice] | Sequence[Cloze]
               ) -> dict[str, Any]:
    """lm-eval's metrics. Multiple choice: ``acc`` (the highest summed loglikelihood is the
    answer) and ``acc_norm`` (the highest loglikelihood per UTF-8 byte of the choice; lm-eval
    divides by characters, the same for ASCII). Cloze: ``acc`` (the continuation is greedy)
    and the mean loglikelihood. ``per_example`` holds each example's figures."""
    if isinstance(examples[0], MultipleChoice):
        pairs = [encode_pair(encode, ex.context, c) for ex in examples for c in ex.choices]
        lls = iter(loglikelihoods(score_fn, pairs))
        rows = []
        for ex in examples:
            ll = [next(lls).logprob for _ in ex.choices]
            norm = [x / len(c.encode()) for x, c in zip(ll, ex.choices)]
            rows.append({"loglikelihoods": ll, "pick": _argmax(ll), "pick_norm": _argmax(norm), "answer": ex.answer})
        return {"kind": "multiple_choice", "examples": len(rows),
                "acc": sum(r["pick"] == r["answer"] for r in rows) / len(rows),
                "acc_norm": sum(r["pick_norm"] == r["answer"] for r in rows) / len(rows), "per_example": rows}
    pairs = [encode_pair(encode, ex.context, ex.continuation) for ex in examples]
    rows = [{"loglikelihood": ll.logprob, "greedy": ll.greedy} for ll in loglikelihoods(score_fn, pairs)]
    return {"kind": "cloze", "examples": len(rows), "acc": sum(r["greedy"] for r in rows) / len(rows),
            "mean_loglikelihood": sum(r["loglikelihood"] for r in rows) / len(rows), "per_example": rows}


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)  # the first of ties, as numpy's


# -- scorers ------------------------------------------------------------------------------------
class OfflineScorer:
    """An ``LLM``'s prompt logprobs, ``batch_size`` prompts per ``generate`` call."""

    def __init__(self, llm: Any, batch_size: int = 64) -> None:
        self.llm, self.batch_size = llm, batch_size

    def __call__(self, token_lists: Sequence[list[int]]) -> list[list[TokenScore]]:
        from modserve.core.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        out = []
        for i in range(0, len(token_lists), self.batch_size):
            for r in self.llm.generate(list(token_lists[i:i + self.batch_size]), params, use_tqdm=False):
                # entry 0 is None; the rest hold the prompt token's own logprob and its rank
                out.append([TokenScore(e["logprob"], e["rank"] == 1) for e in r.prompt_logprobs[1:]])
        return out


class ServerScorer:
    """``/v1/completions`` as lm-eval's local-completions calls it: token id prompts,
    ``echo=True, logprobs=1, max_tokens=1, temperature=0``; the echoed prompt's
    ``token_logprobs`` (the first null) are the scores, the generated token's is dropped.
    A token is greedy when its logprob is the largest in its ``top_logprobs`` (the top 1
    and the token itself), as lm-eval decides."""

    def __init__(self, base_url: str, model: str, batch_size: int = 32, timeout: float = 600.0) -> None:
        from openai import OpenAI

        url = base_url.rstrip("/")
        self.client = OpenAI(base_url=url if url.endswith("/v1") else f"{url}/v1", api_key="none",
                             max_retries=0, timeout=timeout)
        self.model, self.batch_size = model, batch_size

    def __call__(self, token_lists: Sequence[list[int]]) -> list[list[TokenScore]]:
        out = []
        for i in range(0, len(token_lists), self.batch_size):
            batch = [list(t) for t in token_lists[i:i + self.batch_size]]
            response = self.client.completions.create(model=self.model, prompt=batch, echo=True, logprobs=1,
                                                      max_tokens=1, temperature=0.0)
            choices = sorted(response.choices, key=lambda c: c.index)
            for ids, choice in zip(batch, choices):
                lps = choice.logprobs.token_logprobs[1:len(ids)]
                tops = choice.logprobs.top_logprobs[1:len(ids)]
                out.append([TokenScore(lp, lp >= max(top.values())) for lp, top in zip(lps, tops)])
        return out


# -- what the commands run ------------------------------------------------------------------------
def plain_encoder(hf_tokenizer: Any) -> Encode:
    """Text to ids without special tokens, as lm-eval's HFLM encodes (``add_bos_token`` off)."""
    return lambda text: hf_tokenizer.encode(text, add_special_tokens=False)


def text_perplexity(score_fn: ScoreFn, hf_tokenizer: Any, text: str, max_length: int,
                    stride: int | None = None) -> dict[str, Any]:
    """A text's perplexity, its first token scored after the tokenizer's BOS if it has one;
    ``stride`` defaults to ``max_length // 2``."""
    stride = stride or max(1, max_length // 2)
    bos = hf_tokenizer.bos_token_id
    result = perplexity(score_fn, plain_encoder(hf_tokenizer)(text), max_length, stride, bos)
    return {"perplexity": result.perplexity, "nll": result.nll, "tokens": result.num_tokens,
            "windows": result.num_windows, "max_length": max_length, "stride": stride,
            "prefix_token": bos}
