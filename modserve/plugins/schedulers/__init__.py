from modserve.core.hookspecs import hookimpl


@hookimpl
def register_schedulers(register) -> None:
    register(
        "fcfs",
        "modserve.plugins.schedulers.fcfs:FCFSScheduler",
        description="continuous batching, first come first served, chunked prefill, preempt newest",
    )
