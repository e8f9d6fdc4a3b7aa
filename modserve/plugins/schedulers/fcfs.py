"""First-come-first-served continuous batching with chunked prefill."""

from __future__ import annotations

from modserve.core.interfaces import Schedule, Scheduler, SchedulerView


class FCFSScheduler(Scheduler):
    """Each step: advance every running sequence (decodes and unfinished prefill
    chunks) in admission order, then resume swapped sequences, then admit waiting
    ones in arrival order, while tokens, sequence slots and blocks last. A prompt
    longer than the step's token budget is prefilled in chunks.

    When blocks run out the newest running sequence is preempted; nothing new is
    admitted in a step that preempted, so the evicted ones return first.
    """

    def schedule(self, view: SchedulerView) -> Schedule:
        out = Schedule()
        budget = self.limits.max_num_batched_tokens
        free = view.free_blocks()
        running = list(view.running)
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = view.blocks_needed(seq, n)
            while need > free and running[-1] is not seq:
                victim = running.pop()
                out.preempt.append(victim)
                free += view.blocks_freed_by(victim)
            if need > free:  # alone and still short: it waits for the others to finish
                running.pop()
                out.preempt.append(seq)
                break
            out.tokens[seq] = n
            budget -= n
            free -= need
            i += 1
        if out.preempt:
            return out
        num_running = len(running)
        for queue in (view.swapped, view.waiting):
            for seq in queue:
                if budget <= 0 or num_running >= self.limits.max_num_seqs:
                    return out
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                need = view.blocks_needed(seq, n)
                if need > free:
                    return out
                out.tokens[seq] = n
                budget -= n
                free -= need
                num_running += 1
        return out
