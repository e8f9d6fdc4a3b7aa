"""Built-in platforms, registered like any plugin's: one per device type."""

from modserve.api import hookimpl


@hookimpl
def register_platforms(register) -> None:
    register("cpu", "modserve.plugins.platforms.cpu.platform:CpuPlatform",
             options="modserve.plugins.platforms.cpu.platform:CpuOptions",
             description="CPUs: float32 compute, glibc heap tuning, 16-bit decode weights, packed GEMMs and a "
                         "native decode step (C++)")
    register("cuda", "modserve.plugins.platforms.cuda.platform:CudaPlatform",
             description="NVIDIA GPUs: the checkpoint's dtype, free device memory, plain GEMMs")
