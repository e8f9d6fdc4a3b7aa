"""Built-in LoRA resolvers, registered like any plugin's (imports nothing heavy)."""

from modserve.api import hookimpl


@hookimpl
def register_lora_resolvers(register) -> None:
    register("filesystem", "modserve.plugins.lora_resolvers.filesystem:FilesystemResolver",
             options="modserve.plugins.lora_resolvers.filesystem:FilesystemOptions",
             description="a directory of PEFT adapter directories, each named as requests name it (vLLM's "
             "lora_filesystem_resolver; cache_dir, else VLLM_LORA_RESOLVER_CACHE_DIR)")
