"""Built-in model architectures, registered like any plugin's."""

from modserve.api import hookimpl

_LLAMA = "modserve.plugins.models.llama:LlamaForCausalLM"


@hookimpl
def register_model_architectures(register) -> None:
    # Mistral and Qwen2 are the Llama block with small config differences
    # (sliding window, q/k/v bias, tied embeddings) that the one class reads from the config.
    register("LlamaForCausalLM", _LLAMA, description="Llama 1/2/3 (GQA, RoPE incl. llama3 scaling)")
    register("MistralForCausalLM", _LLAMA, description="Mistral (Llama block)")
    register("Qwen2ForCausalLM", _LLAMA, description="Qwen2 (q/k/v bias, tied embeddings)")
