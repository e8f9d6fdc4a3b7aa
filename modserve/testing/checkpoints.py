"""Deterministic random-weight Hugging Face checkpoints of real architectures.

Tests, benchmarks and the demo model need real checkpoints (config, safetensors,
tokenizer, chat template) but no network. Everything here is built locally: a
byte-level BPE tokenizer trained on a generated corpus, and a transformers model
whose weights are redrawn from per-parameter seeds.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from modserve.quantizers.calibration.formats import (  # noqa: F401  (pack_int32 and the grids: tests use them)
    AWQ_PACK_ORDER, QUANTIZED_LINEARS, awq_quantize, awq_tensors, gptq_quantize, gptq_tensors, pack_int32,
    quantization_config,
)
from modserve.quantizers.calibration.rtn import round_to_nearest_checkpoint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, vocab_size=4096),
    # ~88M parameters as a Llama: big enough for meaningful benchmarks on CPU/GPU.
    "small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=4, intermediate_size=2048, vocab_size=8192),
    # Llama-3.2-1B's layer shapes with a vocabulary of 8,192: ~1.0B parameters, 2 GB in bf16,
    # larger than any CPU's last-level cache, so decode streams from memory; for benchmarks.
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, intermediate_size=8192, vocab_size=8192),
}
# Per (arch, preset): what the preset alone doesn't give an architecture, applied over it.
# The MoE ones: several layers so both layer kinds appear (qwen2_moe every 2nd layer sparse,
# qwen3_moe all but mlp_only_layers), expert counts not divisible by 3, renormalized top-k
# in mixtral and qwen3_moe but not in qwen2_moe.
ARCH_PRESETS: dict[tuple[str, str], dict[str, Any]] = {
    ("qwen3", "tiny"): dict(num_hidden_layers=3, head_dim=32),  # 4 x 32 query dims over hidden 64
    ("mixtral", "tiny"): dict(num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=2,
                              intermediate_size=48),
    # Mixtral-8x7B's shape at 1/8 of its width and 1/8 of its depth (8 experts of 1792, top 2,
    # 4:1 GQA): ~95M parameters, ~29M active per token; for benchmarks, not the unit tests.
    ("mixtral", "small"): dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                               intermediate_size=1792, num_local_experts=8, num_experts_per_tok=2),
    ("qwen2_moe", "tiny"): dict(num_hidden_layers=4, num_experts=10, num_experts_per_tok=3,
                                moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                decoder_sparse_step=2, norm_topk_prob=False),
    ("qwen3_moe", "tiny"): dict(num_hidden_layers=4, head_dim=24, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[0],
                                norm_topk_prob=True),
}
QWEN2_TOKENIZER_ARCHS = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")  # transformers 5 gives these Qwen2Tokenizer
ROUTER_STD = 0.2  # routers drawn wider than the rest: clear top-k choices, no near-ties
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
CHATML_TEMPLATE = (  # raw: the saved template keeps jinja's own '\n' escapes
    r"{% for message in messages %}"
    r"{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_FORMAT_VERSION = 1  # bump whenever the output of make_checkpoint changes
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_WORDS = """the a an of to and in is it that for on with as was by at be this from or
have not are but had they his her she he we you one all were there their what so up out
if about who get which go me when make can like time no just him know take people into
year your good some could them see other than then now look only come its over think also
back after use two how our work first well way even new want because any these give day
most us model token cache batch queue layer server request stream memory block page kernel
river window garden mountain letter music silver engine signal market quiet yellow simple
bright winter summer morning evening ocean forest stone paper bread table chair light
""".split()
_ACCENTED = ("café naïve über façade jalapeño smörgåsbord crème brûlée São Ångström résumé "
             "piñata Zürich fiancée déjà señor Málaga Kraków Dvořák Øresund garçon").split()
_GREEK = "αβγδεζηθικλμνξοπρστυφχψω"
_CYRILLIC = "абвгдежзийклмнопрстуфхцчшщыэюя"
_CJK = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年日本語学生東京"
_EMOJI = "😀🚀🔥✨🎉👍🌍🍕🐍💡"


def _corpus(seed: int = 0, size: int = 300_000) -> str:
    """Seeded English-like prose, JSON, code, numbers and non-ASCII text.

    Syllable-built pseudo-words give BPE enough distinct pairs to fill thousands
    of merges; CJK/emoji runs make some tokens end mid-way through a UTF-8 char.
    """
    rng = random.Random(seed)
    syl = [o + v + c for o in ("", "b", "d", "k", "l", "m", "n", "p", "r", "s", "t", "v",
                               "st", "tr", "pl")
           for v in ("a", "e", "i", "o", "u", "ai", "ou") for c in ("", "n", "r", "s", "l")]
    lexicon = _WORDS + _ACCENTED + ["".join(rng.choices(syl, k=rng.randint(1, 3)))
                                    for _ in range(4000)]
    cum, acc = [], 0.0
    for i in range(len(lexicon)):  # Zipf-like frequencies, cumulated once for speed
        acc += 1.0 / (i + 1)
        cum.append(acc)

    def words(n: int) -> list[str]:
        return rng.choices(lexicon, cum_weights=cum, k=n)

    def run(alphabet: str, lo: int, hi: int) -> str:
        return "".join(rng.choices(alphabet, k=rng.randint(lo, hi)))

    def snippet() -> str:
        kind = rng.random()
        if kind < 0.5:
            s = " ".join(words(rng.randint(5, 16)))
            return s[0].upper() + s[1:] + rng.choice(".?!.")
        if kind < 0.6:
            obj = {w: rng.choice([rng.randint(-999, 99999), round(rng.uniform(0, 100), 3),
                                  " ".join(words(2)), True, None]) for w in words(3)}
            return json.dumps(obj, ensure_ascii=False)
        if kind < 0.72:
            a, b, c = words(3)
            return rng.choice([f"def {a}_{b}({c}, n={rng.randint(0, 64)}):",
                               f"    return {a}[{rng.randint(0, 9)}] + {c} * {b}",
                               f"for {a} in range({rng.randint(1, 512)}):",
                               f"{a}.{b} = {{'{c}': {rng.random():.4f}}}",
                               f"if {a} is None and {b} != {c}: raise ValueError('{c}')"])
        if kind < 0.8:
            return rng.choice([f"{rng.randint(1900, 2099)}-{rng.randint(1, 12):02d}-"
                               f"{rng.randint(1, 28):02d}", f"{rng.uniform(-1e4, 1e4):.2f}",
                               str(rng.randint(0, 10**9)), f"0x{rng.getrandbits(32):08x}"])
        return rng.choice([run(_GREEK, 3, 9), run(_CYRILLIC, 3, 9), run(_CJK, 2, 12),
                           run(_EMOJI, 1, 3), " ".join(rng.choices(_ACCENTED, k=3))])

    parts: list[str] = []
    total = 0
    while total < size:
        parts.append(snippet())
        total += len(parts[-1]) + 1
    return "\n".join(parts)


# transformers 5 loads any model_type="qwen2" checkpoint with Qwen2Tokenizer, which
# rebuilds the pipeline from vocab + merges with NFC and this split regex (digits one by
# one); training qwen2 tokenizers the same way keeps tokenizer.json and HF in agreement.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@functools.lru_cache(maxsize=8)
def _tokenizer_json(vocab_size: int, qwen2_style: bool) -> str:
    # Cached as JSON so each caller gets a fresh, independently mutable tokenizer.
    return train_tokenizer_json(_corpus().split("\n"), vocab_size, qwen2_style)


def train_tokenizer_json(texts: Iterable[str], vocab_size: int, qwen2_style: bool = False) -> str:
    """A byte-level BPE with SPECIAL_TOKENS first, trained on ``texts``; as tokenizer.json text."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if qwen2_style:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok.to_str()


