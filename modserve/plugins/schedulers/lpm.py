"""Longest-prefix-match scheduling (SGLang's ``lpm``): admit the prompts the prefix cache holds most of first."""

from __future__ import annotations

from modserve.api import Schedule, Scheduler, SchedulerView, admit, advance_running, start_budget


class LPMScheduler(Scheduler):
    """Running sequences advance in admission order, as in fcfs; swapped ones resume first;
    then waiting sequences are admitted longest cached prefix first (ties: queue order).

    NOTE: admitting the requests that share what the cache holds, back to back, keeps those
    blocks hot before eviction takes them; the price is that a request without a hit waits
    behind any stream of requests that hit (SGLang's policy has the same trade-off).
    """

    def schedule(self, view: SchedulerView) -> Schedule:
        out = Schedule()
        budget = start_budget(view)
        advance_running(view, list(view.running), out, budget)
        if not out.preempt:  # nothing preempted for lack of blocks
            waiting = sorted(view.waiting, key=view.cached_tokens, reverse=True)  # stable: queue order on ties
            admit(view, [*view.swapped, *waiting], out, budget)
        return out
