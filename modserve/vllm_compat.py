"""vLLM's option names on modserve's EngineConfig: a ``vllm serve`` command line or
config file, said in modserve's keys. The front door's (the CLI's), not the core's:
:func:`engine_config` is ``EngineConfig.from_dict`` that also takes vLLM's keys.

Every entry of :data:`VLLM_OPTIONS` is one of three kinds:

- ``mapped``: the same setting under modserve's name (``swap_space`` -> ``swap_space_gb``),
  a plugin's option (``enable_prefix_caching`` -> ``kv_allocator.options``), or, for
  ``gpu_memory_utilization``, a KV cache size computed as vLLM computes it;
- ``refused``: a feature modserve does not have; any value but vLLM's default is an
  error naming the option and why;
- ``ignored``: harmless here (downloads, logging, all-reduce plumbing); a value other than
  vLLM's default logs a warning naming the option.

Options vLLM and modserve spell alike (``max_model_len``, ``dtype``, ``quantization``,
``tensor_parallel_size``, ``distributed_executor_backend``, ...) are EngineConfig fields
and need no entry; their vLLM-only values (``dtype: half``,
``kv_cache_dtype: fp8``, a Hugging Face id as ``model``) are :data:`VALUES`'.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

if TYPE_CHECKING:
    from modserve.core.config import EngineConfig

logger = logging.getLogger("modserve")

Kind = Literal["mapped", "refused", "ignored"]

# Memory left for what is neither weights, KV nor activations: the runtime (CUDA
# context, allocator slack, the server's own objects).
RUNTIME_HEADROOM_BYTES = 512 * 2**20


@dataclass(frozen=True, slots=True)
class VllmOption:
    """One vLLM option: its key (underscores), how argparse reads it, and what it does here."""

    key: str
    kind: Kind
    maps_to: str  # for --help and docs/configuration.md: what it becomes, or why not
    arg: dict[str, Any] = field(default_factory=dict)  # argparse: type=, action=, metavar=
    apply: Callable[[dict[str, Any], Any], None] | None = None  # mapped: patch the config data
    default: Any = None  # refused / ignored: the value that is fine
    short: str | None = None  # vLLM's short flag (-tp)


def _plugin_choice(data: dict[str, Any], key: str) -> dict[str, Any]:
    """``data[key]`` as a plain ``{name, options}`` dict (a copy), the field's default if unset."""
    from modserve.core.config import EngineConfig, PluginChoice

    value = data.get(key)
    if value is None:
        value = EngineConfig.model_fields[key].default
    if isinstance(value, str):
        return {"name": value, "options": {}}
    if isinstance(value, PluginChoice):
        return value.model_dump()
    if not isinstance(value, dict):
        raise ValueError(f"{key}: expected a name or {{name, options}}, got {value!r}")
    return {**value, "options": dict(value.get("options") or {})}


def _set_option(key: str, option: str) -> Callable[[dict[str, Any], Any], None]:
    def apply(data: dict[str, Any], value: Any) -> None:
        choice = _plugin_choice(data, key)
        choice["options"][option] = value
        data[key] = choice
    return apply


def _set_name(key: str) -> Callable[[dict[str, Any], Any], None]:
    def apply(data: dict[str, Any], value: Any) -> None:
        choice = _plugin_choice(data, key)
        choice["name"] = value
        data[key] = choice
    return apply


def _rename(key: str, convert: Callable[[Any], Any] = lambda v: v) -> Callable[[dict[str, Any], Any], None]:
    def apply(data: dict[str, Any], value: Any) -> None:
        data[key] = convert(value)
    return apply


def _enforce_eager(data: dict[str, Any], value: Any) -> None:
    if not value:
        return  # --no-enforce-eager: modserve's compile and graph policies decide, as vLLM's do
    if data.get("compile") in ("on", True):
        raise ValueError("enforce_eager contradicts compile: on")
    if data.get("cuda_graph_sizes"):
        raise ValueError(f"enforce_eager contradicts cuda_graph_sizes: {data['cuda_graph_sizes']}")
    data["compile"], data["cuda_graph_sizes"] = "off", []


