from modserve.api import hookimpl


@hookimpl
def register_schedulers(register) -> None:
    register(
        "fcfs",
        "modserve.plugins.schedulers.fcfs:FCFSScheduler",
        options="modserve.plugins.schedulers.fcfs:FCFSOptions",
        description="continuous batching, first come first served, chunked prefill, preempt newest",
    )
    register(
        "static",
        "modserve.plugins.schedulers.static:StaticScheduler",
        description="baseline: a batch runs until its longest member finishes; new requests wait",
    )
    register(
        "priority",
        "modserve.plugins.schedulers.priority:PriorityScheduler",
        options="modserve.plugins.schedulers.priority:PriorityOptions",
        description="lower priority value first, preempts lower-priority work, ages waiting requests",
    )
    register(
        "lpm",
        "modserve.plugins.schedulers.lpm:LPMScheduler",
        description="longest cached prefix first (SGLang's lpm): waiting prompts the prefix cache holds most of go first",
    )
