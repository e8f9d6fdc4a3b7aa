"""A thread that hands the model's work to another gives up its OpenMP team."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from modserve.engine.intra_op_threads import loaded_openmp_runtimes, release_intra_op_threads


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def test_release_ends_the_calling_threads_openmp_team():
    if not loaded_openmp_runtimes():
        pytest.skip("no OpenMP runtime loaded here (torch without OpenMP, or no /proc)")
    seen: dict[str, set[str]] = {}

    def body() -> None:  # a thread of its own: its team is its own, and ends with the test
        previous = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            alone = _threads()
            x = torch.ones(1 << 20)  # a parallel kernel: this thread's team starts its second thread
            seen["team"] = _threads() - alone
            release_intra_op_threads()
            deadline = time.monotonic() + 5
            while seen["team"] & _threads() and time.monotonic() < deadline:
                time.sleep(0.01)
            seen["left"] = seen["team"] & _threads()
            x.add_(1)  # the thread can still compute: a new team
            release_intra_op_threads()
        finally:
            torch.set_num_threads(previous)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert len(seen["team"]) == 1, seen  # the team's second thread
    assert not seen["left"], seen  # gone once released