def _speculative(data: dict[str, Any], value: Any) -> None:
    if isinstance(value, str):  # the JSON of --speculative-config, or YAML
        import yaml

        from modserve.config_files import yaml_error

        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ValueError(f"speculative_config: not JSON: {yaml_error(e)}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config: expected a JSON object, got {value!r}")
    data["speculative"] = speculative_from_vllm(value)


# vLLM's connector class names -> modserve's built-ins, and their extra-config keys -> options.
VLLM_CONNECTORS = {"SharedStorageConnector": "shared_storage", "OffloadingConnector": "host",
                   "MooncakeConnector": "mooncake"}
VLLM_CONNECTOR_OPTIONS = {"shared_storage_path": "path", "cpu_bytes_to_use": "size_gb"}


def _kv_transfer(data: dict[str, Any], value: Any) -> None:
    """vLLM's ``--kv-transfer-config`` JSON: kv_connector, kv_role, kv_connector_extra_config,
    kv_load_failure_policy."""
    import yaml

    if isinstance(value, str):
        value = yaml.safe_load(value)
    if not isinstance(value, dict) or "kv_connector" not in value:
        raise ValueError(f"kv_transfer_config: expected a JSON object with kv_connector, got {value!r}")
    unknown = set(value) - {"kv_connector", "kv_role", "kv_connector_extra_config", "kv_load_failure_policy"}
    if unknown:
        raise ValueError(f"kv_transfer_config: keys modserve does not take: {sorted(unknown)}")
    name = VLLM_CONNECTORS.get(value["kv_connector"], value["kv_connector"])
    options = {}
    for key, v in (value.get("kv_connector_extra_config") or {}).items():
        if key == "cpu_bytes_to_use":
            v = v / 2**30
        options[VLLM_CONNECTOR_OPTIONS.get(key, key)] = v
    data["kv_connector"] = {"name": name, "options": options}
    for key in ("kv_role", "kv_load_failure_policy"):
        if key in value:
            data[key] = value[key]


# vLLM's --structured-outputs-config: its keys modserve takes, and the backends it names that
# are modserve's (another plugin is named by the grammar_backend key).
STRUCTURED_OUTPUTS_KEYS = ("backend", "disable_fallback", "disable_any_whitespace", "reasoning_parser")
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "outlines")


