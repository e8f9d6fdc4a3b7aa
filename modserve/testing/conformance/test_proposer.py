"""Proposer: the shape of a ``Proposal`` for sequences about to decode, step after step.

The proposer gets a :class:`~modserve.api.ProposerContext` over the tiny random Llama of
:func:`modserve.testing.cached_checkpoint` (the target; ``draft_model`` drafts with it too),
and sequences whose KV blocks cover ``1 + num_tokens[i]`` new tokens, as the engine calls it.
"""

from __future__ import annotations

import functools

import pytest
import torch

from modserve.api import Proposal, Proposer, ProposerContext, SamplingParams, Sequence, SequenceStatus
from modserve.testing import cached_checkpoint
from modserve.testing.conformance.targets import Implementation

CONFORMANCE_KIND = "proposer"
pytestmark = pytest.mark.usefixtures("modserve_one_thread")

BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN = 16, 64, 256
NUM_TOKENS = [4, 0, 2, 3, 1]  # per sequence, the drafts it may get (0: none this step)


@pytest.fixture(scope="module")
def context() -> ProposerContext:
    from modserve.core.config import EngineConfig, PluginChoice
    from modserve.core.registry import get_registry
    from modserve.runner.model_runner import load_draft

    target = str(cached_checkpoint("llama", "tiny"))
    config = EngineConfig(model=target, dtype="float32", block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                          num_kv_blocks=NUM_BLOCKS)
    registry = get_registry()
    vocab_size = 4096  # the tiny preset's
    sampler = registry.create("sampler", PluginChoice(name="default"), vocab_size)
    draft = functools.partial(load_draft, config=config, registry=registry, dtype=torch.float32,
                              num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN, vocab_size=vocab_size)
    return ProposerContext(config, registry, torch.device("cpu"), torch.float32, NUM_BLOCKS, BLOCK_SIZE,
                           MAX_MODEL_LEN, vocab_size, sampler, draft)


@pytest.fixture(scope="module")
def proposer(implementation: Implementation, context: ProposerContext) -> Proposer:
    return implementation.create(context)


def sequences(first_id: int, vocab_size: int) -> list[Sequence]:
    """Decoding sequences, repetitive (a lookup finds matches) and random, greedy and seeded,
    each with the blocks for its tokens and drafts (disjoint tables)."""
    gen = torch.Generator().manual_seed(first_id)
    seqs = []
    for i, k in enumerate(NUM_TOKENS):
        if i % 2 == 0:
            tokens = (torch.randint(3, vocab_size, (5,), generator=gen).tolist() * 4)[: 9 + 3 * i]
        else:
            tokens = torch.randint(3, vocab_size, (7 + 5 * i,), generator=gen).tolist()
        params = SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=None if i % 2 else i)
        seq = Sequence(first_id + i, f"r{first_id + i}", tokens, len(tokens) - 2, params, 0.0,
                       num_computed_tokens=len(tokens) - 1, status=SequenceStatus.RUNNING)
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        blocks = -(-(len(tokens) + 1 + k) // BLOCK_SIZE)
        seq.block_ids = list(range(i * 8, i * 8 + blocks))  # 8 blocks per sequence at most
        seqs.append(seq)
    return seqs


def check(proposal: Proposal, seqs: list[Sequence], num_tokens: list[int], vocab_size: int, step: str) -> None:
    assert isinstance(proposal, Proposal), f"{step}: propose must return a Proposal, got {type(proposal).__name__}"
    ids = proposal.token_ids
    assert len(ids) == len(seqs), f"{step}: {len(ids)} token lists for {len(seqs)} sequences"
    for i, (drafts, k) in enumerate(zip(ids, num_tokens)):
        assert len(drafts) <= k, f"{step}: sequence {i} got {len(drafts)} drafts {drafts}, at most {k} were asked for"
        bad = [t for t in drafts if not (isinstance(t, int) and 0 <= t < vocab_size)]
        assert not bad, f"{step}: sequence {i}'s drafts {bad} are not token ids in [0, {vocab_size})"
    if proposal.probs is None:
        return
    p = proposal.probs
    longest = max(len(d) for d in ids)
    assert p.dim() == 3 and p.shape[0] == len(seqs) and p.shape[1] >= longest and p.shape[2] == vocab_size, (
        f"{step}: probs must be [B, K, V] with B = {len(seqs)}, K >= {longest}, V = {vocab_size}; got {tuple(p.shape)}")
    for i, drafts in enumerate(ids):
        for j, t in enumerate(drafts):
            row = p[i, j].double()
            assert float(row.min()) >= 0 and abs(float(row.sum()) - 1) < 1e-4, (
                f"{step}: probs[{i}, {j}] (the distribution of draft {j}) sums to {float(row.sum()):.5f}; it must be "
                f"a distribution")
            assert float(row[t]) > 0, (
                f"{step}: draft {t} of sequence {i} has probability 0 in the distribution it came from")


def test_proposals_fit_what_was_asked(implementation: Implementation, proposer: Proposer,
                                      context: ProposerContext) -> None:
    """``propose`` returns one list per sequence of at most ``num_tokens[i]`` token ids, with
    ``probs`` None or ``[B, K, V]`` distributions; again on the next step, after some drafts
    were accepted and a token sampled."""
    seqs = sequences(0, context.vocab_size)
    for step in range(2):
        proposal = proposer.propose(seqs, list(NUM_TOKENS))
        check(proposal, seqs, NUM_TOKENS, context.vocab_size, f"step {step}")
        for seq, drafts, k in zip(seqs, proposal.token_ids, NUM_TOKENS):
            accepted = drafts[: len(drafts) // 2] + [7]  # some drafts, then the target's own token
            seq.token_ids.extend(accepted)
            seq.num_computed_tokens = seq.num_tokens - 1
            first = seq.block_ids[0]  # the table grows to cover the next step's drafts
            seq.block_ids = list(range(first, first + -(-(seq.num_tokens + 1 + k) // BLOCK_SIZE)))


def test_forget_then_propose_for_new_sequences(implementation: Implementation, proposer: Proposer,
                                               context: ProposerContext) -> None:
    """``forget`` takes any sequence (one never proposed for included), and proposing for new
    sequences on the same blocks works after it."""
    old = sequences(100, context.vocab_size)
    proposer.propose(old, list(NUM_TOKENS))
    never = sequences(200, context.vocab_size)[0]
    for seq in (*old, never):
        raised: Exception | None = None
        try:
            proposer.forget(seq)
        except Exception as e:  # noqa: BLE001 - forget must take any sequence
            raised = e
        if raised is not None:
            seen = "one it never proposed for" if seq is never else "one it proposed for"
            pytest.fail(f"forget(sequence {seq.seq_id}, {seen}) raised {type(raised).__name__}: {raised}; the engine "
                        f"calls it for every finished, aborted or preempted sequence")
    new = sequences(300, context.vocab_size)
    check(proposer.propose(new, list(NUM_TOKENS)), new, NUM_TOKENS, context.vocab_size, "after forget")
