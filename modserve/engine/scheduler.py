"""The core side of scheduling: queues, token budget, blocks. Policies only decide.

A scheduling policy (a ``Scheduler`` plugin) reads this object through the
``SchedulerView`` interface and returns a ``Schedule``; :meth:`SchedulerCore.step`
checks it in full before changing anything, so a faulty policy cannot leave the
queues or the allocator in a broken state. After the runner executed the step,
:meth:`SchedulerCore.update` applies what it computed: progress, then each sampled token
with the stops a token decides (EOS, stop token ids, the grammar, max_tokens, the context).
This object is the one writer of the sequences: the engine and its output processor change
neither them, the queues nor the allocator; a stop string the output side finds comes back
through :meth:`SchedulerCore.finish`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from typing import Collection, Iterable, Literal, Mapping

from modserve.core.contracts.grammar_backend import GrammarMatcher
from modserve.core.contracts.kv_connector import BlockTransfer, KVConnector, KVRole
from modserve.core.contracts.kv_allocator import KVAllocator, block_keys
from modserve.core.contracts.scheduler import Schedule, Scheduler, SchedulerLimits, SchedulerView
from modserve.core.plugin_calls import broke, calling, described, failed, who
from modserve.core.registry import PluginError
from modserve.core.sequence import Sequence, SequenceStatus
from modserve.core.step import ModelOutput, ScheduledStep

logger = logging.getLogger("modserve")

class SwapSpace:
    """Host-memory blocks that hold the KV of sequences preempted by swapping."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.held: dict[int, list[int]] = {}  # seq_id -> host blocks, in block-table order

    def take(self, seq: Sequence) -> list[int] | None:
        n = len(seq.block_ids)
        if n > len(self.free_ids):
            return None
        ids = [self.free_ids.popleft() for _ in range(n)]
        self.held[seq.seq_id] = ids
        return ids

    def give_back(self, ids: list[int]) -> None:
        self.free_ids.extend(ids)




