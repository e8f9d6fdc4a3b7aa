from modserve.core.hookspecs import hookimpl


@hookimpl
def register_kv_allocators(register) -> None:
    register(
        "paged",
        "modserve.plugins.kv_allocators.paged:PagedAllocator",
        description="fixed-size blocks on demand from an O(1) free list, ref-counted",
    )