def _structured_outputs(data: dict[str, Any], value: Any) -> None:
    """vLLM's ``--structured-outputs-config`` JSON onto grammar_backend (its name and the
    whitespace option of the backend named) and reasoning_parser."""
    import yaml

    where = "structured_outputs_config"
    if isinstance(value, str):
        value = yaml.safe_load(value)
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object, got {value!r}")
    unknown = sorted(set(value) - set(STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise ValueError(f"{where}: keys modserve does not take: {unknown}; accepted: "
                         f"{', '.join(STRUCTURED_OUTPUTS_KEYS)}")
    backend = value.get("backend", "auto")
    if backend not in STRUCTURED_OUTPUTS_BACKENDS:
        raise ValueError(f"{where}: backend {backend!r} is not one of modserve's; accepted: "
                         f"{', '.join(STRUCTURED_OUTPUTS_BACKENDS)} (another plugin: the grammar_backend key)")
    for key in ("disable_fallback", "disable_any_whitespace"):
        if not isinstance(value.get(key, False), bool):
            raise ValueError(f"{where}: {key} must be true or false, got {value[key]!r}")
    named = backend != "auto"
    if value.get("disable_fallback") and not named:
        raise ValueError(f"{where}: disable_fallback needs a named backend (xgrammar or outlines): auto falls "
                         "back from one backend to the next, a named one never does")
    choice = _plugin_choice(data, "grammar_backend")
    choice["name"] = backend
    if "disable_any_whitespace" in value:
        if not named:
            raise ValueError(f"{where}: disable_any_whitespace needs a named backend (xgrammar or outlines): "
                             "auto takes no options")
        if backend == "xgrammar":
            choice["options"]["any_whitespace"] = not value["disable_any_whitespace"]
        elif value["disable_any_whitespace"]:  # outlines: no whitespace; false keeps its bounded default
            choice["options"]["whitespace_pattern"] = ""
    data["grammar_backend"] = choice
    if value.get("reasoning_parser"):
        data["reasoning_parser"] = {"name": value["reasoning_parser"], "options": {}}


def _kv_cache_dtype(value: Any) -> Any:
    if value == "fp8":  # vLLM's fp8 is e4m3, as modserve's
        return "fp8_e4m3"
    if isinstance(value, str) and value.startswith("fp8_") and value != "fp8_e4m3":
        raise ValueError(f"kv_cache_dtype={value!r} is not supported: the fp8 KV cache is e4m3 (fp8, fp8_e4m3)")
    return value


HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)")
DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(value: Any) -> Any:
    """vLLM's rule for ``--max-model-len 32k``: a lowercase suffix is decimal and may follow a
    fraction (``25.6k`` = 25600), an uppercase one binary and may not (``32K`` = 32768).
    Anything else is returned as it is, for the config's own check."""
    match = HUMAN_INT.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        return value
    number, suffix = match.groups()
    if suffix in DECIMAL_SUFFIXES:
        return int(float(number) * DECIMAL_SUFFIXES[suffix])
    if "." in number:
        if not suffix:
            return value
        raise ValueError(f"{value!r}: a fraction takes a decimal suffix ({number}{suffix.lower()}), "
                         f"not the binary {suffix}")
    return int(number) * BINARY_SUFFIXES.get(suffix, 1)


HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def _model(value: Any) -> Any:
    """``vllm serve ORG/NAME``: the Hugging Face cache's complete snapshot, when it has one."""
    if not isinstance(value, str) or Path(value).expanduser().is_dir() or not HUB_ID.fullmatch(value):
        return value
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(value, local_files_only=True)
    except Exception:  # not cached (or no huggingface_hub)
        raise ValueError(f"model directory does not exist: {value} (modserve loads local checkpoints; a "
                         f"Hugging Face model must be downloaded first: huggingface-cli download {value})") from None


# vLLM's values for keys both spell alike.
VALUES: dict[str, Callable[[Any], Any]] = {
    "dtype": lambda v: {"half": "float16", "float": "float32"}.get(v, v) if isinstance(v, str) else v,
    "kv_cache_dtype": _kv_cache_dtype,
    "model": _model,
    "max_model_len": human_readable_int,  # the integers vLLM's CLI reads with a suffix
    "max_num_batched_tokens": human_readable_int,
    "lora_modules": lambda v: [_lora_module(m) for m in (v if isinstance(v, list) else [v])],
}


def _lora_module(value: Any) -> Any:
    """vLLM's ``--lora-modules`` item: ``name=path``, or its JSON form (a mapping, kept as it is)."""
    if isinstance(value, str):
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora_modules: {value!r} is neither name=path nor a JSON object with name and path")
        return {"name": name, "path": path}
    return value


def _task(data: dict[str, Any], value: Any) -> None:
    """vLLM's older ``--task``: embed is the pooling runner, generate the default; others are not built."""
    runners = {"embed": "pooling", "embedding": "pooling", "generate": "generate", "auto": None}
    if value not in runners:
        raise ValueError(f"task {value!r} is not supported: embed (runner pooling) or generate")
    if runners[value]:
        data["runner"] = runners[value]


_BOOL = {"action": "BooleanOptionalAction"}
_INT = {"type": int, "metavar": "INT"}
_FLOAT = {"type": float, "metavar": "FLOAT"}
_TEXT = {"metavar": "TEXT"}
_NOT_BUILT = "{} parallelism is not built yet; tensor parallelism is: --tensor-parallel-size (-tp)"

VLLM_OPTIONS: tuple[VllmOption, ...] = (
    # -- mapped onto modserve's settings
    VllmOption("gpu_memory_utilization", "mapped",
               "kv_cache_memory_gb: utilization x the device's total memory - the weights as the engine "
               "holds them - an activation and runtime headroom (see docs/configuration.md)", _FLOAT),
    VllmOption("enable_prefix_caching", "mapped", "kv_allocator options: enable_prefix_caching", _BOOL,
               _set_option("kv_allocator", "enable_prefix_caching")),
    VllmOption("enable_chunked_prefill", "mapped", "scheduler options: chunked_prefill", _BOOL,
               _set_option("scheduler", "chunked_prefill")),
    VllmOption("long_prefill_token_threshold", "mapped", "scheduler options: long_prefill_token_threshold",
               _INT, _set_option("scheduler", "long_prefill_token_threshold")),
    VllmOption("scheduling_policy", "mapped", "scheduler: NAME (fcfs, priority; its options are kept)",
               {"metavar": "NAME"}, _set_name("scheduler")),
    VllmOption("swap_space", "mapped", "swap_space_gb (used with preemption_mode: swap)", _FLOAT,
               _rename("swap_space_gb")),
    VllmOption("num_gpu_blocks_override", "mapped", "num_kv_blocks", _INT, _rename("num_kv_blocks")),
    VllmOption("kv_cache_memory_bytes", "mapped", "kv_cache_memory_gb (bytes / 2**30)", {"metavar": "INT"},
               _rename("kv_cache_memory_gb", lambda v: human_readable_int(v) / 2**30)),
    VllmOption("enforce_eager", "mapped", "compile: off, cuda_graph_sizes: []", _BOOL, _enforce_eager),
    VllmOption("speculative_config", "mapped",
               "speculative: method ngram (prompt_lookup_max/min -> max_ngram/min_ngram) or draft_model "
               "(model: PATH), num_speculative_tokens", {"metavar": "JSON"}, _speculative),
    VllmOption("kv_transfer_config", "mapped",
               "kv_connector (SharedStorageConnector -> shared_storage, OffloadingConnector -> host, "
               "MooncakeConnector -> mooncake; "
               "kv_connector_extra_config -> its options), kv_role, kv_load_failure_policy", {"metavar": "JSON"},
               _kv_transfer),
    VllmOption("disable_uvicorn_access_log", "mapped", "`modserve serve`: uvicorn's access log off", _BOOL),
    VllmOption("guided_decoding_backend", "mapped", "grammar_backend: NAME (auto, xgrammar, outlines)",
               {"metavar": "NAME"}, _set_name("grammar_backend")),
    VllmOption("structured_outputs_config", "mapped",
               "grammar_backend (backend: auto, xgrammar, outlines; disable_any_whitespace: the named backend's "
               "whitespace option; disable_fallback: a named backend), reasoning_parser", {"metavar": "JSON"},
               _structured_outputs),
    VllmOption("task", "mapped", "runner: pooling for embed, generate for generate", {"metavar": "TASK"}, _task),
    VllmOption("disable_frontend_multiprocessing", "mapped", "`modserve serve`: the engine steps in a thread of "
               "the server's process instead of engine-core processes of its own", _BOOL),
    VllmOption("data_parallel_rank", "mapped", "`modserve serve`: serve data-parallel rank N of "
               "--data-parallel-size alone (external load balancing: one endpoint per rank, each with its "
               "rank's seed and share of the memory)", _INT, short="-dpn"),
    # -- refused: a value other than vLLM's default is an error
    # (-pp and -dp: only while modserve has no field of that name; with one, the field's flag
    # takes the short one, and translate() gives the value to the field)
    VllmOption("pipeline_parallel_size", "refused", _NOT_BUILT.format("pipeline"), _INT, default=1, short="-pp"),
    VllmOption("data_parallel_size", "refused", _NOT_BUILT.format("data") + " (or run one server per replica)",
               _INT, default=1, short="-dp"),
    # (-dpb too: data_parallel_backend is a field, mp or ray)
    VllmOption("data_parallel_backend", "refused", "data_parallel_backend takes mp (engine-core processes) or ray "
               "(Ray actors placed on the cluster)", _TEXT, default="mp", short="-dpb"),
    VllmOption("data_parallel_size_local", "mapped", "`modserve serve`: data-parallel ranks (engine-core processes) "
               "on this machine; the others join from machines running --headless (docs/parallelism.md)", _INT,
               short="-dpl"),
    VllmOption("data_parallel_start_rank", "mapped", "`modserve serve --headless`: the first of this machine's "
               "data-parallel ranks", _INT, short="-dpr"),
    VllmOption("data_parallel_address", "mapped", "`modserve serve`: the API server's address the ranks on other "
               "machines reach it at (default: 127.0.0.1)", _TEXT, short="-dpa"),
    VllmOption("data_parallel_rpc_port", "mapped", "`modserve serve`: the port of the ranks' handshake with the API "
               "server, on a private network only (default: 29550)", _INT, short="-dpp"),
    VllmOption("headless", "mapped", "`modserve serve`: no API server, only this machine's engine cores, which "
               "join the API server at --data-parallel-address", _BOOL),
    VllmOption("api_server_count", "refused", "one API server process serves every engine core", _INT,
               default=1, short="-asc"),
    VllmOption("cpu_offload_gb", "refused", "offloading weights to host memory is not supported", _FLOAT,
               default=0),
    VllmOption("enable_sleep_mode", "refused", "sleep mode is not supported", _BOOL, default=False),
    VllmOption("hf_overrides", "refused", "edit the checkpoint's config.json instead", {"metavar": "JSON"}),
    VllmOption("limit_mm_per_prompt", "refused", "multimodal inputs are not supported", {"metavar": "JSON"}),
    VllmOption("load_format", "refused", "modserve loads safetensors checkpoints", _TEXT,
               default=("auto", "safetensors")),
    VllmOption("tokenizer_mode", "refused", "modserve uses the checkpoint's fast Hugging Face "
               "tokenizer", _TEXT, default=("auto", "hf")),
    # -- ignored, with a warning: harmless here
    VllmOption("trust_remote_code", "ignored", "modserve never runs a checkpoint's code: architectures come "
               "from model plugins", _BOOL, default=False),
    VllmOption("download_dir", "ignored", "modserve loads local directories (or the Hugging Face cache), "
               "never downloads", _TEXT),
    VllmOption("revision", "ignored", "a local checkpoint directory is one revision", _TEXT),
    VllmOption("tokenizer_revision", "ignored", "a local tokenizer directory is one revision", _TEXT),
    VllmOption("hf_token", "ignored", "modserve never downloads", _TEXT),
    VllmOption("max_seq_len_to_capture", "ignored", "modserve captures no CUDA graphs", _INT, default=8192),
    VllmOption("disable_custom_all_reduce", "ignored", "modserve's all-reduce is torch.distributed's", _BOOL,
               default=False),
    VllmOption("max_parallel_loading_workers", "ignored", "weights load in one pass", _INT),
    # (a default of two values: either is what modserve does anyway)
    VllmOption("disable_log_stats", "ignored", "modserve logs no periodic stats: they are on /metrics", _BOOL,
               default=(False, True)),
    VllmOption("disable_log_requests", "ignored", "modserve logs no request contents", _BOOL,
               default=(False, True)),
    VllmOption("enable_log_requests", "ignored", "modserve logs no request contents", _BOOL, default=False),
    VllmOption("max_log_len", "ignored", "modserve logs no request contents", _INT),
    VllmOption("uvicorn_log_level", "ignored", "uvicorn logs at --log-level", _TEXT, default="info"),
)
BY_KEY: dict[str, VllmOption] = {o.key: o for o in VLLM_OPTIONS}
# Keys a ``vllm serve`` config file holds for the server, not the engine: ``modserve serve``
# takes them as its flags (a file's value yields to the command line).
SERVER_KEYS: tuple[str, ...] = ("host", "port", "api_key", "disable_uvicorn_access_log",
                                 "disable_frontend_multiprocessing", "data_parallel_rank", "data_parallel_size_local",
                                 "data_parallel_start_rank", "data_parallel_address", "data_parallel_rpc_port",
                                 "headless")


def normalize_key(key: str) -> str:
    """vLLM's config files spell keys as flags (``max-model-len``) or fields (``max_model_len``)."""
    return str(key).replace("-", "_")


def _is_default(option: VllmOption, value: Any) -> bool:
    if isinstance(option.default, tuple):
        return value in option.default
    return value == option.default or (value in (None, False, [], {}) and option.default in (None, False))


def translate(layers: list[dict[str, Any]]) -> tuple[dict[str, Any], float | None]:
    """EngineConfig data from config layers (a file, then overrides: later wins) that may
    use vLLM's keys, and the ``gpu_memory_utilization`` asked for (resolved by
    :func:`kv_cache_gb_for_utilization` once the rest is valid).

    modserve's own keys merge first; then vLLM's mapped keys patch the result in order, so
    ``--enable-prefix-caching`` sets an option of whichever allocator the layers selected.
    Raises ValueError naming a refused option."""
    from modserve.core.config import EngineConfig

    data: dict[str, Any] = {}
    patches: list[tuple[VllmOption, Any]] = []
    for layer in layers:
        for key, value in layer.items():
            key = normalize_key(key)
            # An entry spelled as an EngineConfig field is that field (built since: -pp, -dp); only
            # its short flag is still used (modserve.cli)
            option = None if key in EngineConfig.model_fields else BY_KEY.get(key)
            if option is None:
                data[key] = value
            elif value is not None:
                patches.append((option, value))
    for key, convert in VALUES.items():
        if data.get(key) is not None:
            data[key] = convert(data[key])
    utilization = None
    for option, value in patches:
        if option.kind == "refused" and not _is_default(option, value):
            raise ValueError(f"{option.key}={value!r} is not supported: {option.maps_to}")
        if option.kind == "ignored" and not _is_default(option, value):
            logger.warning("ignoring vLLM option %s: %s", option.key, option.maps_to)
        if option.key == "gpu_memory_utilization":
            utilization = value
        elif option.apply is not None:
            option.apply(data, value)
    return data, utilization


# -- speculative_config ---------------------------------------------------------------------
_SPEC_COMMON = {"method", "model", "num_speculative_tokens", "draft_tensor_parallel_size"}
_NGRAM_KEYS = {"prompt_lookup_max": "max_ngram", "prompt_lookup_min": "min_ngram"}


def speculative_from_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``speculative_config`` as modserve's ``speculative`` block.

    ``{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}`` ->
    ``{proposer: {name: ngram, options: {max_ngram: 4}}, num_speculative_tokens: 3}``;
    ``{"model": PATH}`` (method draft_model) -> the draft_model proposer with that model.
    Another method names a proposer plugin, its other keys that plugin's options."""
    spec = {normalize_key(k): v for k, v in spec.items()}
    model = spec.get("model")
    method = spec.get("method") or ("ngram" if model in ("[ngram]", "ngram") else "draft_model" if model else None)
    if method is None:
        raise ValueError("speculative_config needs a method (ngram, draft_model) or a draft model")
    tp = spec.get("draft_tensor_parallel_size")
    if tp not in (None, 1):
        raise ValueError(f"speculative_config draft_tensor_parallel_size={tp} is not supported: the draft model "
                         "runs whole, on rank 0")
    rest = {k: v for k, v in spec.items() if k not in _SPEC_COMMON}
    options: dict[str, Any] = {}
    if method == "ngram":
        unknown = sorted(set(rest) - set(_NGRAM_KEYS))
        options = {_NGRAM_KEYS[k]: v for k, v in rest.items() if k in _NGRAM_KEYS}
    elif method == "draft_model":
        unknown = sorted(rest)
        if model is None:
            raise ValueError("speculative_config method draft_model needs model: the draft checkpoint directory")
        options = {"model": model}
    else:  # a proposer plugin: the rest are its options, its options model checks them
        unknown = []
        options = {**({"model": model} if model is not None else {}), **rest}
    if unknown:
        raise ValueError(f"speculative_config keys not supported with method {method}: {', '.join(unknown)} "
                         f"(supported: method, model, num_speculative_tokens"
                         + (", prompt_lookup_max, prompt_lookup_min" if method == "ngram" else "") + ")")
    out: dict[str, Any] = {"proposer": {"name": method, "options": options}}
    if spec.get("num_speculative_tokens") is not None:
        out["num_speculative_tokens"] = spec["num_speculative_tokens"]
    return out


# -- gpu_memory_utilization -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """What ``gpu_memory_utilization`` comes to on this device, in bytes."""

    utilization: float
    total: int  # the device's memory
    free: int  # free now, before the engine loads anything
    weights: int  # as the engine will hold them
    headroom: int  # activations of the largest step, plus RUNTIME_HEADROOM_BYTES

    @property
    def kv_cache(self) -> int:
        return int(self.utilization * self.total) - self.weights - self.headroom

    def describe(self) -> str:
        gib = 2**30
        return (f"gpu_memory_utilization {self.utilization}: KV cache {self.kv_cache / gib:.2f} GiB = "
                f"{self.utilization} x {self.total / gib:.2f} GiB total - {self.weights / gib:.2f} GiB weights - "
                f"{self.headroom / gib:.2f} GiB activations and runtime")


def device_memory(device: str) -> tuple[int, int]:
    """(total, free) bytes of a torch device: the GPU's, or on ``cpu`` the host's RAM."""
    kind = device.partition(":")[0]
    if kind == "cpu":
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                info[name] = int(rest.split()[0]) * 1024
        return info["MemTotal"], info["MemAvailable"]
    if kind == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return total, free
    raise ValueError(f"gpu_memory_utilization: the total memory of device {device!r} is unknown to modserve; "
                     "size the KV cache with kv_cache_memory_gb or num_kv_blocks")


def memory_budget(config: Any, utilization: float) -> MemoryBudget:
    """vLLM's arithmetic: the engine may use ``utilization`` of the device's total memory, and
    the KV cache gets what the weights and the activations of one step leave of it.

    modserve does not profile a step as vLLM does; the headroom is an estimate from the
    checkpoint's shape: ``max_num_batched_tokens`` x (6 x hidden + 3 x intermediate) values
    of the compute dtype, ``max_num_seqs`` x vocabulary x 12 bytes of logits and sampling,
    and RUNTIME_HEADROOM_BYTES. On the CPU an unquantized model's weights count twice (the
    packed or 16-bit decode copy the CPU platform may keep)."""
    import torch

    from modserve.runner.loader import checkpoint_dtype, load_hf_config
    from modserve.runner.quantization import planned_weight_bytes
    from modserve.core.registry import get_registry

    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    hf_config = load_hf_config(config.model)
    registry = get_registry()
    platform = registry.create("platform", config.platform_choice(), torch.device(config.device))
    level = logger.level
    logger.setLevel(logging.WARNING)  # the engine logs the dtype choice itself
    try:
        dtype = platform.resolve_dtype(config.dtype, checkpoint_dtype(hf_config))
    finally:
        logger.setLevel(level)
    quantization = config.quantization.model_dump() if config.quantization else None
    weights = planned_weight_bytes(config.model, quantization, dtype, config.device, registry)
    quantized = quantization is not None or getattr(hf_config, "quantization_config", None) is not None
    if config.device.startswith("cpu") and not quantized:
        weights *= 2
    value_bytes = torch.tensor([], dtype=dtype).element_size()
    hidden = getattr(hf_config, "hidden_size", 0)
    intermediate = getattr(hf_config, "intermediate_size", 0) or 4 * hidden
    activations = config.max_num_batched_tokens * (6 * hidden + 3 * intermediate) * value_bytes
    logits = config.max_num_seqs * getattr(hf_config, "vocab_size", 0) * 12
    total, free = device_memory(config.device)
    return MemoryBudget(utilization, total, free, weights, activations + logits + RUNTIME_HEADROOM_BYTES)


def kv_cache_gb_for_utilization(config: Any, utilization: float) -> float:
    """``kv_cache_memory_gb`` for ``gpu_memory_utilization``, checked as vLLM checks it: the
    share asked for must be free now, and must hold more than the weights and headroom."""
    budget = memory_budget(config, utilization)
    gib = 2**30
    if budget.free < utilization * budget.total:
        raise ValueError(
            f"gpu_memory_utilization {utilization}: {utilization} x {budget.total / gib:.2f} GiB = "
            f"{utilization * budget.total / gib:.2f} GiB, more than the {budget.free / gib:.2f} GiB free now "
            "(other processes use the rest); lower it, or size the KV cache with kv_cache_memory_gb")
    if budget.kv_cache <= 0:
        raise ValueError(f"gpu_memory_utilization {utilization} leaves no KV cache ({budget.describe()}); "
                         "raise it, or size the KV cache with kv_cache_memory_gb")
    logger.info("%s", budget.describe())
    return budget.kv_cache / gib


def engine_config(data: dict[str, Any], **overrides: Any) -> EngineConfig:
    """``EngineConfig.from_dict(data, **overrides)``, both of which may use vLLM's keys: a
    refused option is a ValueError naming it, ``gpu_memory_utilization`` sizes the KV cache."""
    from modserve.core.config import EngineConfig

    merged, utilization = translate([data, {k: v for k, v in overrides.items() if v is not None}])
    config = EngineConfig.from_dict(merged)
    if utilization is None:
        return config
    if config.num_kv_blocks or config.kv_cache_memory_gb:
        logger.info("gpu_memory_utilization ignored: %s sizes the KV cache",
                    "num_kv_blocks" if config.num_kv_blocks else "kv_cache_memory_gb")
    else:
        config.kv_cache_memory_gb = kv_cache_gb_for_utilization(config, utilization)
    return config