class SchedulerCore(SchedulerView):
    def __init__(self, policy: Scheduler, allocator: KVAllocator, limits: SchedulerLimits, policy_name: str,
                 preemption_mode: Literal["recompute", "swap"] = "recompute",
                 swap_space: SwapSpace | None = None, connector: KVConnector | None = None,
                 kv_role: KVRole = "both", eos_token_ids: Collection[int] = (), max_loras: int = 0) -> None:
        self.policy = policy
        self.max_loras = max_loras  # enable_lora: the most distinct adapters running at once
        if max_loras and getattr(allocator, "caching", False) and not allocator.keys_by_adapter:
            raise ValueError(f"enable_lora: the KV allocator {type(allocator).__name__} does not keep adapters' "
                             "prefix-cache blocks apart: use kv_allocator paged or radix, or its "
                             "enable_prefix_caching off")
        self.eos_token_ids = frozenset(eos_token_ids)
        self.allocator = allocator
        self.limits = limits
        self.policy_name = policy_name
        self.preemption_mode = preemption_mode
        self.swap_space = swap_space
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.preemptions = {"recompute": 0, "swap": 0}
        self.blocks_swapped = {"out": 0, "in": 0}
        self._swapped_in: list[int] = []  # host blocks this step copies back; free once it ran
        self.connector = connector
        self.kv_role = kv_role
        self.kv_blocks = {"loaded": 0, "saved": 0, "load_failed": 0}  # the connector's blocks, moved
        # Pipeline parallel with batches in flight (engine/pipeline_step.py): up to this many
        # steps run at once, of disjoint sequences; a sequence in a step not yet applied is in
        # flight (its next token unknown): the policy does not see it, and its blocks, should it
        # end meanwhile, are freed once that step is applied or abandoned.
        self.pipeline_depth = 1
        self.in_flight: set[Sequence] = set()
        self._free_later: list[Sequence] = []
        # Swap-outs of a step that scheduled no sequence (its one visible sequence preempted
        # itself: the others are in flight): no runner call carries them, so the next step
        # that runs does, before its forward reuses the blocks.
        self._swap_out_later: list[tuple[int, int]] = []

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions.values())

    # -- SchedulerView --------------------------------------------------------
    def free_blocks(self) -> int:
        return self.allocator.num_free_blocks()

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return self.allocator.blocks_needed(seq, seq.num_computed_tokens + num_new_tokens)

    def blocks_freed_by(self, seq: Sequence) -> int:
        return self.allocator.blocks_freed_by(seq)

    def cached_tokens(self, seq: Sequence) -> int:
        return self.allocator.cached_prefix_tokens(seq)

    # -- queue changes ----------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one: it holds blocks and runs from the next step."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
                break
        if self.swap_space is not None and seq.seq_id in self.swap_space.held:
            self.swap_space.give_back(self.swap_space.held.pop(seq.seq_id))
        if seq in self.in_flight:  # NOTE: a step not yet applied reads its blocks
            self._free_later.append(seq)
        else:
            self.allocator.free(seq)
        seq.status = SequenceStatus.FINISHED

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None,
               num_output_tokens: int | None = None) -> None:
        """End ``seq`` for a reason found outside a step (an abort, an error, a stop string in its
        text), keeping only its first ``num_output_tokens`` outputs when given (the tokens after a
        stop string). A sequence that already finished keeps its blocks freed."""
        if num_output_tokens is not None:
            del seq.token_ids[seq.num_prompt_tokens + num_output_tokens:]
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if not seq.is_finished:
            self.remove(seq)

    def request_ids_in_flight(self) -> list[str]:
        """The requests with a sequence in a queue, running first, each once."""
        return list(dict.fromkeys(s.request_id for s in (*self.running, *self.swapped, *self.waiting)))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def evict_all(self) -> list[Sequence]:
        """Empty every queue after a failed step: each sequence drops its KV (device and
        host) and keeps its tokens, as a recompute preemption does. Returns them running
        first (in admission order), then swapped, then waiting, for the engine to re-add."""
        seqs = [*self.running, *self.swapped, *self.waiting]
        self.running, self.swapped, self.waiting = [], deque(), deque()
        self._give_back_swapped_in()  # the failed step's, if it swapped any in
        self._swap_out_later = []  # the host blocks they would fill go back below
        self.in_flight.clear()  # NOTE: the engine abandoned every step in flight first
        for seq in self._free_later:
            self.allocator.free(seq)
        self._free_later = []
        for seq in seqs:
            if self.swap_space is not None and seq.seq_id in self.swap_space.held:
                self.swap_space.give_back(self.swap_space.held.pop(seq.seq_id))
            self.allocator.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        return seqs

    # -- one step ---------------------------------------------------------------------
    def step(self, lookahead: Mapping[Sequence, int] | None = None) -> ScheduledStep:
        """One step's schedule. ``lookahead``: the draft slots each running sequence may be granted
        beyond its tokens (speculative decoding), seen by the policy for this schedule only."""
        lookahead = lookahead or {}
        for seq, n in lookahead.items():
            seq.num_lookahead = n
        try:
            return self._schedule()
        finally:
            for seq in lookahead:
                seq.num_lookahead = 0

    def _schedule(self) -> ScheduledStep:
        waiting, self.waiting = self.waiting, self._admissible(self.waiting)
        running, limits = self.running, self.limits
        if self.pipeline_depth > 1:
            self.running, hidden = self._schedulable(running)
            self.limits = dataclasses.replace(limits, max_num_seqs=limits.max_num_seqs - hidden)
        try:  # the policy sees only the waiting sequences whose adapter fits beside the running ones'
            with calling(self.policy, "scheduler", "schedule()"):
                schedule = self.policy.schedule(self)
        finally:
            self.waiting, self.running, self.limits = waiting, running, limits
        if not isinstance(schedule, Schedule) or not isinstance(schedule.tokens, dict):
            raise broke(self.policy, "scheduler", "schedule()", "a Schedule (tokens: a dict of sequence -> int)",
                        described(schedule))
        needs = self._check(schedule)
        out = ScheduledStep([], [], list(schedule.preempt))
        for seq in schedule.preempt:
            self._preempt(seq, out)
        if schedule.preempt:  # a block it shared with a scheduled sequence may need no copy now
            needs = [self.blocks_needed(seq, n) for seq, n in schedule.tokens.items()]
        # The blocks each sequence takes; what is left of them is kept for the sequences
        # still to allocate, so a prefix match cannot eat into their share.
        reserved = sum(needs)
        for (seq, n), need in zip(schedule.tokens.items(), needs):
            reserved -= need
            external = 0
            if seq.status is SequenceStatus.WAITING:
                self.waiting.remove(seq)
                # NOTE: a cached prefix has no logits: prompt logprobs recompute it (vLLM's rule).
                if not seq.block_ids and seq.params.prompt_logprobs is None:
                    n, external = self._match_prefix(seq, n, self.free_blocks() - reserved)
            elif seq.status is SequenceStatus.SWAPPED:
                self.swapped.remove(seq)
            if seq.status is not SequenceStatus.RUNNING:
                self.running.append(seq)
            self._allocate(seq, seq.num_computed_tokens + n)
            if external:
                first = (seq.num_computed_tokens - external) // self.allocator.block_size
                remote = remote_kv(seq)
                out.kv_loads[seq] = [BlockTransfer(seq.block_hashes[j], seq.block_ids[j], remote)
                                     for j in range(first, first + external // self.allocator.block_size)]
            if self.connector is not None and self.kv_role != "consumer":
                self._plan_saves(seq, n, out)
            if seq.status is SequenceStatus.SWAPPED:
                host = self.swap_space.held.pop(seq.seq_id)
                out.swap_in.extend(zip(host, seq.block_ids))
                self._swapped_in.extend(host)
                self.blocks_swapped["in"] += len(host)
            seq.status = SequenceStatus.RUNNING
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
        out.copies = self.allocator.take_copies()
        if out.seqs:
            out.swap_out[:0], self._swap_out_later = self._swap_out_later, []
        else:
            self._swap_out_later.extend(out.swap_out)
            out.swap_out = []
        if self.pipeline_depth > 1:
            self.in_flight.update(out.seqs)
        return out

    def _schedulable(self, running: list[Sequence]) -> tuple[list[Sequence], int]:
        """The running sequences the policy may schedule while steps are in flight, and how
        many it does not see: none in flight, and at most a ``pipeline_depth``-th of the
        running ones (rounded up), so the steps in flight share the decodes about evenly."""
        cap = -(-len(running) // self.pipeline_depth)
        free = [s for s in running if s not in self.in_flight][:cap]
        return free, len(running) - len(free)

    def settled(self, scheduled: ScheduledStep) -> None:
        """``scheduled`` is applied or abandoned: its sequences are no longer in flight, and
        those that ended meanwhile give back their blocks now."""
        self.in_flight.difference_update(scheduled.seqs)
        if self._free_later:
            keep = []
            for seq in self._free_later:
                (keep.append if seq in self.in_flight else self.allocator.free)(seq)
            self._free_later = keep

    def _admissible(self, waiting: deque[Sequence]) -> deque[Sequence]:
        """``waiting`` less the sequences whose LoRA adapter would be one more than ``max_loras``
        beside the running and swapped ones' (and those admitted before it): they wait for a slot."""
        if not self.max_loras:
            return waiting
        held = {s.lora_request.lora_int_id for s in (*self.running, *self.swapped) if s.lora_request is not None}
        out: deque[Sequence] = deque()
        for seq in waiting:
            lora = seq.lora_request
            if lora is not None and lora.lora_int_id not in held:
                if len(held) >= self.max_loras:
                    continue
                held.add(lora.lora_int_id)
            out.append(seq)
        return out

    def lora_adapters(self) -> dict[str, list[str]]:
        """The adapters' names of the running (and swapped) and of the waiting sequences, what
        vLLM's ``lora_requests_info`` reports for adapter-affinity routing."""
        def names(seqs: Iterable[Sequence]) -> list[str]:
            return sorted({s.lora_request.lora_name for s in seqs if s.lora_request is not None})
        return {"running": names((*self.running, *self.swapped)), "waiting": names(self.waiting)}

    def _match_prefix(self, seq: Sequence, n: int, available: int) -> tuple[int, int]:
        """Attach ``seq``'s cached prefix, then what the KV connector holds beyond it, and
        return the tokens it computes now (``n`` at most) and those the connector loads.
        The schedule was checked against an empty block table, but cached blocks that were
        free (evictable) leave the free pool too, and the chunk after the prefix may need
        blocks the checked one did not: if that is more than ``available``, the match is
        dropped and the ``n`` tokens are computed from the start, as checked."""
        allocator = self.allocator
        free = allocator.num_free_blocks()
        with calling(allocator, "kv_allocator", "match_prefix()"):
            local = allocator.match_prefix(seq)
        external = self._external_match(seq, local)
        seq.num_computed_tokens = local + external
        m = min(n, seq.num_tokens - seq.num_computed_tokens)
        taken = free - allocator.num_free_blocks()
        if seq.num_computed_tokens and taken + allocator.blocks_needed(seq, seq.num_computed_tokens + m) > available:
            allocator.free(seq)
            seq.num_computed_tokens, m, external = 0, n, 0
        if seq.num_cached_tokens < 0:  # vLLM's RequestOutput.num_cached_tokens: the first admission's hit
            seq.num_cached_tokens = seq.num_computed_tokens
        return m, external  # m is n when nothing matched (n <= the sequence's tokens) or the match was dropped

    def _external_match(self, seq: Sequence, local: int) -> int:
        """Tokens past the ``local`` cached prefix the connector can load: whole blocks, and
        never the last token (its logits are computed). Also notes what the store holds."""
        connector, size = self.connector, self.allocator.block_size
        if connector is None or local % size:
            return 0
        keys = self._prompt_keys(seq)
        usable = min(len(keys), (seq.num_tokens - 1) // size)
        with calling(connector, "kv_connector", "stored_blocks()"):
            remote = remote_kv(seq)
            stored = connector.stored_blocks_from(keys, remote) if remote else connector.stored_blocks(keys)
        if not isinstance(stored, int) or not 0 <= stored <= len(keys):
            raise broke(connector, "kv_connector", "stored_blocks()", f"an int in [0, {len(keys)}]",
                        described(stored))
        seq.kv_stored_blocks = stored
        if self.kv_role == "producer" or seq.kv_load_failed:
            return 0
        return max(0, min(stored, usable) - local // size) * size

    def _plan_saves(self, seq: Sequence, n: int, out: ScheduledStep) -> None:
        """The prompt's full blocks complete once this step ran that the store lacks."""
        done = min(seq.num_prompt_tokens, seq.num_computed_tokens + n) // self.allocator.block_size
        if done > seq.kv_stored_blocks:
            keys = self._prompt_keys(seq)  # only then: a decode step saves nothing, and slices no keys
            out.kv_saves[seq] = [BlockTransfer(keys[j], seq.block_ids[j]) for j in range(seq.kv_stored_blocks, done)]

    def _prompt_keys(self, seq: Sequence) -> list[str]:
        """The content keys of ``seq``'s full prompt blocks: the first of ``seq.block_hashes``,
        made there when missing. NOTE: a prefix-cache allocator extends that list too, maybe
        past the prompt (blocks of output tokens), and finds what was made here."""
        full = seq.num_prompt_tokens // self.allocator.block_size
        return block_keys(seq.token_ids, self.allocator.block_size, full, seq.block_hashes, seq.cache_salt)[:full]

    def drop_failed_loads(self, scheduled: ScheduledStep, seqs: list[Sequence], requeue: bool) -> None:
        """Take sequences whose KV could not be loaded out of the step and free their blocks;
        with ``requeue`` they wait first in line to compute their prompts (no connector)."""
        for seq in seqs:
            i = scheduled.seqs.index(seq)
            del scheduled.seqs[i], scheduled.num_new_tokens[i]
            self.kv_blocks["load_failed"] += len(scheduled.kv_loads.pop(seq))
            scheduled.kv_saves.pop(seq, None)
            self.running.remove(seq)
            self.allocator.free(seq)
            seq.num_computed_tokens = 0
            if requeue:
                seq.kv_load_failed = True
                seq.status = SequenceStatus.WAITING
                self.waiting.appendleft(seq)

    def _allocate(self, seq: Sequence, num_tokens: int) -> None:
        """``allocator.allocate``, checked: it must succeed (the schedule was checked against
        what the allocator reported free) and leave block ids in range."""
        allocator = self.allocator
        try:
            ok = allocator.allocate(seq, num_tokens)
        except Exception as e:
            raise failed(allocator, "kv_allocator", "allocate()", e) from e
        if ok is not True:
            raise broke(allocator, "kv_allocator", "allocate()", f"True (it reported the blocks of sequence "
                        f"{seq.seq_id} free)", described(ok))
        ids = seq.block_ids  # NOTE: min/max run in C: the table's few ids per step cost microseconds
        if ids and (min(ids) < 0 or max(ids) >= allocator.num_blocks):
            raise broke(allocator, "kv_allocator", "allocate()", f"block ids in [0, {allocator.num_blocks})",
                        f"block table {described(ids)}")

    def update(self, scheduled: ScheduledStep, output: ModelOutput) -> list[Sequence]:
        """Apply what an executed step computed: each sequence's progress (a speculating one's
        over its accepted drafts only), the prefix cache, the forks of n > 1 samples, the host
        blocks its swap-ins freed; then its new tokens in order, each checked for a stop (the
        tokens after it are dropped). Returns the sequences that finished, their blocks freed."""
        self._progress(scheduled, output)
        self.settled(scheduled)
        # NOTE: a sequence that ended while its step ran (async scheduling: a stop string found in
        # the step before) keeps what it had: the token sampled for it is dropped.
        finished = [seq for seq, tokens in output.token_ids.items()
                    if not seq.is_finished and self._append(seq, tokens)]
        for seq in finished:
            self.remove(seq)
        return finished

    def _append(self, seq: Sequence, tokens: list[int]) -> bool:
        if seq.params.max_tokens == 0:  # prompt logprobs only: the prefill's sample is dropped
            seq.finish_reason = "length"
        for token in tokens:
            if seq.finish_reason is not None:
                break
            seq.token_ids.append(token)
            seq.finish_reason, seq.stop_reason = self._stop(seq, token)
        return seq.finish_reason is not None

    def _stop(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        """What ``token``, just appended, ends ``seq`` with: (finish reason, stop reason)."""
        params = seq.params
        if seq.grammar is not None and not _accepts(seq.grammar, token):
            # The mask allows only what the grammar accepts, so this is a backend bug.
            logger.error("request %s: the grammar rejected sampled token %d; aborting it", seq.request_id, token)
            return "abort", None
        if token in params.stop_token_ids:
            return "stop", token
        if token in self.eos_token_ids and not params.ignore_eos:
            return "stop", None
        if seq.grammar is not None and seq.grammar.is_terminated():
            return "stop", None  # it accepted an EOS: even with ignore_eos, nothing may follow
        max_tokens = params.max_tokens
        if (max_tokens is not None and seq.num_output_tokens >= max_tokens) or \
                seq.num_tokens >= self.limits.max_model_len:
            return "length", None
        return None, None

    def _progress(self, scheduled: ScheduledStep, output: ModelOutput) -> None:
        drafts = scheduled.draft_tokens
        for seq, n in zip(scheduled.seqs, scheduled.num_new_tokens):
            if seq.is_finished:  # ended while its step ran: its blocks are freed already
                continue
            speculated = seq in drafts
            if speculated:
                # KV stays valid for the last real token and the accepted drafts only.
                n -= len(drafts[seq]) + 1 - len(output.token_ids[seq])
            seq.num_computed_tokens += n
            if speculated:
                self.allocator.trim(seq, seq.num_computed_tokens)  # the rejected slots go back at once
            self.allocator.mark_computed(seq)
            if seq.pending_forks and seq.num_computed_tokens == seq.num_tokens:
                self._fork(seq)
        for seq, saves in scheduled.kv_saves.items():
            seq.kv_stored_blocks += len(saves)
            self.kv_blocks["saved"] += len(saves)
        self.kv_blocks["loaded"] += sum(map(len, scheduled.kv_loads.values()))
        self._give_back_swapped_in()

    def _fork(self, parent: Sequence) -> None:
        """Start the request's other samples (n > 1) on the blocks of its computed prompt."""
        free_slots = self.limits.max_num_seqs - len(self.running)
        for child in parent.pending_forks:
            if free_slots > 0:
                child.num_computed_tokens = parent.num_computed_tokens
                self.allocator.fork(parent, child)
                self.add_running(child)
                free_slots -= 1
            else:
                # No sequence slot left: it waits like a preempted sequence, behind the
                # requests already waiting (its prompt's full blocks are likely cached).
                self.add(child)
        parent.pending_forks = []

    def _give_back_swapped_in(self) -> None:
        if self._swapped_in:
            self.swap_space.give_back(self._swapped_in)
            self._swapped_in = []

    def _preempt(self, seq: Sequence, out: ScheduledStep) -> None:
        self.running.remove(seq)
        seq.num_preemptions += 1
        host = None
        if self.preemption_mode == "swap" and self.swap_space is not None:
            host = self.swap_space.take(seq)
        if host is None:
            # Recompute: drop the KV, keep the tokens; the sequence is prefilled again later.
            self.allocator.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
            self.preemptions["recompute"] += 1
            return
        out.swap_out.extend(zip(seq.block_ids, host))
        self.blocks_swapped["out"] += len(host)
        self.allocator.free(seq)
        seq.status = SequenceStatus.SWAPPED
        self.swapped.append(seq)
        self.preemptions["swap"] += 1

    def _check(self, schedule: Schedule) -> list[int]:
        """Refuse a schedule the queues, budget or blocks do not allow; the blocks each
        scheduled sequence takes, in the schedule's order."""
        def refuse(why: str) -> PluginError:
            return PluginError(f"{who(self.policy, 'scheduler')}: schedule() returned an invalid schedule: {why}")

        running, waiting, swapped = set(self.running), set(self.waiting), set(self.swapped)
        preempt = set(schedule.preempt)
        if self.in_flight and (busy := self.in_flight & (preempt | set(schedule.tokens))):
            raise refuse(f"sequence {next(iter(busy)).seq_id} is in a step still in flight (its next token is "
                         "not known yet)")
        if len(preempt) != len(schedule.preempt) or not preempt <= running:
            raise refuse("it preempts a sequence that is not running (or one twice)")
        total, needs = 0, []
        for seq, n in schedule.tokens.items():
            if seq in preempt or not (seq in running or seq in waiting or seq in swapped):
                raise refuse(f"sequence {seq.seq_id} is not running, waiting or swapped")
            remaining = seq.num_uncomputed
            if not isinstance(n, int) or not 1 <= n <= remaining:
                raise refuse(f"sequence {seq.seq_id} gets {n!r} tokens, it has {remaining} to compute")
            total += n
            needs.append(self.blocks_needed(seq, n))
        if total > self.limits.max_num_batched_tokens:
            raise refuse(f"{total} tokens exceed max_num_batched_tokens={self.limits.max_num_batched_tokens}")
        admitted = sum(1 for s in schedule.tokens if s not in running)
        if len(running) - len(preempt) + admitted > self.limits.max_num_seqs:
            raise refuse(f"more than max_num_seqs={self.limits.max_num_seqs} running sequences")
        freed = sum(self.blocks_freed_by(s) for s in preempt)
        if (blocks := sum(needs)) > self.free_blocks() + freed:
            raise refuse(f"needs {blocks} KV blocks, {self.free_blocks() + freed} are free")
        return needs


def _accepts(matcher: GrammarMatcher, token: int) -> bool:
    with calling(matcher, "grammar_backend", "matcher.accept_token()"):
        return matcher.accept_token(token)


def remote_kv(seq: Sequence) -> dict | None:
    """Where a decode request says its prompt's KV is: its ``kv_transfer_params`` (vLLM's, in
    ``extra_args``) when they ask for a remote prefill; None: the connector's configured store."""
    remote = (seq.params.extra_args or {}).get("kv_transfer_params")
    return remote if isinstance(remote, dict) and remote.get("do_remote_prefill") else None
