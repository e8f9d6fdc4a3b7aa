"""Benchmark workloads: what each request sends and how many tokens it must generate.

Every loader is deterministic for a given seed. Text prompts keep their text (a server
is sent the text); offline runs tokenize them once with :func:`tokenize`, so modserve
and the ``hf`` baseline see the very same token ids.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

DEFAULT_WORKLOAD = Path(__file__).parent / "data" / "sharegpt-128.jsonl"
KINDS = ("default", "random", "prefix-repetition", "multi-turn", "few-shot", "custom", "sharegpt")


@dataclass(slots=True)
class BenchRequest:
    prompt: str | None  # the text, when the workload has one
    prompt_token_ids: list[int] | None
    output_len: int  # tokens to generate (EOS is ignored so that the count is exact)

    @property
    def prompt_len(self) -> int | None:
        return None if self.prompt_token_ids is None else len(self.prompt_token_ids)


def token_pool(tokenizer: Any) -> np.ndarray:
    """Every ordinary token id of an HF tokenizer: random prompts never contain special tokens."""
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)


def _lengths(rng: np.random.Generator, n: int, mean: int, range_ratio: float) -> np.ndarray:
    # Uniform in [mean * (1 - r), mean * (1 + r)], as vLLM's random dataset draws them.
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, round(mean * (1 - range_ratio)))
    hi = max(lo, round(mean * (1 + range_ratio)))
    return rng.integers(lo, hi + 1, size=n)


def random_requests(num: int, input_len: int, output_len: int, pool: np.ndarray,
                    range_ratio: float = 0.0, prefix_len: int = 0, seed: int = 0) -> list[BenchRequest]:
    """Random token prompts of ``input_len`` (±range) after a ``prefix_len`` prefix all requests share."""
    rng = np.random.default_rng(seed)
    prefix = rng.choice(pool, prefix_len).tolist()
    ins = _lengths(rng, num, input_len, range_ratio)
    outs = _lengths(rng, num, output_len, range_ratio)
    return [BenchRequest(None, prefix + rng.choice(pool, int(n)).tolist(), int(m)) for n, m in zip(ins, outs)]


def prefix_repetition_requests(num: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                               output_len: int, pool: np.ndarray, seed: int = 0) -> list[BenchRequest]:
    """``num_prefixes`` distinct prefixes, each reused by ``num / num_prefixes`` requests
    with their own random suffix; the order is shuffled so repeats are not adjacent."""
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be at least 1, got {num_prefixes}")
    rng = np.random.default_rng(seed)
    prefixes = [rng.choice(pool, prefix_len).tolist() for _ in range(num_prefixes)]
    reqs = [BenchRequest(None, prefixes[i % num_prefixes] + rng.choice(pool, suffix_len).tolist(), output_len)
            for i in range(num)]
    return [reqs[i] for i in rng.permutation(num)]


def custom_requests(path: str | Path, num: int | None = None) -> list[BenchRequest]:
    """JSONL, one request a line: ``prompt`` (text) or ``prompt_token_ids``, and
    ``output_tokens`` (or ``output_len``, the field of the shared reference workload)."""
    reqs = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            out = row.get("output_tokens", row.get("output_len"))
            if out is None or ("prompt" not in row and "prompt_token_ids" not in row):
                raise ValueError(f"{path}:{lineno}: needs 'prompt' or 'prompt_token_ids', and 'output_tokens'")
            reqs.append(BenchRequest(row.get("prompt"), row.get("prompt_token_ids"), int(out)))
            if num is not None and len(reqs) == num:
                break
    return reqs


def sharegpt_requests(path: str | Path, num: int, seed: int = 0, tokenizer: Any = None,
                      output_len: int | None = None) -> list[BenchRequest]:
    """ShareGPT-format JSON (``[{"conversations": [{"from", "value"}, ...]}]``), shuffled by
    ``seed``: the prompt is the first turn; the output length is ``output_len`` or else the
    token count of the second turn (which needs ``tokenizer``)."""
    convs = [c["conversations"] for c in json.loads(Path(path).read_text()) if c.get("conversations")]
    rng = np.random.default_rng(seed)
    reqs = []
    for i in rng.permutation(len(convs)):
        turns = convs[i]
        if output_len is not None:
            n = output_len
        elif len(turns) > 1 and tokenizer is not None:
            n = len(tokenizer.encode(turns[1]["value"], add_special_tokens=False))
        else:
            continue  # no way to know how long the answer should be
        if n >= 1 and turns[0]["value"]:
            reqs.append(BenchRequest(turns[0]["value"], None, n))
        if len(reqs) == num:
            break
    if not reqs:
        raise ValueError(f"{path}: no usable conversation (give --output-len when they have one turn)")
    return reqs


def multi_turn_requests(num: int, turn_len: int, output_len: int, num_turns: int, pool: np.ndarray,
                        prefix_len: int = 0, seed: int = 0) -> list[BenchRequest]:
    """Chats of ``num_turns`` turns, ``num / num_turns`` of them: turn t's prompt is turn t-1's
    prompt, a stand-in reply of ``output_len`` tokens and a new message of ``turn_len`` tokens,
    after a ``prefix_len`` system prompt all chats share. Ordered turn by turn (every chat's
    first turn, then every second turn, ...), as chats arrive at a server."""
    if num_turns < 1:
        raise ValueError(f"num_turns must be at least 1, got {num_turns}")
    rng = np.random.default_rng(seed)
    system = rng.choice(pool, prefix_len).tolist()
    chats = [list(system) for _ in range(-(-num // num_turns))]
    reqs: list[BenchRequest] = []
    for turn in range(num_turns):
        for chat in chats:
            if turn:
                chat.extend(rng.choice(pool, output_len).tolist())  # the reply the client sends back
            chat.extend(rng.choice(pool, turn_len).tolist())
            reqs.append(BenchRequest(None, list(chat), output_len))
    return reqs[:num]


def few_shot_requests(num: int, shot_len: int, question_len: int, output_len: int, pool: np.ndarray,
                      num_shots: int = 3, branching: int = 2, prefix_len: int = 0, seed: int = 0) -> list[BenchRequest]:
    """Few-shot prompts that branch: an instruction of ``prefix_len`` tokens, then ``num_shots``
    examples of ``shot_len`` tokens, the i-th picked from ``branching`` candidates for that
    position, then a question of ``question_len`` tokens. The prompts form a tree: two share
    the instruction and as many leading examples as their picks agree on."""
    rng = np.random.default_rng(seed)
    instruction = rng.choice(pool, prefix_len).tolist()
    shots = [[rng.choice(pool, shot_len).tolist() for _ in range(branching)] for _ in range(num_shots)]
    reqs = []
    for _ in range(num):
        picks = rng.integers(0, branching, size=num_shots)
        prompt = instruction + [t for i, pick in enumerate(picks) for t in shots[i][pick]]
        reqs.append(BenchRequest(None, prompt + rng.choice(pool, question_len).tolist(), output_len))
    return reqs


def tokenize(requests: Sequence[BenchRequest], tokenizer: Any) -> list[BenchRequest]:
    """Fill in the token ids of text prompts (an HF tokenizer or modserve's Tokenizer)."""
    return [r if r.prompt_token_ids is not None
            else BenchRequest(r.prompt, tokenizer.encode(r.prompt), r.output_len) for r in requests]


def workload_kind(value: str) -> str:
    """``--workload`` / ``--dataset-name``: vLLM spells ``prefix_repetition`` with an underscore."""
    return value.replace("_", "-")


def add_workload_flags(parser: argparse.ArgumentParser, num_prompts: int = 64) -> None:
    """The workload flags; each also answers to vLLM's ``bench`` spelling (``--dataset-name``,
    ``--random-input-len``, ...)."""
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", "--dataset-name", type=workload_kind, choices=KINDS, default="default",
                   help="default: 128 real ShareGPT prompts shipped with modserve")
    g.add_argument("--workload-path", "--dataset-path", help="file for custom (JSONL) and sharegpt (JSON)")
    g.add_argument("--num-prompts", type=int, default=num_prompts)
    g.add_argument("--input-len", "--random-input-len", type=int, default=128, help="random: prompt tokens")
    g.add_argument("--output-len", "--random-output-len", "--sharegpt-output-len", "--custom-output-len",
                   "--prefix-repetition-output-len", type=int, default=None,
                   help="output tokens (random: default 64; others: overrides the file's)")
    g.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.0,
                   help="random: lengths vary by ± this fraction")
    g.add_argument("--prefix-len", "--random-prefix-len", "--prefix-repetition-prefix-len", type=int, default=0,
                   help="random: shared prefix; prefix-repetition: prefix")
    g.add_argument("--suffix-len", "--prefix-repetition-suffix-len", type=int, default=64,
                   help="prefix-repetition: per-request suffix")
    g.add_argument("--num-prefixes", "--prefix-repetition-num-prefixes", type=int, default=4,
                   help="prefix-repetition: distinct prefixes")
    g.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per chat (--input-len tokens each)")
    g.add_argument("--num-shots", type=int, default=3,
                   help="few-shot: examples per prompt (--suffix-len tokens each; the question --input-len)")
    g.add_argument("--branching", type=int, default=2, help="few-shot: candidates for each example's position")
    g.add_argument("--workload-seed", type=int, default=0)


