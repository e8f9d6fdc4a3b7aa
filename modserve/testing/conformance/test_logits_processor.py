"""Logits processor: rows without its arguments are left as they are, an argmax-invariant one keeps
every argmax, and a row's state follows its request when rows are removed, added and moved.

Requests are made of the implementation's ``examples`` (extra_args that make it act) and tokens
that repeat, so history-based processors have something to act on; the logits are random.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from modserve.api import AddedRequest, BatchUpdate, LogitsProcessor, MoveDirectionality, SamplingParams
from modserve.testing.conformance.targets import Implementation

CONFORMANCE_KIND = "logits_processor"
pytestmark = pytest.mark.usefixtures("modserve_one_thread")

VOCAB = 64
# (prompt, output) per request: repeated n-grams, different per request
TOKENS = [([5, 6, 7, 5, 6, 7], [5, 6]), ([9, 10, 9, 10, 9], [10, 9]), ([3, 4, 3, 4], [3]), ([1, 2, 1, 2, 1], [2])]


def make(implementation: Implementation) -> LogitsProcessor:
    from modserve.core.config import EngineConfig

    return implementation.create(EngineConfig.model_construct(), torch.device("cpu"), False)


def examples(implementation: Implementation) -> tuple[dict[str, Any], ...]:
    found = implementation.load().examples
    if not found:
        pytest.skip(f"{implementation} gives no examples (LogitsProcessor.examples)")
    return found


def request(i: int, args: dict[str, Any] | None, row: int) -> AddedRequest:
    prompt, output = TOKENS[i]
    return AddedRequest(row, SamplingParams(extra_args=args), list(prompt), list(output))


def logits_of(rows: int, seed: int = 0) -> torch.Tensor:  # [rows, VOCAB]
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def run(p: LogitsProcessor, update: BatchUpdate | None, logits: torch.Tensor) -> torch.Tensor:
    p.update_state(update)
    out = p.apply(logits.clone())
    assert isinstance(out, torch.Tensor) and out.shape == logits.shape, (
        f"apply() must return the logits [B, V] = {list(logits.shape)}, got {getattr(out, 'shape', out)}")
    return out


def test_rows_without_arguments_are_untouched(implementation: Implementation) -> None:
    """Contract: apply changes only rows whose request enabled the processor; its examples do."""
    ex = examples(implementation)
    for args in ex:
        p = make(implementation)
        added = [request(0, args, 0), request(1, None, 1), request(2, args, 2), request(3, {"unrelated": 1}, 3)]
        logits = logits_of(4)
        out = run(p, BatchUpdate(4, [], added, []), logits)
        for row in (1, 3):
            assert torch.equal(out[row], logits[row]), (
                f"{implementation} changed row {row}, whose request has no arguments for it (extra_args "
                f"{added[row].params.extra_args}): such rows must be unchanged")
    acted = False
    for args in ex:
        p = make(implementation)
        logits = logits_of(2)
        out = run(p, BatchUpdate(2, [], [request(0, args, 0), request(2, args, 1)], []), logits)
        acted |= not torch.equal(out, logits)
    assert acted, f"{implementation} changed no row for any of its examples {ex}: examples must make it act"


def test_argmax_invariant_processors_keep_the_argmax(implementation: Implementation) -> None:
    """Contract: is_argmax_invariant() True promises no row's argmax changes (greedy rows skip it)."""
    p = make(implementation)
    if not p.is_argmax_invariant():
        pytest.skip(f"{implementation} is not argmax-invariant: it runs for greedy rows too")
    for args in examples(implementation):
        update = BatchUpdate(4, [], [request(i, args, i) for i in range(4)], [])
        logits = logits_of(4, seed=1)
        changed = run(make(implementation), update, logits) != logits  # [4, V]
        # Each row's first changed token made its argmax: where a change could move the argmax.
        for row, col in [(r, int(c.nonzero()[0])) for r, c in enumerate(changed) if c.any()]:
            logits[row, col] = logits[row].max() + 1.0
        out = run(make(implementation), update, logits)
        assert torch.equal(out.argmax(-1), logits.argmax(-1)), (
            f"{implementation} says is_argmax_invariant() but changed the argmax of rows "
            f"{(out.argmax(-1) != logits.argmax(-1)).nonzero().flatten().tolist()}")


def test_state_follows_the_requests_when_rows_change(implementation: Implementation) -> None:
    """Contract: after removed, added and moved rows (in that order), each request's row is
    processed as it was at its old place; update_state(None) changes nothing."""
    ex = examples(implementation)
    p = make(implementation)
    args = [ex[0], None, ex[-1], ex[0]]
    reqs = [request(i, a, i) for i, a in enumerate(args)]
    rows = logits_of(4, seed=2)  # request i's logits, whichever row it is in
    first = run(p, BatchUpdate(4, [], reqs, []), rows)

    def check(order: list[int], update: BatchUpdate | None, what: str) -> None:
        out = run(p, update, rows[order])
        for row, i in enumerate(order):
            assert torch.equal(out[row], first[i]), (
                f"{implementation}: after {what}, request {i} (now row {row}) was processed differently than "
                f"at row {i}: its state must follow it")

    check([2, 1, 0, 3], BatchUpdate(4, [], [], [(0, 2, MoveDirectionality.SWAP)]), "swapping rows 0 and 2")
    check([2, 3, 0], BatchUpdate(3, [1], [], [(3, 1, MoveDirectionality.UNIDIRECTIONAL)]),
          "removing row 1 and moving row 3 to it")
    check([2, 3, 0], None, "an update of None")
    check([1, 3, 0], BatchUpdate(3, [0], [request(1, args[1], 0)], []), "replacing row 0")
