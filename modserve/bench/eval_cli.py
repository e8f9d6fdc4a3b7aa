"""``modserve eval perplexity`` and ``modserve eval task``: quality through the engine
(an offline ``LLM`` from the engine flags) or a running server (``--base-url``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable


def add_parsers(sub: Any) -> None:
    from modserve.cli import add_config_flags

    ev = sub.add_parser("eval", help="quality: rolling-window perplexity, loglikelihood tasks (lm-eval's scoring)")
    kinds = ev.add_subparsers(dest="eval_command", required=True)

    p = kinds.add_parser("perplexity", help="token-level perplexity of a text file, rolling windows")
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text, scored as one document")
    p.add_argument("--max-length", type=int, default=None,
                   help="tokens per window, the model's input (default: 1024, at most the engine's max_model_len - 1)")
    p.add_argument("--stride", type=int, default=None,
                   help="how far each window moves; later windows keep max_length - stride tokens of context "
                        "(default: max_length / 2)")
    _add_common(p, add_config_flags)
    p.set_defaults(func=cmd_perplexity)

    p = kinds.add_parser("task", help="a JSONL task: multiple choice (acc, acc_norm) or cloze (acc, loglikelihood)")
    p.add_argument("file", metavar="FILE", help='lines {"context", "choices", "answer"} or {"context", "continuation"}')
    _add_common(p, add_config_flags)
    p.set_defaults(func=cmd_task)


def _add_common(p: argparse.ArgumentParser, add_config_flags: Any) -> None:
    p.add_argument("--base-url", help="score against this running server (e.g. http://127.0.0.1:8000) instead of "
                                      "an engine built here; --served-model-name names the model, --tokenizer or "
                                      "--model (a checkpoint directory) gives the tokenizer")
    p.add_argument("--batch-size", type=int, default=32, help="prompts per generate call or request")
    p.add_argument("--output-json", metavar="PATH", help="write the figures here")
    add_config_flags(p)


def scorer_and_tokenizer(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """(score_fn, the HF tokenizer, a one-line description) from the flags."""
    from modserve.bench.evaluate import OfflineScorer, ServerScorer

    if args.base_url:
        from transformers import AutoTokenizer

        path = args.cfg_tokenizer or args.cfg_model
        names = args.cfg_served_model_name or ([args.cfg_model] if args.cfg_model else None)
        if not path or not names:
            raise SystemExit("eval --base-url: give --served-model-name (the model to request) and --tokenizer "
                             "or --model (the checkpoint directory, for its tokenizer)")
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return ServerScorer(args.base_url, names[0], args.batch_size), tokenizer, f"server {args.base_url}, {names[0]}"
    from modserve import LLM
    from modserve.cli import config_from_args

    llm = LLM(config=config_from_args(args), progress=False)
    dtype = str(llm.dtype).removeprefix("torch.")
    return OfflineScorer(llm, args.batch_size), llm.get_tokenizer(), f"offline {llm.config.model} ({dtype})"


def cmd_perplexity(args: argparse.Namespace) -> int:
    from modserve.bench.evaluate import OfflineScorer, text_perplexity

    score_fn, tokenizer, where = scorer_and_tokenizer(args)
    max_length = args.max_length or 1024
    if args.max_length is None and isinstance(score_fn, OfflineScorer):  # a prompt leaves room for one token
        max_length = min(max_length, score_fn.llm.limits.max_model_len - 1)
    text = Path(args.text).read_text()
    result = _scored(lambda: text_perplexity(score_fn, tokenizer, text, max_length, args.stride))
    if result is None:
        return 2
    print(f"perplexity of {args.text} through {where}")
    print(f"windows of {result['max_length']} tokens, stride {result['stride']}, prefix token "
          f"{result['prefix_token']}")
    print(_table({"tokens": result["tokens"], "windows": result["windows"], "nll": f"{result['nll']:.4f}",
                  "perplexity": f"{result['perplexity']:.4f}"}))
    _write_json(args.output_json, {"text": args.text, **result})
    return 0


def cmd_task(args: argparse.Namespace) -> int:
    from modserve.bench.evaluate import TaskFileError, load_task, plain_encoder, score_task

    try:
        examples = load_task(args.file)
    except TaskFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    score_fn, tokenizer, where = scorer_and_tokenizer(args)
    result = _scored(lambda: score_task(score_fn, plain_encoder(tokenizer), examples))
    if result is None:
        return 2
    print(f"task {args.file} ({result['kind']}, {result['examples']} examples) through {where}")
    print(_table({k: f"{v:.4f}" for k, v in result.items() if k in ("acc", "acc_norm", "mean_loglikelihood")}))
    _write_json(args.output_json, {"task": args.file, **result})
    return 0


def _scored(run: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
    """``run()``, or None after printing why the engine or the server refused it (a window
    or prompt longer than max_model_len allows, say)."""
    import openai

    try:
        return run()
    except (ValueError, openai.APIError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def _table(row: dict[str, Any]) -> str:
    head = "| " + " | ".join(row) + " |"
    return "\n".join([head, "|" + "---|" * len(row), "| " + " | ".join(map(str, row.values())) + " |"])


def _write_json(path: str | None, data: Any) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2))
        print(f"wrote {path}")
