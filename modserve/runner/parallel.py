"""Tensor parallelism: which rank this process is, how layers split, the collectives.

One :class:`TensorParallel` per process. At size 1 (the default) every method is the
identity and no process group exists, so a single-device engine runs exactly as before.
The group comes from ``torch.distributed`` (gloo on CPU, NCCL on CUDA: the platform's
``distributed_backend``); nothing here sends bytes itself.
"""

from __future__ import annotations

import datetime
import pickle
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

# A worker waits for the driver's next step on its metadata group for as long as the server
# idles; a dead peer closes its sockets and fails the wait at once, not after this. The
# model's collectives (inside a step) time out after the step deadline instead:
# collective_timeout(), so a hung peer is an error rather than a wait of a year.
IDLE_TIMEOUT = datetime.timedelta(days=365)
JOIN_TIMEOUT = datetime.timedelta(minutes=10)  # workers import torch and the plugins before they join


class RanksOutOfStep(RuntimeError):
    """Rank 0 failed inside a call the other ranks were making too: they may be waiting in a
    collective it will never join, so the engine cannot run another step."""


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # the model's collectives (torch.distributed ProcessGroup); None at size 1
    cpu_group: Any = None  # gloo, every rank's: each step's metadata from rank 0
    global_rank: int = -1  # in the world of every stage's ranks (-1: the same as rank)

    @property
    def driver(self) -> bool:
        """Global rank 0: the engine's process, which sends each step to the others."""
        return (self.rank if self.global_rank < 0 else self.global_rank) == 0

    def part(self, total: int, replicas: int = 1) -> tuple[int, int]:
        """(start, size) of this rank's share of ``total`` rows that ``replicas`` ranks each
        hold whole (KV heads when the ranks outnumber them): ``size * replicas / ranks``."""
        if (total * replicas) % self.size:
            raise ValueError(f"{total} rows do not split over {self.size} tensor-parallel ranks")
        size = total * replicas // self.size
        return (self.rank // replicas) * size, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # the sum over the ranks, in place
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # [..., n] -> [..., n * size], by rank
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)  # NOTE: gloo has the list form only
        return torch.cat(parts, dim=-1)

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled: one message of its bytes' length, then the bytes)."""
        data = pickle.dumps(obj) if self.driver else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, 0, group=self.cpu_group)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.driver else \
            torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.cpu_group)
        return obj if self.driver else pickle.loads(buf.numpy().tobytes())

    def broadcast_async(self, obj: Any) -> list[tuple[Any, torch.Tensor]]:
        """Rank 0: :meth:`broadcast` without waiting for the others to take it (gloo's root
        waits for every receiver otherwise, and a later pipeline stage is busy with an earlier
        step): the works and the buffers, which must live until each ``wait()`` returns."""
        data = pickle.dumps(obj)
        size = torch.tensor([len(data)], dtype=torch.int64)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return [(dist.broadcast(t, 0, group=self.cpu_group, async_op=True), t) for t in (size, buf)]

    def all_ranks(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (as many on each), by global rank, on the gloo group of
        every rank; without one (a single rank), this rank's alone."""
        if self.cpu_group is None:
            return [values]
        mine = torch.tensor(values, dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.cpu_group))]
        dist.all_gather(parts, mine, group=self.cpu_group)
        return [p.tolist() for p in parts]


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """This rank's pipeline stage: a contiguous range of the decoder layers. The stage's
    ranks (one per tensor-parallel rank) receive the hidden states ``[T, hidden]`` from the
    same tensor-parallel rank of the stage before and send theirs to the next; the last
    stage's tensor-parallel rank 0 sends the logits to rank 0, which samples."""

    index: int = 0
    size: int = 1
    rank: int = 0  # global: index * tp_size + tensor-parallel rank
    tp_size: int = 1

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    def layers(self, num_layers: int, partition: list[int] | None = None) -> range:
        """Layers ``start:end`` of this stage: ``partition`` (layers per stage), or as even as
        can be, the first stages taking one more when they do not divide."""
        if partition is None:
            base, extra = divmod(num_layers, self.size)
            partition = [base + (i < extra) for i in range(self.size)]
        if len(partition) != self.size or sum(partition) != num_layers or min(partition) < 1:
            raise ValueError(f"pp_layer_partition {partition} must give each of {self.size} stages at least one "
                             f"layer, {num_layers} in all")
        start = sum(partition[: self.index])
        return range(start, start + partition[self.index])

    def send_next(self, x: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """Send to the next stage without waiting: (the work, whose ``wait()`` does; the tensor
        sent, which must live until then)."""
        x = x.contiguous()
        return dist.isend(x, self.rank + self.tp_size), x

    def recv_prev(self, like: torch.Tensor) -> torch.Tensor:
        """The previous stage's tensor, shaped and typed as ``like``."""
        x = torch.empty_like(like)
        dist.recv(x, self.rank - self.tp_size)
        return x

    def logits_to_rank0(self, logits: list[torch.Tensor | None]) -> list[tuple[Any, torch.Tensor]]:
        """Send without waiting (rank 0 takes them once it has sent its next steps): the
        works and tensors, as :meth:`send_next`."""
        return [(dist.isend(t, 0), t) for t in (t.contiguous() for t in logits if t is not None) if self.rank != 0]

    def logits_from_last(self, shapes: list[tuple[int, int] | None], dtype: torch.dtype,
                         device: torch.device) -> list[torch.Tensor | None]:
        out = []
        for shape in shapes:
            t = None if shape is None else torch.empty(shape, dtype=dtype, device=device)
            if t is not None:
                dist.recv(t, (self.size - 1) * self.tp_size)
            out.append(t)
        return out


def collective_timeout(step_timeout: float) -> datetime.timedelta:
    """How long one collective of the model may wait for its peers: no longer than a whole step
    may run (``step_timeout``, the engine's deadline)."""
    return datetime.timedelta(seconds=step_timeout)


def init_parallel(backend: str, init_method: str, rank: int, tp_size: int, pp_size: int = 1,
                  failed: Callable[[], str | None] = lambda: None,
                  timeout: datetime.timedelta = IDLE_TIMEOUT) -> tuple[TensorParallel, PipelineStage]:
    """Join the ``tp_size x pp_size`` ranks (rank = stage x tp_size + tensor-parallel rank);
    this rank's tensor-parallel group (its stage's ranks) and its stage. The model's
    collectives and the stages' sends time out after ``timeout``; the step metadata's never."""
    world = init_tensor_parallel(backend, init_method, rank, tp_size * pp_size, failed, timeout)
    if pp_size == 1:
        return world, PipelineStage()
    groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)), timeout=timeout)
              for s in range(pp_size)]  # all ranks, in order
    stage = rank // tp_size
    tp = TensorParallel(rank % tp_size, tp_size, groups[stage], world.cpu_group, world.rank)
    return tp, PipelineStage(stage, pp_size, rank, tp_size)


