"""The messages rank 0 sends the other ranks (modserve/runner/messages.py): each one a rank
can be asked has its handler, anything else is refused before it is sent, rank 0 sends one
message per call, and each arrives whole on another rank."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
import types
import typing
from typing import Any

import pytest
import torch

from modserve.core.contracts.kv_connector import BlockTransfer
from modserve.runner.batch import build_batch
from modserve.runner.main import on_device
from modserve.runner.messages import AllocateKVCache, LoadKV, RankMessage, RunModel, Stop
from modserve.runner.model_runner import ModelRunner
from modserve.runner.parallel import PipelineStage, RanksOutOfStep


class RecordingRank0:
    """Rank 0 of two tensor-parallel ranks, recording what it broadcasts."""

    size, rank, driver = 2, 0, True

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def broadcast(self, obj: Any = None) -> Any:
        self.sent.append(obj)
        return obj


def bare_runner() -> ModelRunner:
    """A runner without a model: only its dispatch of messages is under test."""
    runner = object.__new__(ModelRunner)
    runner.tp, runner.pp = RecordingRank0(), PipelineStage()
    runner.connector = types.SimpleNamespace(load=lambda transfers: 1 / 0)  # fails on rank 0
    return runner


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name))
                                           for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def test_every_message_but_stop_has_a_handler_that_takes_it():
    assert set(ModelRunner.HANDLERS) == set(typing.get_args(RankMessage)) - {Stop}
    for message, handler in ModelRunner.HANDLERS.items():
        taken = list(inspect.signature(handler).parameters.values())[1].annotation
        assert taken == message.__name__, f"{handler.__name__} takes {taken}, not {message.__name__}"


def test_a_rank_refuses_what_it_cannot_be_asked_and_rank_0_sends_none_of_it():
    runner = bare_runner()
    for unknown in (("run_model", ()), Stop()):  # the old (method, args) form; the loop's own message
        with pytest.raises(TypeError, match="a rank cannot be asked to"):
            runner.handle(unknown)
        with pytest.raises(TypeError, match="a rank cannot be asked to"):
            runner.on_every_rank(unknown)
    assert runner.tp.sent == []


def test_rank_0_sends_one_message_and_failing_after_it_puts_the_ranks_out_of_step():
    runner = bare_runner()
    transfers = [BlockTransfer("key", 3)]
    with pytest.raises(RanksOutOfStep, match="rank 0 failed in load_kv while the other ranks ran it"):
        runner.load_kv(transfers)
    assert runner.tp.sent == [LoadKV(transfers)]


def test_each_message_arrives_whole_on_another_rank():
    input_ids, meta = build_batch([[5, 6, 7], [8]], [0, 4], [[0], [1, 2]], 4, torch.device("cpu"))
    step = RunModel(input_ids, meta, [torch.tensor([2, 3]), torch.tensor([], dtype=torch.int64)],
                    copies=[(1, 2)], swap_out=[(3, 0)], kv_saves=[BlockTransfer("key", 1)])
    for message in (step, AllocateKVCache(8, 2), LoadKV([BlockTransfer("key", 1)]), Stop()):
        arrived = on_device(pickle.loads(pickle.dumps(message)), torch.device("cpu"))
        assert same(arrived, message), type(message).__name__
