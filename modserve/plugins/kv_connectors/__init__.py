from modserve.api import hookimpl


@hookimpl
def register_kv_connectors(register) -> None:
    register(
        "shared_storage",
        "modserve.plugins.kv_connectors.shared_storage:SharedStorageConnector",
        options="modserve.plugins.kv_connectors.shared_storage:SharedStorageOptions",
        description="each prompt block's KV in a file under a directory, named by its hash chain (vLLM's "
                    "SharedStorageConnector); engines sharing the directory share prefills",
    )
    register(
        "shm",
        "modserve.plugins.kv_connectors.shm:SharedMemoryConnector",
        options="modserve.plugins.kv_connectors.shm:SharedMemoryOptions",
        description="each prompt block's KV in a POSIX shared-memory segment: engines on one machine, no disk",
    )
    register(
        "host",
        "modserve.plugins.kv_connectors.host:HostMemoryConnector",
        options="modserve.plugins.kv_connectors.host:HostMemoryOptions",
        description="a host-memory tier under the device's prefix cache: prompt blocks kept in an LRU pool "
                    "of host memory and loaded back instead of recomputed",
    )
    register(
        "mooncake",
        "modserve.plugins.kv_connectors.mooncake:MooncakeConnector",
        options="modserve.plugins.kv_connectors.mooncake:MooncakeOptions",
        description="prompt blocks pulled from a producer over the network by Mooncake's transfer engine "
                    "(TCP, P2P handshake; vLLM's MooncakeConnector); held blocks freed once read or timed out",
    )
