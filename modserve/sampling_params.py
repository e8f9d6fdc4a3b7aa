"""``SamplingParams`` (and the structured-output constraint) where vLLM users import them
from (``vllm.sampling_params``)."""

from modserve.beam_search import BeamSearchParams
from modserve.core.sampling_params import SamplingParams
from modserve.core.structured_outputs import StructuredOutputs

StructuredOutputsParams = StructuredOutputs  # vLLM's name for it

__all__ = ["BeamSearchParams", "SamplingParams", "StructuredOutputs", "StructuredOutputsParams"]

