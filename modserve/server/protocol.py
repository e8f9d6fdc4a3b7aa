"""Request and response bodies in OpenAI's shapes, plus vLLM's sampling extras.

Requests reject unknown fields (as OpenAI does) so a misspelled or unsupported
option is a 400 naming it, never silently ignored. Their types are strict, as OpenAI's
are: ``"3"`` is no number, ``1`` no bool, ``3.0`` no integer (a float field still takes
an integer). ``None`` means "the default" everywhere, because clients send explicit nulls.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, ClassVar, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from modserve.beam_search import MAX_LENGTH_PENALTY
from modserve.core.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from modserve.server.errors import invalid
from modserve.server.kv_transfer import KVTransferParams
from modserve.server.structured_outputs import ConstraintFields

_omit_none = dict(exclude_if=lambda v: v is None)
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
# How many logprobs per token: bounded by the server's max_logprobs (request_limits.py).
NumLogprobs = Annotated[int, Field(ge=0)]
# A value of vllm_xargs (vLLM's types, and a bool).
XArg = str | bool | int | float


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


def lone_surrogate(value: Any, path: str = "") -> tuple[str, int] | None:
    """(field path, character index) of the first string in ``value`` holding a lone UTF-16
    surrogate (JSON lets ``"\\ud800"`` through; no tokenizer can encode it), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return path, e.start
        return None
    if isinstance(value, dict):
        items = [(k, v) for k, v in value.items()]
        for key, item in items:
            where = f"{path}.{key}" if path else str(key)
            found = lone_surrogate(key, where) if isinstance(key, str) else None
            found = found or lone_surrogate(item, where)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = lone_surrogate(item, f"{path}.{i}" if path else str(i))
            if found:
                return found
    return None


