"""Built-in model architectures, registered like any plugin's."""

from modserve.api import hookimpl

_LLAMA = "modserve.plugins.models.llama:LlamaForCausalLM"
_QWEN_MOE = "modserve.plugins.models.qwen_moe"


@hookimpl
def register_model_architectures(register) -> None:
    # Mistral and Qwen2 are the Llama block with small config differences
    # (sliding window, q/k/v bias, tied embeddings) that the one class reads from the config.
    register("LlamaForCausalLM", _LLAMA, description="Llama 1/2/3 (GQA, RoPE incl. llama3 scaling)")
    register("MistralForCausalLM", _LLAMA, description="Mistral (Llama block)")
    register("Qwen2ForCausalLM", _LLAMA, description="Qwen2 (q/k/v bias, tied embeddings)")
    register("Qwen3ForCausalLM", "modserve.plugins.models.qwen3:Qwen3ForCausalLM",
             description="Qwen3 (Llama block, RMSNorm over each q/k head)")
    # Mixture of experts: the experts run through the engine's moe_backend.
    register("MixtralForCausalLM", "modserve.plugins.models.mixtral:MixtralForCausalLM",
             description="Mixtral (Mistral block, top-k of the experts, renormalized)")
    register("Qwen2MoeForCausalLM", f"{_QWEN_MOE}:Qwen2MoeForCausalLM",
             description="Qwen2-MoE (Qwen2 attention, routed experts plus a gated shared expert)")
    register("Qwen3MoeForCausalLM", f"{_QWEN_MOE}:Qwen3MoeForCausalLM",
             description="Qwen3-MoE (Qwen3 attention, routed experts)")