def make_tokenizer(vocab_size: int, arch: str = "llama", tokenizer_json: str | None = None
                   ) -> PreTrainedTokenizerFast:
    """A fast ChatML tokenizer (eos <|im_end|>, pad <|endoftext|>, no BOS); ``arch``
    only matters for qwen2, whose pre-tokenizer transformers imposes (see above).
    ``tokenizer_json`` (from train_tokenizer_json) replaces the generated corpus's BPE."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer_json = tokenizer_json or _tokenizer_json(vocab_size, arch in QWEN2_TOKENIZER_ARCHS)
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json),
        eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=[SPECIAL_TOKENS[1]], chat_template=CHATML_TEMPLATE,
        model_max_length=2048, clean_up_tokenization_spaces=False)


def _seed_for(*parts: object) -> int:
    # Per-parameter seeds: weights don't depend on transformers' init order or RNG use,
    # overriding e.g. num_hidden_layers leaves shared layers unchanged, and llama and
    # mistral (same parameter names) still get different weights.
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


def make_checkpoint(out_dir: str | os.PathLike, arch: str = "llama", preset: str = "tiny",
                    dtype: str = "float32", seed: int = 0, **config_overrides: Any) -> Path:
    """Write a random-weight checkpoint (config, safetensors, tokenizer) to out_dir."""
    import transformers as tf

    for value, known in ((arch, ARCHITECTURES), (preset, PRESETS), (dtype, _DTYPES)):
        if value not in known:
            raise ValueError(f"unknown {value!r}; expected one of {tuple(known)}")
    out = Path(out_dir)
    cfg: dict[str, Any] = {**PRESETS[preset], **ARCH_PRESETS.get((arch, preset), {}), **config_overrides}
    tokenizer = make_tokenizer(cfg["vocab_size"], arch)
    ids = {"bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),  # as Qwen2 does
           "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    per_arch = {"llama": (tf.LlamaConfig, dict(tie_word_embeddings=False)),
                "mistral": (tf.MistralConfig, dict(tie_word_embeddings=False, sliding_window=None)),
                "qwen2": (tf.Qwen2Config, dict(tie_word_embeddings=True)),
                "qwen3": (tf.Qwen3Config, dict(tie_word_embeddings=True)),
                "mixtral": (tf.MixtralConfig, dict(tie_word_embeddings=False, sliding_window=None)),
                "qwen2_moe": (tf.Qwen2MoeConfig, dict(tie_word_embeddings=False)),
                "qwen3_moe": (tf.Qwen3MoeConfig, dict(tie_word_embeddings=False))}
    config_cls, arch_kwargs = per_arch[arch]
    config = config_cls(**{"max_position_embeddings": 2048, **arch_kwargs, **ids, **cfg})

    torch.manual_seed(seed)  # the default init; every parameter is redrawn below anyway
    model = tf.AutoModelForCausalLM.from_config(config)  # float32: draws are cast at the end
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied lm_head is listed once
            gen = torch.Generator().manual_seed(_seed_for(arch, seed, name))
            # 2-D and biases: N(0, 0.05), larger than default init so logits aren't flat;
            # norm weights: around 1 so a mis-loaded norm is detectable.
            is_norm = p.ndim == 1 and not name.endswith(".bias")
            std = ROUTER_STD if name.endswith(".mlp.gate.weight") else 0.05  # a MoE layer's router
            p.normal_(1.0 if is_norm else 0.0, std, generator=gen)
            if name == "model.norm.weight" and config.tie_word_embeddings:
                # Tied random models logit-boost the input token (its embedding sits in the
                # residual stream), so greedy decoding repeats one token forever; random
                # signs on the final norm cancel that bias.
                p.mul_(torch.randint(0, 2, p.shape, generator=gen) * 2 - 1)
    model.to(_DTYPES[dtype])
    model.generation_config = tf.GenerationConfig(**ids)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def default_cache_dir() -> Path:
    if env := os.environ.get("MODSERVE_TEST_CACHE"):
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("modserve")) / "checkpoints"


def cached_checkpoint(arch: str = "llama", preset: str = "tiny", dtype: str = "float32",
                      seed: int = 0, cache_dir: str | os.PathLike | None = None,
                      **overrides: Any) -> Path:
    """make_checkpoint once per distinct arguments; safe across parallel processes."""
    key = dict(arch=arch, preset=preset, dtype=dtype, seed=seed, overrides=overrides)
    return _cached(f"{arch}-{preset}-{dtype}-s{seed}", key, cache_dir,
                   lambda out: make_checkpoint(out, arch, preset, dtype, seed, **overrides))


def _cached(prefix: str, key: dict[str, Any], cache_dir: str | os.PathLike | None, make: Any) -> Path:
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    # transformers' major version is in the key: v5 writes tokenizer files v4 can't read.
    tf_major = importlib.metadata.version("transformers").split(".")[0]
    text = json.dumps(dict(v=_FORMAT_VERSION, transformers=tf_major, **key), sort_keys=True, default=str)
    final = root / f"{prefix}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    if final.is_dir():  # only ever created by an atomic rename, so it is complete
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    try:
        make(tmp)
        (tmp / "modserve_key.json").write_text(text)
        tmp.chmod(0o755)  # mkdtemp makes it private; a shared cache should stay readable
        os.rename(tmp, final)  # fails if another process won the race: theirs is as good
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# -- pre-quantized checkpoints (AWQ, GPTQ) ----------------------------------------------
# Round-to-nearest quantization of a float checkpoint's linear layers, in the formats of
# modserve.quantizers.calibration.formats (`modserve quantize --rtn` writes the same).
def act_order_g_idx(k: int, group_size: int, seed: object) -> torch.Tensor:
    """A desc_act g_idx: channels taken in a seeded order, ``group_size`` at a time."""
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(_seed_for(seed)))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = torch.arange(k, dtype=torch.int32) // group_size
    return g_idx


def make_quantized_checkpoint(src: str | os.PathLike, out_dir: str | os.PathLike, method: str,
                              bits: int = 4, group_size: int = 32, desc_act: bool = False,
                              checkpoint_format: str = "gptq") -> Path:
    """Copy float checkpoint ``src`` with every decoder linear quantized to nearest (``method``:
    awq or gptq); ``desc_act`` takes each layer's channels in a seeded order."""
    def g_idx_of(module: str, kind: str, k: int) -> torch.Tensor:
        # Layers that read the same input (q/k/v, gate/up) share GPTQ's column order.
        reads = "attn" if kind in ("q_proj", "k_proj", "v_proj") else "mlp" if kind != "o_proj" else kind
        return act_order_g_idx(k, group_size, (module.rpartition(".")[0].rpartition(".")[0], reads, k))

    return round_to_nearest_checkpoint(src, out_dir, method, bits, group_size, desc_act, checkpoint_format,
                                       g_idx_of if desc_act else None)


def cached_quantized_checkpoint(method: str, arch: str = "llama", preset: str = "tiny",
                                cache_dir: str | os.PathLike | None = None, **quant: Any) -> Path:
    """make_quantized_checkpoint of cached_checkpoint(arch, preset), once per arguments."""
    src = cached_checkpoint(arch, preset, cache_dir=cache_dir)
    key = dict(source=src.name, method=method, quant=quant)
    return _cached(f"{arch}-{preset}-{method}", key, cache_dir,
                   lambda out: make_quantized_checkpoint(src, out, method, **quant))
