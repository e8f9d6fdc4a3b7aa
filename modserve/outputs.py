"""What ``LLM.generate`` returns, where vLLM users import it from (``vllm.outputs``), and
vLLM's shape of logprobs: ``output.logprobs[i][token_id].logprob / .rank / .decoded_token``.

The engine's logprob entries are dicts ``{"token_id", "logprob", "rank", "top"}``
(engine/output.py); the offline API wraps each in a :class:`PositionLogprobs` when an output
finishes, so the server path never pays for the view."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from modserve.core.outputs import CompletionOutput, RequestMetrics, RequestOutput

__all__ = ["CompletionOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "Logprob", "PoolingOutput",
           "PoolingRequestOutput", "PositionLogprobs", "RequestMetrics", "RequestOutput"]

Decode = Callable[[int], str]  # one token id -> its text alone (vLLM's decoded_token)


@dataclass(slots=True)
class Logprob:
    """As vLLM's ``Logprob``: a token's logprob, its rank in the vocabulary (1 = most likely)
    and its text (None when the request asked for no detokenizing)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class PositionLogprobs(Mapping):
    """One position's logprobs as vLLM's ``dict[int, Logprob]``: the sampled (or prompt)
    token first, then the top-N alternatives with ranks 1..N.

    NOTE: the engine entry's own keys ("token_id", "logprob", "rank", "top") still answer,
    so code written against modserve's entries keeps working; token ids are ints, so the two
    key sets never collide."""

    __slots__ = ("entry", "decode", "_by_id")

    def __init__(self, entry: dict[str, Any], decode: Decode | None) -> None:
        self.entry = entry
        self.decode = decode
        self._by_id: dict[int, Logprob] | None = None  # built on first use: scorers reading "logprob" never pay

    def _table(self) -> dict[int, Logprob]:
        if self._by_id is None:
            text, e = self.decode or (lambda _: None), self.entry
            self._by_id = {e["token_id"]: Logprob(e["logprob"], e["rank"], text(e["token_id"]))}
            for rank, (token_id, logprob) in enumerate(e["top"].items(), start=1):
                self._by_id[token_id] = Logprob(logprob, rank, text(token_id))
        return self._by_id

    def __getitem__(self, key: int | str) -> Any:
        return self.entry[key] if isinstance(key, str) else self._table()[key]

    def __iter__(self) -> Iterator[int]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())

    def __repr__(self) -> str:
        return repr(self._table())


def add_vllm_logprobs(out: RequestOutput, decode: Decode | None) -> RequestOutput:
    """``out`` with every logprob entry (each sample's, the prompt's) in vLLM's shape."""
    for sample in out.outputs:
        if sample.logprobs is not None:
            sample.logprobs = [PositionLogprobs(e, decode) for e in sample.logprobs]
    if out.prompt_logprobs is not None:
        out.prompt_logprobs = [None if e is None else PositionLogprobs(e, decode) for e in out.prompt_logprobs]
    return out


# -- what LLM.encode and LLM.embed return (the pooling runner), in vLLM's shapes ---------------
@dataclass(slots=True)
class PoolingOutput:
    data: Any  # torch.Tensor [hidden] float32: the pooled vector


@dataclass(slots=True)
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