def load_workload(args: argparse.Namespace, tokenizer: Any = None) -> list[BenchRequest]:
    """The workload the flags of :func:`add_workload_flags` describe. Random kinds need
    ``tokenizer`` (an HF tokenizer) for the vocabulary."""
    kind, num, seed = args.workload, args.num_prompts, args.workload_seed
    if kind in ("random", "prefix-repetition", "multi-turn", "few-shot"):
        if tokenizer is None:
            raise ValueError(f"the {kind} workload needs a tokenizer (--tokenizer) for its vocabulary")
        pool = token_pool(tokenizer)
        out = args.output_len or 64
        if kind == "random":
            return random_requests(num, args.input_len, out, pool, args.range_ratio, args.prefix_len, seed)
        if kind == "multi-turn":
            return multi_turn_requests(num, args.input_len, out, args.num_turns, pool, args.prefix_len, seed)
        if kind == "few-shot":
            return few_shot_requests(num, args.suffix_len, args.input_len, out, pool, args.num_shots, args.branching,
                                     args.prefix_len, seed)
        return prefix_repetition_requests(num, args.prefix_len or 256, args.suffix_len, args.num_prefixes,
                                          out, pool, seed)
    if kind == "sharegpt":
        if not args.workload_path:
            raise ValueError("the sharegpt workload needs --workload-path FILE.json")
        return sharegpt_requests(args.workload_path, num, seed, tokenizer, args.output_len)
    if kind == "custom" and not args.workload_path:
        raise ValueError("the custom workload needs --workload-path FILE.jsonl")
    reqs = custom_requests(args.workload_path if kind == "custom" else DEFAULT_WORKLOAD, num)
    if args.output_len:
        reqs = [BenchRequest(r.prompt, r.prompt_token_ids, args.output_len) for r in reqs]
    return reqs