def init_tensor_parallel(backend: str, init_method: str, rank: int, size: int,
                         failed: Callable[[], str | None] = lambda: None,
                         timeout: datetime.timedelta = IDLE_TIMEOUT) -> TensorParallel:
    """Join the group of ``size`` ranks whose rank 0 listens at ``init_method``
    (``tcp://host:port``). Rank 0 waits for the others, asking ``failed()`` (the executor's)
    every second, so a worker that dies before it joins fails the start instead of hanging it."""
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    store = dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=JOIN_TIMEOUT,
                          wait_for_workers=False)
    if rank:
        store.set(f"joined/{rank}", "1")
    else:
        deadline = time.monotonic() + JOIN_TIMEOUT.total_seconds()
        for other in range(1, size):
            while not store.check([f"joined/{other}"]):
                if why := failed():
                    raise RuntimeError(f"tensor parallel: a worker failed before joining: {why}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tensor parallel: rank {other} did not join within {JOIN_TIMEOUT}")
                time.sleep(0.05)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    group = dist.group.WORLD
    # NOTE: a gloo group of its own even when the world is gloo: the next step's metadata may
    # be waited for as long as the server idles, the model's collectives for ``timeout`` only.
    cpu_group = group if timeout == IDLE_TIMEOUT and backend == "gloo" else \
        dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TensorParallel(rank, size, group, cpu_group)
