"""``SamplingParams`` (and the structured-output constraint) where vLLM users import them
from (``vllm.sampling_params``)."""

from dataclasses import dataclass

from modserve.core.sampling_params import SamplingParams
from modserve.core.structured_outputs import StructuredOutputs

StructuredOutputsParams = StructuredOutputs  # vLLM's name for it

__all__ = ["BeamSearchParams", "SamplingParams", "StructuredOutputs", "StructuredOutputsParams"]


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``, so that a script importing it loads; ``LLM.beam_search``
    refuses it (modserve has no beam search)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
