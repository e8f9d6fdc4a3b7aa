"""A/B comparison of two engine configs on one workload.

What is compared, exactly:

- greedy agreement: both configs generate every workload request greedily with EOS
  ignored; a request agrees when its token ids are identical. For the others, the
  position of the first differing token.
- max logit difference: each probe prompt runs alone for ``probe_tokens`` greedy steps
  while the raw logits the model hands the sampler are recorded (full vocabulary,
  before temperature or penalties). Steps are compared while A and B have produced the
  same tokens so far (up to and including the first divergence); later steps would
  compare different contexts.
- speed: the workload is timed on A, B, A, B, ... (``repeats`` pairs after warm-up) so
  that drift of a shared machine hits both alike; ratios are taken per pair, then
  reported as median [min-max].
- quality (``--eval-task``, ``--eval-text``; after the speed runs): a loglikelihood task's
  accuracy and a text's rolling-window perplexity through each engine's prompt logprobs
  (modserve/bench/evaluate.py), gated on acc(B) - acc(A) and ppl(B) / ppl(A).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from modserve.bench.metrics import Spread
from modserve.bench.offline import EngineRunner, Run, agreement, interleave
from modserve.bench.report import plot_compare, spread_table
from modserve.bench.workloads import BenchRequest


@dataclass(slots=True)
class Comparison:
    labels: tuple[str, str]
    num_requests: int
    agreement: float
    divergences: list[int]  # first differing position, per request that differs
    max_logit_diff: float
    probe_steps: int  # logit rows compared
    runs: dict[str, list[Run]]
    quality: "Quality | None" = None

    def figures(self) -> dict[str, list[dict[str, float]]]:
        out = {}
        for label, runs in self.runs.items():
            out[label] = [{**r.figures(),
                           "TTFT median ms": _median_ms([x.ttft for x in r.results]),
                           "E2E median ms": _median_ms([x.e2el for x in r.results])} for r in runs]
        return out


def _median_ms(values: Sequence[float]) -> float:
    return Spread.of(values).median * 1e3


@contextlib.contextmanager
def recorded_logits(llm: Any) -> Iterator[list]:
    """Record every logits tensor ``[rows, vocab]`` the model computes inside the block."""
    model = llm.model_module
    compute = model.compute_logits
    seen: list = []

    def record(hidden):
        logits = compute(hidden)
        seen.append(logits.detach().float().clone())
        return logits

    model.compute_logits = record  # NOTE: an instance attribute shadows the method until deleted
    try:
        yield seen
    finally:
        del model.compute_logits


def probe(llm: Any, prompts: Sequence[list[int]], steps: int) -> list[tuple[list[int], list]]:
    """Per prompt, alone: its greedy tokens and the logits row of each step."""
    from modserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    out = []
    for prompt in prompts:
        with recorded_logits(llm) as seen:
            tokens = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        out.append((list(tokens), [row[0] for row in seen]))
    return out


def max_logit_difference(a: list[tuple[list[int], list]], b: list[tuple[list[int], list]]) -> tuple[float, int]:
    worst, compared = 0.0, 0
    for (tok_a, rows_a), (tok_b, rows_b) in zip(a, b):
        for step, (x, y) in enumerate(zip(rows_a, rows_b)):
            worst = max(worst, float((x - y).abs().max()))
            compared += 1
            if tok_a[step] != tok_b[step]:
                break  # the contexts differ from the next step on
    return worst, compared


def compare(llm_a: Any, llm_b: Any, labels: tuple[str, str], requests: Sequence[BenchRequest],
            repeats: int = 3, warmups: int = 1, probe_prompts: int = 4, probe_tokens: int = 8,
            progress: bool = True) -> Comparison:
    probes = [r.prompt_token_ids for r in requests[:probe_prompts]]
    diff, steps = max_logit_difference(probe(llm_a, probes, probe_tokens), probe(llm_b, probes, probe_tokens))
    runs = interleave([EngineRunner(llm_a, labels[0]), EngineRunner(llm_b, labels[1])], requests,
                      repeats, warmups, progress)
    rate, diverged = agreement(runs[labels[0]][0].token_ids, runs[labels[1]][0].token_ids)
    return Comparison(labels, len(requests), rate, diverged, diff, steps, runs)


@dataclass(slots=True)
class Quality:
    """Per label: ``score_task``'s figures (without per-example rows), ``text_perplexity``'s."""
    task: dict[str, dict[str, Any]] | None = None
    perplexity: dict[str, dict[str, Any]] | None = None


def evaluate_quality(llms: dict[str, Any], task: str | Path | None, text: str | Path | None,
                     max_length: int, stride: int | None) -> Quality:
    from modserve.bench.evaluate import OfflineScorer, load_task, plain_encoder, score_task, text_perplexity

    examples = load_task(task) if task else None
    q = Quality()
    if examples is not None:
        q.task = {}
        for label, llm in llms.items():
            result = score_task(OfflineScorer(llm), plain_encoder(llm.get_tokenizer()), examples)
            q.task[label] = {k: v for k, v in result.items() if k != "per_example"}
    if text:
        body = Path(text).read_text()
        q.perplexity = {label: text_perplexity(OfflineScorer(llm), llm.get_tokenizer(), body, max_length, stride)
                        for label, llm in llms.items()}
    return q


def quality_verdict(q: Quality, labels: tuple[str, str], min_task_accuracy_delta: float | None,
                    max_perplexity_ratio: float | None) -> list[str]:
    a, b = labels
    why = []
    if min_task_accuracy_delta is not None and q.task is not None:
        delta = q.task[b]["acc"] - q.task[a]["acc"]
        if not delta >= min_task_accuracy_delta:
            why.append(f"task accuracy gate: acc(B) - acc(A) = {q.task[b]['acc']:.4f} - {q.task[a]['acc']:.4f} "
                       f"= {delta:+.4f} is under {min_task_accuracy_delta:+.4f}")
    if max_perplexity_ratio is not None and q.perplexity is not None:
        ratio = q.perplexity[b]["perplexity"] / q.perplexity[a]["perplexity"]
        if not ratio <= max_perplexity_ratio:
            why.append(f"perplexity gate: ppl(B) / ppl(A) = {q.perplexity[b]['perplexity']:.4f} / "
                       f"{q.perplexity[a]['perplexity']:.4f} = {ratio:.4f} exceeds {max_perplexity_ratio:.4f}")
    return why


def quality_lines(q: Quality, labels: tuple[str, str]) -> list[str]:
    a, b = labels
    lines = ["## Quality", ""]
    if q.task is not None:
        metrics = [k for k in ("acc", "acc_norm", "mean_loglikelihood") if k in q.task[a]]
        lines += [f"Task ({q.task[a]['kind']}, {q.task[a]['examples']} examples):", "",
                  "| metric | " + " | ".join(labels) + " | B - A |", "|---|---|---|---|",
                  *(f"| {m} | {q.task[a][m]:.4f} | {q.task[b][m]:.4f} | {q.task[b][m] - q.task[a][m]:+.4f} |"
                    for m in metrics), ""]
    if q.perplexity is not None:
        pa, pb = q.perplexity[a], q.perplexity[b]
        lines += [f"Perplexity ({pa['tokens']} tokens, {pa['windows']} windows of {pa['max_length']}, "
                  f"stride {pa['stride']}): {a} {pa['perplexity']:.4f}, {b} {pb['perplexity']:.4f}, "
                  f"B / A {pb['perplexity'] / pa['perplexity']:.4f}", ""]
    return lines


def verdict(c: Comparison, min_agreement: float, max_logit_diff: float | None,
            min_task_accuracy_delta: float | None = None, max_perplexity_ratio: float | None = None) -> list[str]:
    """Why the comparison fails its thresholds (empty when it passes)."""
    why = []
    if c.agreement < min_agreement:
        why.append(f"greedy agreement {c.agreement:.1%} is under {min_agreement:.1%}")
    if max_logit_diff is not None and not c.max_logit_diff <= max_logit_diff:
        why.append(f"max logit difference {c.max_logit_diff:.3g} exceeds {max_logit_diff:.3g}")
    if c.quality is not None:
        why += quality_verdict(c.quality, c.labels, min_task_accuracy_delta, max_perplexity_ratio)
    return why


def markdown(c: Comparison, title: str, context: Sequence[str], failures: Sequence[str],
             figure: str | None) -> str:
    a, b = c.labels
    agree = round(c.agreement * c.num_requests)
    div = (f"median {Spread.of(c.divergences).median:.0f}, earliest {min(c.divergences)}"
           if c.divergences else "none")
    lines = [
        f"# {title}", "", *context, "",
        "## Agreement", "",
        f"- greedy exact match: {agree}/{c.num_requests} requests ({c.agreement:.1%})",
        f"- first divergence position (output token index) where they differ: {div}",
        f"- max |logit difference|: {c.max_logit_diff:.3g} over {c.probe_steps} decode steps "
        "(full-vocabulary raw logits, compared while the greedy tokens agree)",
        f"- verdict: {'FAIL: ' + '; '.join(failures) if failures else 'pass'}",
        "", "## Speed", "",
        f"Median [min-max] over {len(c.runs[a])} interleaved repeats; the ratio is {a} / {b} per pair. "
        "TTFT and E2E are per request, all requests submitted at once.", "",
        spread_table(c.figures()), "",
    ]
    if c.quality is not None:
        lines += quality_lines(c.quality, c.labels)
    if figure:
        lines += [f"![latency CDFs and throughput]({figure})", ""]
    return "\n".join(lines)


def write_report(c: Comparison, out_dir: str | Path, title: str, context: Sequence[str],
                 failures: Sequence[str], model: str = "") -> Path:
    """``compare.md`` and ``compare.png`` (titled with ``title``, ``model`` and the machine) in
    ``out_dir``; returns the markdown's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    latencies = {label: {"TTFT": [x.ttft for r in runs for x in r.results],
                         "E2E latency": [x.e2el for r in runs for x in r.results]}
                 for label, runs in c.runs.items()}
    throughputs = {label: [r.output_tok_s for r in runs] for label, runs in c.runs.items()}
    plot_compare(out / "compare.png", latencies, throughputs, f"{title} on {model}" if model else title)
    path = out / "compare.md"
    path.write_text(markdown(c, title, context, failures, "compare.png"))
    return path


def labels_for(a: str | Path, b: str | Path) -> tuple[str, str]:
    sa, sb = Path(a).stem, Path(b).stem
    return (sa, sb) if sa != sb else (f"A:{sa}", f"B:{sb}")
