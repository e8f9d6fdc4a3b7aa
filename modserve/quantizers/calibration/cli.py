"""``modserve quantize``: calibrated AWQ / GPTQ checkpoints from a float one (imports nothing heavy)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("quantize", help="write an AWQ or GPTQ checkpoint of a float one, calibrated on text",
                       description="Quantize every decoder linear of a float Llama-style checkpoint to 4 (or, GPTQ, "
                                   "8) bits, calibrated on a text file: AWQ's activation-aware scale and clip "
                                   "search, or GPTQ's Hessian-based rounding. The output loads with the awq / "
                                   "gptq quantizers (its config.json names the method).")
    p.add_argument("--model", required=True, help="the float checkpoint directory")
    p.add_argument("--out", required=True, help="the directory to write")
    p.add_argument("--method", choices=["awq", "gptq"], required=True)
    p.add_argument("--bits", type=int, default=4, help="4 (awq, gptq) or 8 (gptq)")
    p.add_argument("--group-size", type=int, default=128, help="input channels per scale (-1: one group, gptq)")
    p.add_argument("--desc-act", action="store_true", help="gptq: columns in order of decreasing H_jj (act order)")
    p.add_argument("--calibration-text", help="a text file; windows of --seq-len tokens spread over it")
    p.add_argument("--num-samples", type=int, default=128, help="calibration windows (at most)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    p.add_argument("--damp-percent", type=float, default=0.01, help="gptq: dampening, a fraction of mean(diag H)")
    p.add_argument("--no-clip", action="store_true", help="awq: skip the clip search")
    p.add_argument("--rtn", action="store_true",
                   help="round to nearest on the same grid, no calibration (a baseline to compare against)")
    p.set_defaults(func=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> int:
    from pathlib import Path

    from modserve.quantizers.calibration.capture import CalibrationError
    from modserve.quantizers.calibration.quantize import Settings, quantize_checkpoint

    settings = Settings(args.method, args.bits, args.group_size, args.desc_act, args.num_samples, args.seq_len,
                        args.damp_percent, clip=not args.no_clip)
    if not (Path(args.model) / "config.json").is_file():
        print(f"error: --model {args.model}: no config.json there", file=sys.stderr)
        return 2
    if args.rtn:
        if args.desc_act:
            print("error: --desc-act needs calibration (it orders columns by the Hessian); drop --rtn", file=sys.stderr)
            return 2
        from modserve.quantizers.calibration.rtn import round_to_nearest_checkpoint

        round_to_nearest_checkpoint(args.model, args.out, args.method, args.bits, args.group_size)
        print(f"wrote {args.out} ({args.method}, {args.bits} bits, group {args.group_size}, round to nearest)")
        return 0
    if not args.calibration_text:
        print("error: --calibration-text FILE is required (or --rtn for round to nearest)", file=sys.stderr)
        return 2
    try:
        report = quantize_checkpoint(args.model, args.out, args.calibration_text, settings)
    except CalibrationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({args.method}, {args.bits} bits, group {args.group_size}); calibrated on "
          f"{report.tokens:,} tokens")
    print("\nrelative output error |X (W - Q)^T| / |X W^T| on the calibration inputs, mean over layers:\n")
    print("| linear | calibrated | round to nearest | ratio |\n|---|---|---|---|")
    kinds = sorted({k.split(".", 2)[2] for k in report.calibrated}, key=lambda k: list(report.calibrated).index(
        next(x for x in report.calibrated if x.endswith(k))))
    for kind in kinds:
        cal = [v for k, v in report.calibrated.items() if k.endswith(kind)]
        rtn = [v for k, v in report.rtn.items() if k.endswith(kind)]
        c, r = sum(cal) / len(cal), sum(rtn) / len(rtn)
        print(f"| {kind} | {c:.4f} | {r:.4f} | {c / r:.2f}x |")
    return 0