class TextChecked(BaseModel):
    """A request body whose every string (keys too) must be valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        found = lone_surrogate(data)
        if found:
            # An APIError passes through pydantic untouched and becomes the 400 itself.
            raise invalid(found[0] or None, f"holds a lone UTF-16 surrogate at character {found[1]}; "
                          "text must be valid Unicode")
        return data


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk, with include_usage
    include_obfuscation: bool | None = None  # OpenAI's padding against side channels; nothing to pad here


class SamplingRequest(TextChecked, ConstraintFields):
    """The fields completions and chat share (the output-constraint ones come from ConstraintFields)."""

    model: str | None = None  # optional, as in vLLM: there is one served model
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None  # an empty string is refused by SamplingParams, as in vLLM
    seed: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (a string, as OpenAI's) -> bias in [-100, 100]
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int64 = 0  # lower runs first under the priority scheduler; others ignore it
    prompt_logprobs: NumLogprobs | None = None  # each prompt token's logprob and the top N there
    allowed_token_ids: list[TokenId] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # at most max_bad_words (request_limits.py)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)  # keep the last k; -1: max_model_len
    use_beam_search: bool = False  # vLLM's: n is the beam width (server/beam_search.py)
    # beam search's: a beam ranks by cum_logprob / length ** length_penalty (bounded: the power stays finite)
    length_penalty: float = Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)
    # vLLM's: the request's arguments for the server's logits processors (its SamplingParams.extra_args);
    # JSON scalars and lists of them, at most max_vllm_xargs_bytes (request_limits.py)
    vllm_xargs: dict[str, XArg | list[XArg]] | None = None
    logits_processors: Any = None  # vLLM v0's per-request processors: refused in check(), as vLLM v1 does
    kv_transfer_params: KVTransferParams | None = None  # vLLM's disaggregation (server/kv_transfer.py)

    def check(self) -> None:
        """Checks across fields; each names the field at fault."""
        if self.logits_processors is not None:
            raise invalid("logits_processors", "per-request logits processors are not supported (vLLM v1 refuses "
                          "them too): start the server with --logits-processors and send a request's "
                          "arguments in vllm_xargs")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options", "only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise invalid("prompt_logprobs", "not available when stream is true (as in vLLM)")
        self.check_constraint()
        if self.min_tokens and self.constraint_param is not None:
            # A constraint ends the output where its grammar does, which may come before min_tokens.
            raise invalid("min_tokens", f"cannot be combined with {self.constraint_param}: the constraint "
                          "decides where the output ends")
        if self.use_beam_search:
            self._check_beam_search()

    # What beam search does not apply (vLLM ignores them): a 400 rather than a silent difference.
    BEAM_SEARCH_UNUSED: ClassVar[tuple[str, ...]] = (
        "stream", "stop", "stop_token_ids", "min_tokens", "logit_bias", "bad_words", "allowed_token_ids",
        "prompt_logprobs", "logprobs", "top_logprobs", "echo")

    def _check_beam_search(self) -> None:
        for name in self.BEAM_SEARCH_UNUSED:
            if name in type(self).model_fields and getattr(self, name) != type(self).model_fields[name].default:
                why = "the beams are ranked when the search ends" if name == "stream" else "it does not apply"
                raise invalid(name, f"cannot be combined with use_beam_search ({why})")
        if self.constraint_param is not None:
            raise invalid(self.constraint_param, "cannot be combined with use_beam_search")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """As vLLM: usage in every chunk only with include_usage too."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                        defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """``defaults``: the model's values (SamplingParams' names) for the fields this request
        leaves unset; without one, vLLM's neutral value."""
        defaults = defaults or {}

        def pick(name: str, neutral: Any) -> Any:
            value = getattr(self, name)
            return defaults.get(name, neutral) if value is None else value

        try:
            return SamplingParams(
                n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
                temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
                top_k=pick("top_k", -1), min_p=pick("min_p", 0.0),
                repetition_penalty=pick("repetition_penalty", 1.0),
                presence_penalty=pick("presence_penalty", 0.0),
                frequency_penalty=pick("frequency_penalty", 0.0),
                seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                structured_outputs=self.constraint,
                logit_bias=self.token_logit_bias(), allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words, truncate_prompt_tokens=self.truncate_prompt_tokens,
                extra_args=self.vllm_xargs,
            )
        except ValueError as e:  # SamplingParams' messages start with the field's name
            raise invalid(str(e).split(" ", 1)[0], str(e).split(" ", 1)[-1]) from None

    def token_logit_bias(self) -> dict[int, float] | None:
        """``logit_bias`` keyed by token id: OpenAI's API sends the ids as strings."""
        if self.logit_bias is None:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise invalid("logit_bias", "keys must be token ids (integers, sent as strings)") from None


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingRequest):
    prompt: Any
    max_tokens: int | None = Field(16, ge=0, le=INT64_MAX)  # 0: with echo, only the prompt is scored
    echo: bool = False
    logprobs: NumLogprobs | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Prompt:
        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and bool(x) and all(type(t) is int for t in x)

        if isinstance(value, str) or is_ids(value):
            return value
        if isinstance(value, list) and value and (
                all(isinstance(p, str) for p in value) or all(is_ids(p) for p in value)):
            return value
        raise ValueError("must be a string, a list of strings, a non-empty list of token ids, "
                         "or a list of token-id lists")

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise invalid("suffix", "not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise invalid("best_of", "not supported: it may only equal n (vLLM removed best_of; ask n samples "
                          "with logprobs and rank them, or use_beam_search with n beams)")
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise invalid("max_tokens", "must be at least 1 (0 only with echo or prompt_logprobs)")

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """What the engine computes: echo with logprobs needs the prompt's (its top N too),
        and so does echo with max_tokens 0 (the engine prefills, then stops)."""
        wanted = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None]
        if self.echo and self.max_tokens == 0:
            wanted.append(0)
        return max(wanted) if wanted else None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(Strict):
    type: Literal["text"]
    text: str


