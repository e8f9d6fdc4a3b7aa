"""EngineConfig: every setting of an engine, validated at the boundary.

Read from YAML or TOML (:mod:`modserve.config_files`), then overridden by CLI flags or
``LLM(...)`` keywords.
Unknown keys are errors naming the key. vLLM's names for the same settings are the
front door's (:mod:`modserve.vllm_compat`); files may spell keys with dashes, as vLLM's do.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class PluginChoice(BaseModel):
    """The implementation selected for one kind: its registered name and its options block.

    In a config file either a bare name (``attention_backend: paged``) or
    ``{name: paged, options: {...}}``.
    """

    model_config = ConfigDict(extra="forbid")
    name: str
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        if isinstance(value, type):  # a class, as vLLM's LLM(logits_processors=[Cls]) takes one: by its path
            return {"name": f"{value.__module__}:{value.__qualname__}"}
        return {"name": value} if isinstance(value, str) else value


class SpeculativeConfig(BaseModel):
    """Speculative decoding: a proposer plugin drafts, the target verifies in one pass."""

    model_config = ConfigDict(extra="forbid")
    proposer: PluginChoice = Field(description="Proposer plugin: ngram, draft_model, ...")
    num_speculative_tokens: int = Field(4, gt=0, le=16, description="Draft tokens per step (k)")


class PoolerConfig(BaseModel):
    """How the pooling runner makes one vector of a prompt (vLLM's ``--pooler-config``). A key left
    unset comes from the checkpoint's sentence-transformers files, else LAST and normalize."""

    model_config = ConfigDict(extra="forbid")
    pooling_type: Literal["LAST", "MEAN", "CLS"] | None = Field(
        None, description="LAST: the last token's hidden state; MEAN: the mean over the prompt; CLS: the first")
    normalize: bool | None = Field(None, description="L2-normalize each vector (after any `dimensions` cut)")


class KVEventsConfig(BaseModel):
    """KV cache events published over ZMQ after each step (vLLM's ``--kv-events-config``), docs/kv-events.md."""

    model_config = ConfigDict(extra="forbid")
    enable_kv_cache_events: bool = Field(False, description="Publish BlockStored/BlockRemoved/AllBlocksCleared")
    publisher: Literal["zmq", "null"] | None = Field(
        None, description="zmq, or null (publish nothing); default: zmq when enabled")
    endpoint: str = Field("tcp://*:5557", description="PUB socket: bound if it has * or is ipc://, else connected; "
                          "data-parallel rank r adds r to the port")
    replay_endpoint: str | None = Field(None, description="ROUTER socket resending buffered batches from a "
                                        "sequence number (port + rank too)")
    buffer_steps: int = Field(10_000, gt=0, description="Batches (steps with events) kept for replay")
    hwm: int = Field(100_000, gt=0, description="ZMQ send high-water mark: past it a slow subscriber misses batches")
    max_queue_size: int = Field(100_000, gt=0, description="Batches waiting for the publisher thread; when full "
                                "the engine step waits")
    topic: str = Field("", description="First frame of each message; subscribers filter on it")

    @model_validator(mode="after")
    def _default_publisher(self) -> KVEventsConfig:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        return self


class LoRAModule(BaseModel):
    """An adapter served from the start (vLLM's ``--lora-modules name=path`` or its JSON form)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    path: str = Field(min_length=1)
    base_model_name: str | None = None


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str = Field(description="Path to a Hugging Face checkpoint directory")
    tokenizer: str | None = Field(None, description="Tokenizer directory (default: the model's)")
    runner: Literal["generate", "pooling"] = Field(
        "generate", description="generate: text generation; pooling: embeddings (/v1/embeddings, LLM.embed), the "
        "final hidden states pooled per prompt, no LM head and no decode (vLLM's --runner; --task embed)")
    pooler_config: PoolerConfig | None = Field(
        None, description="runner pooling: {pooling_type: LAST|MEAN|CLS, normalize: bool}; unset keys: the "
        "checkpoint's sentence-transformers modules.json and 1_Pooling/config.json, else LAST and normalize")
    served_model_name: str | list[str] | None = Field(
        None, description="Name reported by the API (default: the model path); a list: the first is reported, "
        "each is accepted in requests")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Compute dtype; auto: the checkpoint's on GPU, float32 on CPU")
    quantization: PluginChoice | None = Field(
        None, description="Quantizer plugin (int8, fp8, awq, gptq); default: the checkpoint's "
        "quantization_config.quant_method, else none")
    max_model_len: int | None = Field(None, gt=0, description="Default: the model's max_position_embeddings")
    block_size: int = Field(16, gt=0, description="Tokens per KV block")
    kv_cache_dtype: Literal["auto", "bfloat16", "fp8_e4m3"] = Field(
        "auto", description="KV cache values: auto (the compute dtype, or the platform's choice: the CPU's "
        "bf16_gemm route keeps bf16), bfloat16, or fp8_e4m3 (vLLM's fp8) with per-tensor scales")
    kv_cache_memory_gb: float | None = Field(None, gt=0, description="KV cache size; wins over the fraction")
    kv_cache_memory_fraction: float = Field(0.2, gt=0, le=0.95, description="Fraction of free memory for KV")
    num_kv_blocks: int | None = Field(None, gt=0, description="Exact block count (overrides both sizes)")
    preemption_mode: Literal["recompute", "swap"] = Field(
        "recompute", description="When blocks run out: drop the KV and recompute it, or copy it to host memory")
    swap_space_gb: float = Field(4.0, ge=0, description="Host memory for swapped-out KV (preemption_mode: swap)")
    async_scheduling: bool = Field(
        False, description="Detokenize step N's tokens, check them for stop strings and turn them into "
        "outputs on a background thread while step N+1's forward runs (docs/scheduling.md)")
    num_swap_blocks: int | None = Field(None, ge=0, description="Exact host block count (overrides swap_space_gb)")
    max_num_seqs: int = Field(128, gt=0, description="Most sequences running at once")
    max_num_batched_tokens: int = Field(2048, gt=0, description="Token budget of one step (prefill chunk size)")
    max_waiting_requests: int = Field(
        1024, gt=0, description="Server: requests waiting for their first token; beyond this, 503 (a single "
        "request with more prompts than this is a 400: it could never be admitted)")
    max_sequences_per_request: int | None = Field(
        None, gt=0, description="Server: most sequences one request may start (its prompts times n), else 400; "
        "default: 8 x max_num_seqs, eight batches' worth")
    max_embedding_inputs: int = Field(
        2048, gt=0, description="Server, runner pooling: most inputs in one /v1/embeddings request, else 400")
    max_stop_strings: int = Field(64, gt=0, description="Server: most stop strings in one request, else 400")
    max_stop_chars: int = Field(
        1024, gt=0, description="Server: most characters in one request's stop strings together, else 400")
    max_stop_token_ids: int = Field(64, gt=0, description="Server: most stop_token_ids in one request, else 400")
    max_bad_words: int = Field(64, gt=0, description="Server: most bad_words in one request, else 400")
    max_bad_words_chars: int = Field(
        1024, gt=0, description="Server: most characters in a request's bad_words, else 400")
    max_logprobs: int = Field(
        20, ge=0, description="Most logprobs per token a request may ask for (completions logprobs, chat "
        "top_logprobs, prompt_logprobs), else an error (400 at the server); vLLM's default")
    max_request_body_bytes: int | None = Field(
        None, gt=0, description="Server: largest request body accepted, else 413; default: 1 MiB plus "
        "64 bytes per token of max_model_len")
    request_read_timeout: float = Field(
        30.0, gt=0, description="Server: seconds a client may take to send a request's headers, and "
        "again its body; past it the connection is closed (headers) or answered 408 (body)")
    max_response_bytes: int = Field(
        64 * 2**20, gt=0, description="Server: largest non-streamed response a request may ask for, estimated "
        "before it runs (n, prompts, max_tokens, logprobs, prompt_logprobs, echo), else 400")
    max_stored_responses: int = Field(
        1000, ge=0, description="Server: most /v1/responses answers kept in memory for retrieval and "
        "previous_response_id; past it the oldest is evicted (a later reference to it is a 404); 0: none kept")
    stream_stall_timeout: float = Field(
        30.0, ge=0, description="Server: seconds a stream's output may wait unread (its client does not read) "
        "before the stream is aborted, freeing its sequences' batch slots and KV; 0: never")
    step_timeout: float = Field(
        600.0, gt=0, description="Server: seconds one engine step may run (or an engine process stay silent) "
        "before the engine is declared hung: its requests fail, /health turns 503, its processes are killed")
    exit_on_engine_death: bool = Field(
        True, description="Server: once an engine dies, drain the other requests and exit non-zero (as vLLM "
        "does, so a supervisor restarts it); off, it stays up answering 503")
    shutdown_timeout: float = Field(
        30.0, ge=0, description="Server: on SIGTERM/SIGINT, seconds to let requests in flight finish; then "
        "streams end with an error event and [DONE], others get 503")
    metrics_naming: Literal["modserve", "vllm"] = Field(
        "modserve", description="Server: the families /metrics emits: modserve_* (modserve), or vLLM's vllm:* "
        "names, labels and buckets with model_name and engine labels, for dashboards and gateways made for "
        "vLLM (docs/server.md)")
    chat_template: str | None = Field(
        None, description="Server chat and LLM.chat: a Jinja chat template, inline or a file's path, instead of "
        "the tokenizer's")
    allow_special_tokens_in_content: bool = Field(
        False, description="Server chat: let special-token text in message content (<|im_start|>...) become "
        "control tokens; off, it is encoded as plain text so a user cannot forge a turn")
    tool_call_parser: PluginChoice | None = Field(None, description="Server chat: tool parser plugin (hermes, ...)")
    enable_auto_tool_choice: bool = Field(False, description="Server chat: allow tool_choice auto (needs a parser)")
    reasoning_parser: PluginChoice | None = Field(None, description="Server chat: reasoning parser plugin (qwen3, ...)")
    generation_config: str = Field("auto", description="Sampling defaults of requests that leave them unset: "
                                   "auto (the model's generation_config.json), vllm (none), or a directory's")
    override_generation_config: dict[str, Any] | None = Field(
        None, description="Sampling defaults merged over generation_config's, e.g. {temperature: 0}")
    seed: int = Field(0, description="Seed of the global sampling RNG (per-request seeds are separate)")
    device: str = Field("cpu", description="torch device: cpu, cuda, cuda:1")
    platform: PluginChoice | None = Field(
        None, description="Platform plugin: what is device-specific (dtype auto, memory, compile policy, "
        "linear kernels); default: the device's type (cpu, cuda)")
    num_threads: int | None = Field(None, gt=0, description="torch intra-op threads, per rank (default: torch's)")
    tensor_parallel_size: int = Field(
        1, gt=0, description="Ranks (processes, one device each) the model's layers and KV heads split over")
    pipeline_parallel_size: int = Field(
        1, gt=0, description="Pipeline stages (each of tensor_parallel_size ranks) the decoder layers split over")
    pp_layer_partition: list[int] | None = Field(
        None, description="Decoder layers per pipeline stage, e.g. [5, 7]; default: as even as can be")
    pipeline_micro_batches: int | None = Field(
        None, gt=0, description="Pipeline parallel: micro-batches each step is split into, so the stages work "
        "at once; default: one per stage for steps of 128 tokens a stage or more (prefills), else one")
    pipeline_in_flight: bool = Field(
        True, description="Pipeline parallel: keep up to pipeline_parallel_size steps of disjoint batches in "
        "flight, so every stage works on decode (vLLM's batch queue; false: one step at a time)")
    data_parallel_size: int = Field(
        1, gt=0, description="Server: engine replicas (each of tensor_parallel_size ranks) behind one server, "
        "each request routed to one; on a shared memory (CPU) kv_cache_memory_fraction is split between them")
    data_parallel_routing: Literal["load", "prefix"] = Field(
        "prefix", description="Server, data_parallel_size > 1: prefix sends a request to the replica that "
        "holds the longest part of its prompt's prefix (else, or with load, to the least loaded replica)")
    data_parallel_backend: Literal["mp", "ray"] = Field(
        "mp", description="Server: how the data-parallel engine cores start: mp (processes of this machine, and "
        "--headless on others), ray (Ray actors, each rank's placement group on whatever node has room: the "
        "cluster at RAY_ADDRESS, else a local one stopped with the server)")
    distributed_executor_backend: PluginChoice | None = Field(
        None, description="Executor plugin that starts the ranks beyond the first: mp (processes on this "
        "machine), ray (Ray actors, several machines); default mp when tensor_parallel_size > 1, else uni")
    master_port: int | None = Field(
        None, ge=1, le=65535, description="The port the tensor/pipeline-parallel ranks rendezvous on (torch."
        "distributed's store, on the executor's rendezvous host), for a firewall that opens one port; "
        "data-parallel rank i takes master_port + i; default: a free port")
    compile: Literal["auto", "on", "off"] = Field(
        "auto", description="torch.compile each layer's ops around attention (and, on CPU with a 16-bit "
        "checkpoint, the batch-1 decode GEMV); auto: on for models of 64 MiB of weights or more, quantized "
        "ones when the quantizer's kernels trace (int8 on a CPU)")
    prepack_weights: Literal["auto", "on", "off"] = Field(
        "auto", description="CPU, float32: pack each linear's weight once for batched GEMMs (faster "
        "batched steps; a second float32 copy); auto: on for unquantized CPU models of 64 MiB or more")
    cuda_graph_sizes: list[int] | None = Field(
        None, description="CUDA: decode batch sizes captured as CUDA graphs (a batch runs padded to the next "
        "one, eager above the largest); default 1, 2, 4, then every 8 up to max_num_seqs; [] captures none "
        "(vLLM's enforce_eager sets [] and compile: off)")
    attention_backend: PluginChoice = Field(PluginChoice(name="paged"), description="Attention backend plugin")
    moe_backend: PluginChoice = Field(
        PluginChoice(name="fused"), description="Mixture-of-experts models: how a layer computes its routed "
        "experts (fused: tokens sorted by expert, one GEMM per expert; reference: a loop over experts)")
    enable_expert_parallel: bool = Field(
        False, description="Mixture-of-experts models under tensor parallelism: each rank holds E / ranks whole "
        "experts and the layer's output is summed over the ranks (vLLM's name); default: every rank holds a "
        "slice of every expert's intermediate dimension (expert tensor parallelism)")
    kv_allocator: PluginChoice = Field(PluginChoice(name="paged"), description="KV block allocator plugin")
    kv_events_config: KVEventsConfig | None = Field(
        None, description="KV cache events over ZMQ for prefix-aware routers (vLLM's): {enable_kv_cache_events: "
        "true, endpoint: tcp://*:5557, replay_endpoint: ..., topic: ...}; default: none")
    scheduler: PluginChoice = Field(PluginChoice(name="fcfs"), description="Scheduling policy plugin")
    sampler: PluginChoice = Field(PluginChoice(name="default"), description="Sampler plugin")
    logits_processors: list[PluginChoice] = Field(
        default_factory=list, description="Logits processor plugins the sampler applies, in order (vLLM's "
        "--logits-processors): registered names (no_repeat_ngram) or classes as pkg.mod:Class; a request's "
        "arguments come in its extra_args (server: vllm_xargs)")
    max_vllm_xargs_bytes: int = Field(
        4096, gt=0, description="Server: largest vllm_xargs (its JSON) in one request, else 400")
    grammar_backend: PluginChoice = Field(
        PluginChoice(name="auto"), description="Structured outputs: a grammar backend plugin, or auto "
        "(the first registered backend that compiles the spec: xgrammar, then outlines, then others)")
    grammar_cache_size: int = Field(256, gt=0, description="Compiled grammars kept (LRU), per engine")
    grammar_compile_workers: int = Field(
        2, gt=0, description="Worker processes (or threads) compiling structured-output grammars, started "
        "on the first guided request: a slow compile holds one until it ends or is killed")
    grammar_compile_timeout: float = Field(
        10.0, gt=0, description="Seconds a grammar may take to compile (a worker's start-up not counted); "
        "past it that request is refused (400 at the server) and its worker process is killed and replaced")
    grammar_compile_memory_mb: int = Field(
        1024, gt=0, description="MiB of address space a grammar compile worker may add beyond its imports; "
        "a compile past it is stopped and its request refused (400 at the server)")
    grammar_compile_isolation: Literal["process", "thread"] = Field(
        "process", description="process: compiles run in worker processes that are killed at the timeout "
        "or the memory cap; thread: in this process (no start-up, but never stopped: offline use only, "
        "`modserve serve` always uses processes)")
    grammar_max_size: int = Field(
        100_000, gt=0, description="Structured outputs: the largest constraint compiled, in automaton "
        "positions (counted repetitions multiplied out, a character class as 8, schema nodes, enum text); "
        "past it a 400 (a ValueError offline)")
    grammar_max_repetition: int = Field(
        65_536, gt=0, description="Structured outputs: the largest counted repetition in a constraint (a{n}, "
        "maxLength, maxItems; nested counts in a regex or grammar multiplied); past it a 400")
    grammar_max_depth: int = Field(
        128, gt=0, description="Structured outputs: the deepest nesting of a constraint (regex or grammar "
        "groups, a schema's JSON); past it a 400")
    grammar_max_alternatives: int = Field(
        1024, gt=0, description="Structured outputs: the most alternatives in one place of a constraint "
        "(choices, enum values, anyOf/oneOf branches, an object's properties, '|' branches); past it a 400")
    speculative: SpeculativeConfig | None = Field(None, description="Speculative decoding; off when unset")
    kv_connector: PluginChoice | None = Field(
        None, description="KV connector plugin: where full prompt blocks of KV go beyond this engine's cache "
        "and come back from (shared_storage: files, shm: shared memory, host: a host-memory tier, mooncake: "
        "another host over the network); off when unset")
    kv_role: Literal["producer", "consumer", "both"] = Field(
        "both", description="With kv_connector: producer saves prompt blocks, consumer loads them, both does "
        "both (vLLM's kv_producer, kv_consumer, kv_both are accepted)")
    enable_lora: bool = Field(False, description="Serve LoRA adapters (PEFT format) on the base model: "
                              "per request, several in one batch (docs/lora.md)")
    max_loras: int = Field(1, gt=0, description="With enable_lora: the most distinct adapters in one step "
                           "(device slots); a request whose adapter finds no slot waits")
    max_lora_rank: int = Field(16, gt=0, description="With enable_lora: the largest adapter rank r accepted "
                               "(slots are this wide)")
    max_cpu_loras: int | None = Field(None, gt=0, description="With enable_lora: adapters cached in host "
                                      "memory (LRU); default max_loras")
    lora_modules: list[LoRAModule] = Field(
        [], description="With enable_lora: adapters served from the start, each "
        "{name, path} (the server lists them as models)")
    lora_resolvers: list[PluginChoice] = Field(
        [], description="With enable_lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING: lora_resolver plugins asked, in "
        "order, for an adapter a request names that is not loaded (filesystem, ...; docs/lora.md)")
    lora_resolver_timeout: float = Field(30.0, gt=0, description="With lora_resolvers: seconds one resolver "
                                         "may take to answer for a name, after which its requests get a 503")
    kv_load_failure_policy: Literal["recompute", "fail"] = Field(
        "recompute", description="With kv_connector: when a block cannot be loaded (missing, corrupt), compute "
        "the prompt instead, or fail that request")

    @field_validator("model", "tokenizer", mode="before")
    @classmethod
    def _path_as_text(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value  # LLM(Path(...)) works too

    @field_validator("model")
    @classmethod
    def _model_dir(cls, value: str) -> str:
        path = Path(value).expanduser()
        if not path.is_dir():
            raise ValueError(f"model directory does not exist: {value}")
        return str(path)

    @field_validator("compile", "prepack_weights", mode="before")
    @classmethod
    def _on_off(cls, value: Any) -> Any:
        # YAML reads on/off/yes/no/true/false as booleans: `compile: off` means "off"
        return {True: "on", False: "off"}[value] if isinstance(value, bool) else value

    @field_validator("kv_role", mode="before")
    @classmethod
    def _vllm_role(cls, value: Any) -> Any:
        return value.removeprefix("kv_") if isinstance(value, str) else value  # vLLM's kv_producer

    @model_validator(mode="after")
    def _connector_layout(self) -> "EngineConfig":
        if self.kv_connector is not None and self.pipeline_parallel_size > 1:
            raise ValueError("kv_connector does not work with pipeline_parallel_size > 1 yet (tensor parallel does)")
        if (self.lora_modules or self.lora_resolvers) and not self.enable_lora:
            raise ValueError(f"{'lora_modules' if self.lora_modules else 'lora_resolvers'} needs enable_lora")
        if self.enable_lora and self.cuda_graph_sizes:
            raise ValueError("enable_lora reads each step's adapters outside any graph: not with cuda_graph_sizes")
        if self.logits_processors and self.speculative is not None:
            raise ValueError("logits_processors cannot be combined with speculative decoding yet: drafts are "
                             "verified without the processors' per-row state")
        if self.async_scheduling and self.runner == "pooling":
            raise ValueError("async_scheduling does not work with runner pooling: it has no decode steps to overlap")
        if self.runner == "pooling" and self.world_size > 1:  # its forward runs on rank 0 alone
            raise ValueError("runner pooling runs on one rank: tensor_parallel_size and pipeline_parallel_size 1")
        return self

    @field_validator("served_model_name")
    @classmethod
    def _names(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) < 2:
            if not value:
                raise ValueError("give at least one name")
            return value[0]
        return value

    @field_validator("chat_template")
    @classmethod
    def _template_readable(cls, value: str | None) -> str | None:
        if value is not None:
            chat_template_text(value)  # a missing file fails now, not at the first chat request
        return value

    def served_model_names(self) -> list[str]:
        """The names the API answers to; the first is the one it reports."""
        names = self.served_model_name or self.model
        return [names] if isinstance(names, str) else list(names)

    def chat_template_text(self) -> str | None:
        """``chat_template`` as Jinja text (read, when it names a file), or None: the tokenizer's."""
        return chat_template_text(self.chat_template) if self.chat_template else None

    def executor_choice(self) -> PluginChoice:
        return self.distributed_executor_backend or PluginChoice(name="mp" if self.world_size > 1 else "uni")

    @property
    def world_size(self) -> int:
        """Ranks of one engine: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def platform_choice(self) -> PluginChoice:
        """``platform``, else the built-in named after the device's type (``cuda:1`` -> cuda)."""
        return self.platform or PluginChoice(name=self.device.partition(":")[0])

    @classmethod
    def from_dict(cls, data: dict[str, Any], **overrides: Any) -> "EngineConfig":
        merged = dict(data)
        merged.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.model_validate(merged)
        except ValidationError as e:
            raise ValueError("invalid config: " + describe_validation_error(e)) from None








def describe_validation_error(e: ValidationError, what: str = "config key") -> str:
    """One clause per problem, each naming its field: 'unknown key' reads better than pydantic's default."""
    lines = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"]) or what
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown {what} {where!r}")
        else:
            value = err.get("input")
            got = f" (got {value!r})" if isinstance(value, (str, int, float, bool)) and err["type"] != "value_error" \
                else ""
            lines.append(f"{where}: {err['msg'].removeprefix('Value error, ')}{got}")
    return "; ".join(lines)


def chat_template_text(value: str) -> str:
    """A chat template given inline (Jinja: it holds ``{{`` or ``{%``) or as a file's path, as text."""
    if "{{" in value or "{%" in value:
        return value
    try:
        return Path(value).expanduser().read_text()
    except OSError as e:
        raise ValueError(f"{value!r} is no Jinja template and no readable file ({e.strerror or e})") from None
