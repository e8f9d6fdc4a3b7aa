"""Train the built-in demo model and its draft on the King James Bible, on CPU.

    .venv/bin/python scripts/train_demo_model.py            # writes modserve/server/demo_model/

Gets the corpus itself (scripts/demo_corpus.py: Debian's bible-kjv packages), holds out the
last verses, trains a byte-level BPE (modserve.testing's trainer and ChatML template), then a
Llama of a few million parameters and a 2-layer draft with the same tokenizer. It writes both
checkpoints, the held-out text, a cloze task built from it, and training.json with the figures.
Seeded and single-threaded, so that a rerun on the same versions should give the same weights
(not yet checked bit for bit: one full run takes ~22 min on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from demo_corpus import PACKAGES, VERSION, kjv_verses  # noqa: E402

from modserve.testing.checkpoints import make_tokenizer, train_tokenizer_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VOCAB = 4096
SEQ = 256  # training window; the config allows longer prompts, which RoPE extrapolates poorly
HELDOUT_FRACTION = 0.03  # the last 3% of verses: most of Jude-Revelation's end, never trained on
CHAT_FRACTION = 0.1  # verses wrapped as a ChatML turn, so chat replies learn to end with <|im_end|>
SHAPES: dict[str, dict[str, Any]] = {
    "main": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=768),
    "draft": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=384),
}


def llama_config(name: str, tokenizer: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPES[name], vocab_size=VOCAB, max_position_embeddings=1024, tie_word_embeddings=False,
                       bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def token_stream(tokenizer: Any, verses: list[str], seed: int) -> torch.Tensor:
    """The training verses as one id stream, one verse a line, some as a chat turn."""
    rng = random.Random(seed)
    texts = []
    for v in verses:
        words = v.split(" ")
        if rng.random() < CHAT_FRACTION and len(words) > 4:
            cut = len(words) // 2  # the user gives a verse's first half, the assistant the rest
            texts.append(f"<|im_start|>user\n{' '.join(words[:cut])}<|im_end|>\n"
                         f"<|im_start|>assistant\n{' '.join(words[cut:])}<|im_end|>\n")
        else:
            texts.append(v + "\n")
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return torch.tensor([t for seq in ids for t in seq], dtype=torch.long)


@torch.no_grad()
def heldout_perplexity(model: Any, ids: torch.Tensor) -> float:
    """exp(mean NLL) over non-overlapping SEQ-token windows of the held-out stream."""
    model.eval()
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, SEQ):
        window = ids[start:start + SEQ + 1][None]  # [1, <= SEQ + 1]
        logits = model(window[:, :-1]).logits.float()
        nll += torch.nn.functional.cross_entropy(logits[0], window[0, 1:], reduction="sum").item()
        count += window.shape[1] - 1
    model.train()
    return math.exp(nll / count)


def train(name: str, model: Any, stream: torch.Tensor, steps: int, batch: int, lr: float, seed: int) -> float:
    """AdamW with warmup and cosine decay on random SEQ-token windows; the last 50 steps' mean loss."""
    gen = torch.Generator().manual_seed(seed)
    decay = [p for p in model.parameters() if p.ndim >= 2]  # no weight decay on norms
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warmup, 0.5 * (
        1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, steps - warmup)))) * 0.9 + 0.1))
    model.train()
    t0, losses = time.monotonic(), []
    for step in range(1, steps + 1):
        starts = torch.randint(0, len(stream) - SEQ - 1, (batch,), generator=gen)
        chunk = torch.stack([stream[s:s + SEQ + 1] for s in starts.tolist()])  # [B, SEQ + 1]
        logits = model(chunk[:, :-1]).logits  # [B, SEQ, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps:
            elapsed = time.monotonic() - t0
            print(f"[{name}] step {step}/{steps} loss {sum(losses[-50:]) / len(losses[-50:]):.3f} "
                  f"lr {sched.get_last_lr()[0]:.2e} {step * batch * SEQ / elapsed:.0f} tok/s "
                  f"elapsed {elapsed:.0f}s", flush=True)
    return sum(losses[-50:]) / len(losses[-50:])