# Content parts of other modalities: refused by name (a text-only model), never as a shape error.
OTHER_PARTS = ("image_url", "input_audio", "audio_url", "video_url", "file", "input_image", "image", "audio")


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant turn of tool calls only
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # an assistant turn's, as returned with a reasoning parser

    def text(self) -> str | None:
        return self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)

    def as_template_input(self) -> dict[str, Any]:
        # "developer" is OpenAI's newer name for the system role.
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        for key in ("tool_call_id", "reasoning_content"):  # Qwen3's template reads reasoning_content
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls:
            # As vLLM: templates read the arguments as a mapping (Qwen's writes them with tojson).
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        elif out["content"] is None:
            out["content"] = ""
        return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # the template gets what the client sent


class FunctionDefinition(Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool | None = None  # None: true, or false with continue_final_message
    # tool calling (server/tool_calls.py) and the chat template's extra inputs
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    continue_final_message: bool | None = None
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_content_only(cls, data: Any) -> Any:
        messages = data.get("messages") if isinstance(data, dict) else None
        for i, m in enumerate(messages if isinstance(messages, list) else []):
            parts = m.get("content") if isinstance(m, dict) else None
            for j, part in enumerate(parts if isinstance(parts, list) else []):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in OTHER_PARTS:
                    raise invalid(f"messages.{i}.content.{j}", f"{kind} content is not supported: this server "
                                  "serves text-only models (text parts only)")
        return data

    def check(self) -> None:
        super().check()
        if self.top_logprobs and not self.logprobs:
            raise invalid("top_logprobs", "requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise invalid("continue_final_message", "cannot be combined with add_generation_prompt: true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise invalid("continue_final_message", "needs an assistant message last, to continue")
        for i, m in enumerate(self.messages):
            if m.content is None and not (m.role == "assistant" and m.tool_calls):
                raise invalid(f"messages.{i}.content", "is required (only an assistant turn with tool_calls "
                              "may leave it null)")

    @property
    def generation_prompt(self) -> bool:
        return self.add_generation_prompt if self.add_generation_prompt is not None \
            else not self.continue_final_message

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# -- responses ------------------------------------------------------------------------


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token (the first None) token id -> its logprob, the
# prompt token's own first, then the top N.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's extra: the stop string or token that ended it
    prompt_logprobs: PromptLogprobs | None = Field(None, **_omit_none)  # vLLM's extra


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = Field(None, **_omit_none)  # vLLM's: a prefill's, for the decode


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class DeltaFunctionCall(BaseModel):
    name: str | None = Field(None, **_omit_none)
    arguments: str | None = Field(None, **_omit_none)


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = Field(None, **_omit_none)  # first chunk of a call: its id, type and name
    type: Literal["function"] | None = Field(None, **_omit_none)
    function: DeltaFunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = Field(None, **_omit_none)  # vLLM's, with a reasoning parser
    tool_calls: list[ToolCallOut] | None = Field(None, **_omit_none)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, **_omit_none)  # vLLM's extra
    kv_transfer_params: dict[str, Any] | None = Field(None, **_omit_none)  # vLLM's: a prefill's, for the decode


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = Field(None, **_omit_none)
    content: str | None = Field(None, **_omit_none)
    reasoning_content: str | None = Field(None, **_omit_none)
    tool_calls: list[DeltaToolCall] | None = Field(None, **_omit_none)


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(None, **_omit_none)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "modserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(TextChecked, Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(TextChecked, Strict):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class EmbeddingRequest(TextChecked, Strict):
    """OpenAI's embeddings request, and vLLM's ``add_special_tokens``."""

    model: str | None = None
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # a Matryoshka model's leading part; any other model: 400
    user: str | None = None
    add_special_tokens: bool = True

    @field_validator("input")
    @classmethod
    def _input_shape(cls, value: Any) -> Prompt:
        return CompletionRequest._prompt_shape(value)

    def inputs(self) -> list[str | list[int]]:
        p = self.input
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32, as OpenAI's encoding_format


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
