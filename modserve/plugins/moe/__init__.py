"""Built-in mixture-of-experts backends, registered like any plugin's (imports nothing heavy)."""

from modserve.api import hookimpl


@hookimpl
def register_moe_backends(register) -> None:
    register("reference", "modserve.plugins.moe.reference:ReferenceMoE",
             description="A loop over experts, each on the tokens routed to it; slow, for testing")
    register("fused", "modserve.plugins.moe.fused:FusedMoE", options="modserve.plugins.moe.fused:FusedMoEOptions",
             description="Tokens sorted by expert once, one GEMM per expert on a contiguous slice (a grouped GEMM "
             "over stacked weights on GPUs), one scatter back (default)")
    register("triton", "modserve.plugins.moe.triton_moe:TritonMoE",
             options="modserve.plugins.moe.triton_moe:TritonMoEOptions",
             description="A fused-MoE grouped GEMM in Triton for float experts (GPUs; CPU only under "
             "TRITON_INTERPRET=1); quantized experts through fused's per-expert calls")
