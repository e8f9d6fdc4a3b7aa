"""``use_beam_search`` on /v1/completions and /v1/chat/completions, as vLLM's server: ``n`` is
the beam width, each step's beams go to the engine as one-token requests through the
EngineClient (modserve/beam_search.py holds the search), the best ``n`` come back as the choices."""

from __future__ import annotations

from fastapi import Request

from modserve.beam_search import BeamSearch, BeamSearchParams, check_beam_search, step_entry
from modserve.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from modserve.core.sampling_params import SamplingParams
from modserve.server.errors import APIError, invalid
from modserve.server.protocol import SamplingRequest
from modserve.server.serving import ServerState, final_outputs


def beam_params(body: SamplingRequest, params: SamplingParams, prompt_lens: list[int],
                state: ServerState) -> BeamSearchParams:
    """The request's search (vLLM's ``to_beam_search_params``: the width is ``n``; max_tokens
    unset: what the context leaves), checked against the bounds: a 400 naming the field."""
    max_tokens = params.max_tokens or state.max_model_len - max(prompt_lens)
    try:
        search = BeamSearchParams(beam_width=body.n, max_tokens=max_tokens, ignore_eos=body.ignore_eos,
                                  temperature=params.temperature, length_penalty=body.length_penalty,
                                  include_stop_str_in_output=body.include_stop_str_in_output)
        for prompt_len in prompt_lens:
            check_beam_search(search, prompt_len, state.max_model_len, state.engine.limits.max_logprobs)
    except ValueError as e:  # the messages start with the field's name
        field, _, why = str(e).partition(" ")
        raise invalid("n" if field == "beam_width" else field, why) from None
    return search


async def beam_search(state: ServerState, prompts: list[list[int]], search: BeamSearchParams, arrival: float,
                      priority: int, request: Request) -> list[RequestOutput]:
    """Run one search per prompt to the end, all prompts' beams in each step's one submit; the
    outputs in the prompts' order, each with the best ``beam_width`` sequences as its choices."""
    searches = [BeamSearch(p, search, state.tokenizer.hf.eos_token_id) for p in prompts]
    step = search.step_params()
    while live := [s for s in searches if not s.done]:
        stream = state.submit([p for s in live for p in s.live_prompts()], step, arrival, priority)
        outputs = await final_outputs(stream, request)
        if len(outputs) < len(stream.request_ids):  # the client hung up: final_outputs aborted the rest
            return []
        found = iter(outputs)
        try:
            for s in live:  # each search's beams, in the order they went out
                s.advance([step_entry(next(found)) for _ in s.beams])
        except RuntimeError:  # the engine failed a step's request (it logged why)
            raise APIError(500, "The engine failed while running this request; the server logged why. The other "
                           "requests were not affected.", type="server_error", code="engine_error") from None
    results = []
    for i, s in enumerate(searches):
        choices = []
        for index, beam in enumerate(s.best()):
            tokens = s.output_tokens(beam)
            end = -1 if beam.finish_reason == "stop" else None
            text = await state.decode(beam.tokens[s.prompt_len:end])  # never EOS's text, as vLLM's
            choices.append(CompletionOutput(index=index, text=text, token_ids=tokens,
                                            finish_reason=beam.finish_reason, stop_reason=beam.stop_reason))
        results.append(RequestOutput(f"beam-{i}", None, prompts[i], choices, True, RequestMetrics(arrival)))
    return results
