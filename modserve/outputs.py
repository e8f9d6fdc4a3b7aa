"""What ``LLM.generate`` returns, where vLLM users import it from (``vllm.outputs``)."""

from modserve.core.outputs import CompletionOutput, RequestMetrics, RequestOutput

__all__ = ["CompletionOutput", "RequestMetrics", "RequestOutput"]