def cloze_task(verses: list[str], count: int, seed: int) -> list[dict[str, Any]]:
    """Multiple choice: a held-out verse (after the verse before it) without its last word;
    the choices are that word and the last words of three other held-out verses."""
    rng = random.Random(seed)

    def last_word(v: str) -> str:
        return v.split(" ")[-1].strip(".,;:?!'()")

    pool = sorted({w for v in verses if (w := last_word(v))})
    examples = []
    for i in sorted(rng.sample(range(1, len(verses)), count)):
        answer = last_word(verses[i])
        head = verses[i][:verses[i].rindex(answer)].rstrip()
        if not answer or not head:
            continue
        choices = [answer, *rng.sample([w for w in pool if w.lower() != answer.lower()], 3)]
        rng.shuffle(choices)
        examples.append({"context": f"{verses[i - 1]}\n{head}", "choices": [" " + c for c in choices],
                         "answer": choices.index(answer)})
    return examples


def save(model: Any, tokenizer: Any, out: Path) -> int:
    from transformers import GenerationConfig

    model.to(torch.bfloat16)  # half the bytes of float32; the engine loads it in either dtype
    model.generation_config = GenerationConfig(bos_token_id=model.config.bos_token_id,
                                               eos_token_id=model.config.eos_token_id,
                                               pad_token_id=model.config.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; an installed package must be readable by all
    return sum(f.stat().st_size for f in out.iterdir())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "modserve/server/demo_model")
    ap.add_argument("--cache", type=Path, default=None, help="where the .deb files go (default: user cache)")
    ap.add_argument("--main-steps", type=int, default=600)
    ap.add_argument("--draft-steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)  # 2 shared cores; one thread also keeps the run reproducible
    from transformers import LlamaForCausalLM
    import platformdirs

    t_start = time.monotonic()
    cache = args.cache or Path(platformdirs.user_cache_dir("modserve")) / "kjv"
    verses = kjv_verses(cache)
    split = int(len(verses) * (1 - HELDOUT_FRACTION))
    train_verses, heldout = verses[:split], verses[split:]
    tokenizer = make_tokenizer(VOCAB, tokenizer_json=train_tokenizer_json(train_verses, VOCAB))
    stream = token_stream(tokenizer, train_verses, args.seed)
    heldout_ids = torch.tensor(tokenizer("\n".join(heldout) + "\n", add_special_tokens=False)["input_ids"])
    print(f"corpus: {len(verses)} verses, {len(train_verses)} for training ({len(stream)} tokens), "
          f"{len(heldout)} held out ({len(heldout_ids)} tokens)", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"corpus": {"packages": list(PACKAGES), "version": VERSION,
                                         "train_tokens": len(stream), "heldout_tokens": len(heldout_ids)}}
    for name, steps, lr in (("main", args.main_steps, 2e-3), ("draft", args.draft_steps, 3e-3)):
        torch.manual_seed(args.seed)
        model = LlamaForCausalLM(llama_config(name, tokenizer))
        params = sum(p.numel() for p in model.parameters())
        random_ppl = heldout_perplexity(model, heldout_ids)
        t0 = time.monotonic()
        loss = train(name, model, stream, steps, args.batch, lr, args.seed)
        wall = time.monotonic() - t0
        ppl = heldout_perplexity(model, heldout_ids)
        size = save(model, tokenizer, args.out / name)
        report[name] = {"parameters": params, "steps": steps, "batch": args.batch, "seq": SEQ,
                        "train_seconds": round(wall), "final_train_loss": round(loss, 3),
                        "heldout_perplexity": round(ppl, 2), "random_heldout_perplexity": round(random_ppl, 1),
                        "bytes": size}
        print(f"[{name}] {params / 1e6:.2f}M parameters, {wall / 60:.1f} min, final train loss {loss:.3f}, "
              f"held-out perplexity {ppl:.2f} (random weights: {random_ppl:.1f}), {size / 1e6:.1f} MB", flush=True)

    (args.out / "heldout.txt").write_text("\n".join(heldout) + "\n")
    task = cloze_task(heldout, 150, args.seed)
    (args.out / "heldout_cloze.jsonl").write_text("".join(json.dumps(e) + "\n" for e in task))
    report["task_examples"] = len(task)
    report["total_seconds"] = round(time.monotonic() - t_start)
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
