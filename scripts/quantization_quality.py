"""What quantization costs in quality on the trained demo model: perplexity, task accuracy,
greedy agreement with float32, and speed, per method, through the engine.

    .venv/bin/python scripts/quantization_quality.py [--work DIR] [--out docs/figures/quantization-quality.png]

Methods: float32 (the reference), bfloat16, int8 and fp8 (quantized at load), AWQ and GPTQ
checkpoints written by ``modserve quantize`` both round-to-nearest (``--rtn``) and calibrated
on training text of the demo corpus (AWQ's scale and clip search; GPTQ's Hessian rounding),
an fp8 KV cache, and a bfloat16 copy of the checkpoint at ``dtype auto`` through each CPU route
(bf16_gemm: bf16 GEMMs over bf16 weights, float32 elsewhere; few_rows: float32 products).
``--only NAME ...`` runs some of them (float32 always). Quality: held-out perplexity (the demo model's heldout.txt, windows of
256, the training length, stride 128) and its held-out multiple-choice task (150 examples, acc). Greedy agreement:
32 held-out verse openings, 32 greedy tokens each; a request agrees when all its tokens equal
float32's. Speed: single-stream greedy decode of 128 tokens, median of ``--repeats``, the
methods interleaved. Prints a markdown table and writes a JSON of the figures and a plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))
from demo_corpus import kjv_verses  # noqa: E402
from train_demo_model import HELDOUT_FRACTION  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "modserve" / "server" / "demo_model"


def calibration_text(path: Path, cache: Path, verses_per_line: int = 8) -> Path:
    """Training verses only (never the held-out split), every 7th run of verses, as plain text."""
    if not path.exists():
        verses = kjv_verses(cache)
        train = verses[: int(len(verses) * (1 - HELDOUT_FRACTION))]
        runs = [train[i: i + verses_per_line] for i in range(0, len(train), verses_per_line)][::7]
        path.write_text("".join("\n".join(run) + "\n" for run in runs))
    return path


def bf16_copy(work: Path) -> Path:
    """The demo checkpoint with its weights stored in bfloat16 (tokenizer files alongside)."""
    out = work / "bf16"
    if not (out / "config.json").exists():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        AutoModelForCausalLM.from_pretrained(DEMO / "main", dtype=torch.bfloat16).save_pretrained(out)
        AutoTokenizer.from_pretrained(DEMO / "main").save_pretrained(out)
    return out


def quantized(work: Path, name: str, flags: list[str]) -> Path:
    out = work / name
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, "-m", "modserve", "quantize", "--model", str(DEMO / "main"),
                        "--out", str(out), *flags], check=True)
    return out


def methods(work: Path, text: Path) -> dict[str, tuple[Callable[[], Path], dict[str, Any]]]:
    """Each method: (what makes its checkpoint, only called for the methods run; engine settings)."""
    main = DEMO / "main"
    cal = ["--calibration-text", str(text), "--group-size", "128"]
    return {
        "float32": (lambda: main, {}),
        "bfloat16": (lambda: main, {"dtype": "bfloat16"}),
        "int8 (per channel)": (lambda: main, {"quantization": "int8"}),
        "int8 (per channel), float32 activations": (
            lambda: main, {"quantization": {"name": "int8", "options": {"activations": "float32"}}}),
        "int8 W8A8 (per channel, activations per token)": (
            lambda: main, {"quantization": {"name": "int8", "options": {"activations": "int8"}}}),
        "fp8 e4m3 (per channel)": (lambda: main, {"quantization": "fp8"}),
        "awq 4-bit g128, round to nearest": (lambda: quantized(work, "awq-rtn", ["--method", "awq", "--rtn", *cal]),
                                             {}),
        "awq 4-bit g128, calibrated": (lambda: quantized(work, "awq", ["--method", "awq", *cal]), {}),
        "gptq 4-bit g128, round to nearest": (lambda: quantized(work, "gptq-rtn", ["--method", "gptq", "--rtn",
                                                                                     *cal]), {}),
        "gptq 4-bit g128, calibrated": (lambda: quantized(work, "gptq", ["--method", "gptq", *cal]), {}),
        "gptq 4-bit g128 act-order, calibrated": (lambda: quantized(work, "gptq-act", ["--method", "gptq",
                                                                                         "--desc-act", *cal]), {}),
        "gptq 8-bit g128, calibrated": (lambda: quantized(work, "gptq8", ["--method", "gptq", "--bits", "8", *cal]),
                                        {}),
        "float32 + fp8 KV cache": (lambda: main, {"kv_cache_dtype": "fp8_e4m3"}),
        "bf16 checkpoint, auto, bf16_gemm route": (lambda: bf16_copy(work),
                                                   {"dtype": "auto", "platform": _route("on")}),
        "bf16 checkpoint, auto, few_rows route": (lambda: bf16_copy(work),
                                                  {"dtype": "auto", "platform": _route("off")}),
    }


def _route(setting: str) -> dict[str, Any]:
    return {"name": "cpu", "options": {"bf16_gemm": setting}}


def quality(llm: Any, heldout: str, task: list[Any]) -> dict[str, float]:
    from modserve.bench.evaluate import OfflineScorer, plain_encoder, score_task, text_perplexity

    score, tok = OfflineScorer(llm), llm.get_tokenizer()
    ppl = text_perplexity(score, tok, heldout, max_length=256, stride=128)  # the training window
    acc = score_task(score, plain_encoder(tok), task)
    return {"perplexity": ppl["perplexity"], "acc": acc["acc"], "acc_norm": acc["acc_norm"]}


def greedy(llm: Any, prompts: list[str], tokens: int) -> list[tuple[int, ...]]:
    from modserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return [tuple(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def decode_rate(llm: Any, prompt: str) -> float:
    from modserve import SamplingParams

    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)[0]
    t = out.metrics.token_times
    return (len(t) - 1) / (t[-1] - t[0])


def plot(path: Path, rows: dict[str, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from modserve.bench.report import hardware_line

    names = list(rows)
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.5), sharey=True)
    ppl = rows["float32"]["perplexity"]
    panels = (("held-out perplexity, % above float32 (lower is better)",
               [100 * (rows[n]["perplexity"] / ppl - 1) for n in names], 0.0),
              ("held-out task accuracy", [rows[n]["acc"] for n in names], rows["float32"]["acc"]),
              ("greedy agreement with float32", [rows[n]["agreement"] for n in names], 1.0))
    for ax, (label, values, reference) in zip(axes, panels):
        ax.barh(names, values, color="tab:blue")
        ax.axvline(reference, color="black", lw=0.8, ls="--")
        ax.set(title=label)
    axes[0].invert_yaxis()
    fig.suptitle(f"Quantization quality: demo model (5.2M-parameter Llama, KJV) · {hardware_line()}",
                 fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/modserve-quantization-quality"))
    ap.add_argument("--cache", type=Path, default=None, help="the corpus cache (default: the user cache's kjv)")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "figures" / "quantization-quality.png")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", nargs="+", default=None, metavar="NAME", help="these methods (and float32) only")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import platformdirs

    from modserve import LLM
    from modserve.bench.evaluate import load_task

    a.work.mkdir(parents=True, exist_ok=True)
    text = calibration_text(a.work / "calibration.txt",
                            a.cache or Path(platformdirs.user_cache_dir("modserve")) / "kjv")
    heldout = (DEMO / "heldout.txt").read_text()
    task = load_task(DEMO / "heldout_cloze.jsonl")
    lines = heldout.splitlines()
    openings = [" ".join(line.split()[:6]) for line in lines[:: len(lines) // 32][:32]]
    engines = {}
    for name, (model, kwargs) in methods(a.work, text).items():
        if a.only and name != "float32" and name not in a.only:
            continue
        engines[name] = LLM(str(model()), **{"dtype": "float32", **kwargs}, num_kv_blocks=512, max_model_len=512,
                            progress=False)
    rows: dict[str, dict[str, Any]] = {}
    reference = greedy(engines["float32"], openings, 32)
    for name, llm in engines.items():
        t0 = time.monotonic()
        rows[name] = quality(llm, heldout, task)
        outs = greedy(llm, openings, 32)
        rows[name]["agreement"] = sum(o == r for o, r in zip(outs, reference)) / len(reference)
        rows[name]["weight_bytes"] = llm.engine.stats()["weight_bytes"]
        print(f"{name}: {rows[name]} ({time.monotonic() - t0:.0f} s)", flush=True)
    rates: dict[str, list[float]] = {n: [] for n in engines}
    for _ in range(a.repeats):
        for name, llm in engines.items():  # interleaved: drift of the shared machine hits all alike
            rates[name].append(decode_rate(llm, openings[0]))
    base = rows["float32"]
    print("\n| method | weights | perplexity | vs float32 | task acc | acc_norm | greedy agreement "
          "| decode tok/s | vs float32 |\n|---|---|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        row["decode_tok_s"] = statistics.median(rates[name])
        row["decode_tok_s_range"] = (min(rates[name]), max(rates[name]))
        print(f"| {name} | {row['weight_bytes'] / 2**20:.2f} MiB | {row['perplexity']:.2f} | "
              f"{row['perplexity'] / base['perplexity']:.3f}x | {row['acc']:.3f} | {row['acc_norm']:.3f} | "
              f"{row['agreement']:.0%} | {row['decode_tok_s']:.0f} [{min(rates[name]):.0f}-{max(rates[name]):.0f}] | "
              f"{row['decode_tok_s'] / statistics.median(rates['float32']):.2f}x |")
    (a.work / "quality.json").write_text(json.dumps(rows, indent=2))
    plot(a.out, rows)
    print(f"\nwrote {a.work / 'quality.json'} and {a.out}")


if __name__ == "__main__":
    main()
