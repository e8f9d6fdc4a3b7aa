"""A smaller model that shares the tokenizer drafts tokens for the target to verify."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from modserve.api import Proposal, Proposer, ProposerContext, Sequence, sample_rows


class DraftModelOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(description="Draft checkpoint directory (same tokenizer as the target)")


class DraftModelProposer(Proposer):
    """Runs the draft model ``k`` times per step: once over the tokens it has not
    seen yet (its own prefill / catch-up), then one token at a time.

    NOTE: the draft keeps its own KV tensors but indexes them with the target's
    block tables, so it needs no allocator: the target allocates ``1 + k`` slots
    before proposing, which covers the ``k - 1`` positions the draft writes past
    the sequence. A sequence the draft has not seen (new, forked, preempted) is
    caught up from position 0, so block sharing never leaves it stale KV.
    """

    def __init__(self, context: ProposerContext, options: DraftModelOptions | None = None) -> None:
        super().__init__(context, options)
        if options is None:
            raise ValueError("the draft_model proposer needs options.model (a checkpoint directory)")
        self.draft = context.load_model(options.model)  # a ModelRunner; refuses another vocabulary
        self.computed: dict[int, int] = {}  # seq_id -> tokens whose draft KV is in place

    def forget(self, seq: Sequence) -> None:
        self.computed.pop(seq.seq_id, None)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        ctx = [min(self.computed.get(s.seq_id, 0), s.num_tokens - 1) for s in seqs]
        logits = self.draft.last_token_logits(seqs, [s.token_ids[c:] for s, c in zip(seqs, ctx)], ctx)  # [B, V]
        for s in seqs:
            self.computed[s.seq_id] = s.num_tokens
        batch = self.draft.sampling_batch(seqs)
        greedy = batch.temperature == 0  # [B]
        k = max(num_tokens)
        tokens = torch.zeros(len(seqs), k, dtype=torch.int64, device=logits.device)  # [B, k]
        probs = torch.zeros(len(seqs), k, logits.shape[1], device=logits.device)  # [B, k, V]
        rows = list(range(len(seqs)))  # the sequences still drafting
        for i in range(k):
            p = self.context.sampler.probs(logits, batch)  # [b, V] the request's processed distribution
            tok = torch.where(greedy, p.argmax(dim=1), sample_rows(p, batch.generators))  # [b]
            tokens[rows, i], probs[rows, i] = tok, p
            # Draft past the sequence only into slots the target allocated for it.
            keep = [j for j, r in enumerate(rows) if num_tokens[r] > i + 1]
            if not keep:
                break
            rows = [rows[j] for j in keep]
            drafting = [seqs[r] for r in rows]
            batch = self.draft.sampling_batch(drafting)
            greedy = batch.temperature == 0
            logits = self.draft.last_token_logits(drafting, [[int(tok[j])] for j in keep],
                                                  [s.num_tokens + i for s in drafting])
        return Proposal([tokens[b, : num_tokens[b]].tolist() for b in range(len(seqs))], probs)
