"""Built-in executors: how tensor-parallel ranks beyond the engine's own get processes."""

from __future__ import annotations

from modserve.api import hookimpl


@hookimpl
def register_executors(register) -> None:
    register("uni", "modserve.plugins.executors.uni:UniExecutor",
             description="One rank, in the engine's process (tensor_parallel_size 1)")
    register("mp", "modserve.plugins.executors.mp:MultiprocessExecutor",
             options="modserve.plugins.executors.mp:MultiprocessOptions",
             description="A process per rank on this machine (multiprocessing spawn), torch.distributed groups")
    register("ray", "modserve.plugins.executors.ray:RayExecutor",
             options="modserve.plugins.executors.ray:RayOptions",
             description="A Ray actor per rank, placed by a placement group (PACK); several machines "
             "(pip install modserve[ray])")
