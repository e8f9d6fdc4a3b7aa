from modserve.api import hookimpl


@hookimpl
def register_kv_allocators(register) -> None:
    register(
        "paged",
        "modserve.plugins.kv_allocators.paged:PagedAllocator",
        options="modserve.plugins.kv_allocators.paged:PagedOptions",
        description="blocks on demand from O(1) free lists; automatic prefix caching, copy-on-write",
    )
    register(
        "contiguous",
        "modserve.plugins.kv_allocators.contiguous:ContiguousAllocator",
        description="baseline: each sequence reserves max_model_len tokens when admitted",
    )
    register(
        "radix",
        "modserve.plugins.kv_allocators.radix:RadixAllocator",
        options="modserve.plugins.kv_allocators.radix:RadixOptions",
        description="paged blocks with a radix-tree prefix cache (SGLang's RadixCache); LRU leaf eviction",
    )
