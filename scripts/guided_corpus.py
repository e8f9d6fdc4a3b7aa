"""Structured-outputs coverage over the shared corpora, per grammar backend.

For every JSON schema in ../shared/corpora/jsonschema/ and every regex and grammar
in ../shared/corpora/grammars/, and for each backend: does it compile (within a
timeout), and do the outputs of a random-weight model sampled at temperature 1
that finish with ``stop`` parse and validate (``jsonschema`` with the format
checker / ``re.fullmatch`` / a fresh matcher, plus ``json.loads`` for the GBNF JSON grammars).

    .venv/bin/python scripts/guided_corpus.py --out build/guided   # ~40 min on 2 busy CPU cores

Compiles and each item's generation run in a worker process that the parent kills
on timeout (a runaway compile, or a matcher that slows down with every token,
cannot be stopped inside a process). Results go to <out>/corpus.json and the
per-category tables to <out>/corpus.md (copied into docs/guided-decoding.md).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import re
import signal
import sys
import time
from collections import defaultdict
from pathlib import Path

CORPORA = Path(__file__).resolve().parents[2] / "shared" / "corpora"
PROMPT = "Answer in the requested format:"


# -- the corpus ---------------------------------------------------------------------------
def load_items(corpora: Path, limit: int | None) -> list[dict]:
    """(suite, category, id, kind, spec, check) for every schema, regex and grammar."""
    items = []
    root = corpora / "jsonschema" / "jsonschemabench"
    for line in (root / "index.jsonl").read_text().splitlines():
        row = json.loads(line)
        schema = json.loads((root / row["file"]).read_text())["schema"]
        items.append(dict(suite="jsonschema", category=row["category"], id=Path(row["file"]).stem,
                          kind="json", spec=schema))
    for line in (corpora / "grammars" / "regex" / "jsonschemabench_patterns.jsonl").read_text().splitlines():
        row = json.loads(line)
        regex = row.get("fullmatch_regex") or row["pattern"]
        items.append(dict(suite="regex", category=row["length_bucket"], id=row["id"], kind="regex", spec=regex))
    for path in sorted((corpora / "grammars" / "gbnf_llamacpp").glob("*.gbnf")):
        items.append(dict(suite="grammar", category="gbnf", id=path.name, kind="grammar", spec=path.read_text()))
    lark = corpora / "grammars" / "lark_outlines"
    for name in ("arithmetic", "json"):
        items.append(dict(suite="grammar", category="lark", id=f"{name}.lark", kind="grammar",
                          spec=(lark / f"{name}.lark").read_text()))
    by_suite = defaultdict(list)
    for item in items:
        by_suite[item["suite"]].append(item)
    return [x for group in by_suite.values() for x in (group[:limit] if limit else group)]


# -- checking an output -------------------------------------------------------------------
def check(item: dict, text: str, reaccept) -> str | None:
    """None if ``text`` satisfies the item; else why not."""
    if item["kind"] == "json":
        import jsonschema

        try:
            value = json.loads(text)
        except ValueError as e:
            return f"does not parse: {e}"
        cls = jsonschema.validators.validator_for(item["spec"], default=jsonschema.Draft202012Validator)
        error = jsonschema.exceptions.best_match(
            cls(item["spec"], format_checker=cls.FORMAT_CHECKER).iter_errors(value))
        return None if error is None else f"invalid: {error.message[:200]}"
    if item["kind"] == "regex":
        return None if re.fullmatch(item["spec"], text) else "re.fullmatch fails"
    if not reaccept(text):
        return "a fresh matcher rejects the text"
    # json.gbnf and json_arr.gbnf describe JSON exactly; json.lark does not (its %ignore WS
    # takes form feeds, its SIGNED_NUMBER leading zeros), so only the grammar judges it.
    if item["id"].endswith(".gbnf") and "json" in item["id"]:
        try:
            json.loads(text)
        except ValueError as e:
            return f"does not parse: {e}"
    return None


# -- the worker process -------------------------------------------------------------------
def worker(conn, backend: str, model: str, max_model_len: int) -> None:
    from modserve import LLM, SamplingParams, StructuredOutputs

    llm = LLM(model, progress=False, grammar_backend=backend, grammar_cache_size=4096,
              kv_cache_memory_gb=0.25, max_model_len=max_model_len, num_threads=1)
    grammar = llm.engine.grammar
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg[0] == "compile":
            _, kind, spec = msg
            start = time.perf_counter()
            try:
                grammar.compile(StructuredOutputs(**{kind: spec}).spec())
                conn.send(("ok", time.perf_counter() - start))
            except ValueError as e:
                conn.send(("refused", str(e)))
        elif msg[0] == "generate":
            _, kind, spec, samples, max_tokens, seed = msg
            params = SamplingParams(n=samples, temperature=1.0, max_tokens=max_tokens, seed=seed,
                                    structured_outputs=StructuredOutputs(**{kind: spec}))
            start = time.perf_counter()
            out, = llm.generate(PROMPT, params, use_tqdm=False)
            conn.send(([(c.text, c.finish_reason) for c in out.outputs], time.perf_counter() - start))
        elif msg[0] == "reaccept":
            _, kind, spec, text = msg
            compiled = grammar.compile(StructuredOutputs(**{kind: spec}).spec())
            ids = llm.engine.tokenizer.encode(text, add_special_tokens=False)
            m = compiled.matcher()
            ok = all(m.accept_token(t) for t in ids) and any(m.accept_token(e) for e in
                                                              sorted(llm.engine.eos_token_ids))
            conn.send(ok)
        else:
            return


class Worker:
    def __init__(self, backend: str, model: str, max_model_len: int) -> None:
        self.args = (backend, model, max_model_len)
        self.start()

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker, args=(child, *self.args), daemon=True)
        self.proc.start()
        # Loading takes a while on a busy machine; no compile's clock starts before it is done.
        if not self.conn.poll(600) or self.conn.recv() != "ready":
            raise RuntimeError("the worker did not start")

    def call(self, msg: tuple, timeout: float):
        self.conn.send(msg)
        if not self.conn.poll(timeout):
            self.proc.kill()
            self.proc.join()
            self.start()
            raise TimeoutError
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(("quit",))
        self.proc.join(10)


# -- the run ----------------------------------------------------------------------------------
def run_backend(backend: str, items: list[dict], args) -> list[dict]:
    w = Worker(backend, args.model, args.max_model_len)
    results = []
    for n, item in enumerate(items):
        res = dict(suite=item["suite"], category=item["category"], id=item["id"], backend=backend)
        try:
            status, detail = w.call(("compile", item["kind"], item["spec"]), args.compile_timeout)
        except TimeoutError:
            status, detail = "timeout", f"no result within {args.compile_timeout:.0f} s"
        res["compile"] = status
        res["compile_s" if status == "ok" else "reason"] = detail
        results.append(res)
        print(f"[{backend}] {n + 1}/{len(items)} {item['id']}: {status}", file=sys.stderr, flush=True)
    ok = [(item, res) for item, res in zip(items, results) if res["compile"] == "ok"]
    for i, (item, res) in enumerate(ok):
        # n samples of one item per call: a matcher that slows down (xgrammar on an ambiguous
        # regex) then costs that item a timeout, not the whole run.
        try:
            outs, res["generate_s"] = w.call(("generate", item["kind"], item["spec"], args.samples, args.max_tokens,
                                              args.seed + i), timeout=args.generate_timeout)
        except TimeoutError:
            res["generate"] = f"timeout: no result within {args.generate_timeout:.0f} s"
            outs = []
        res["finish"] = [f for _, f in outs]
        res["failures"] = []
        for text, finish in outs:
            if finish != "stop":
                continue
            why = check(item, text, lambda t: w.call(("reaccept", item["kind"], item["spec"], t), 600))
            if why:
                res["failures"].append({"why": why, "text": text[:500]})
                print(f"[{backend}] FAILED {item['id']}: {why}", file=sys.stderr, flush=True)
        with open(args.out / "partial.jsonl", "a") as f:
            f.write(json.dumps(res) + "\n")
        print(f"[{backend}] generated {i + 1}/{len(ok)} {item['id']}: {res['finish']} "
              f"{res.get('generate_s', 0):.1f} s", file=sys.stderr, flush=True)
    w.close()
    return results


def tables(results: list[dict], backends: list[str]) -> str:
    lines = []
    for suite in ("jsonschema", "regex", "grammar"):
        rows = [r for r in results if r["suite"] == suite]
        if not rows:
            continue
        lines += [f"### {suite}", "",
                  "| category | items | " + " | ".join(f"{b}: compiled / timeout | {b}: stop / valid / length"
                                                       for b in backends) + " |",
                  "|---|---|" + "---|---|" * len(backends)]
        cats = sorted({r["category"] for r in rows}, key=lambda c: [r["category"] for r in rows].index(c))
        for cat in [*cats, "**total**"]:
            cells = []
            n_items = 0
            for b in backends:
                mine = [r for r in rows if r["backend"] == b and (cat == "**total**" or r["category"] == cat)]
                n_items = len(mine)
                comp = sum(r["compile"] == "ok" for r in mine)
                tout = sum(r["compile"] == "timeout" for r in mine)
                fin = [f for r in mine for f in r.get("finish", [])]
                stop = fin.count("stop")
                bad = sum(len(r.get("failures", [])) for r in mine)
                gto = sum("generate" in r for r in mine)
                cells += [f"{comp} / {tout}", f"{stop} / {stop - bad} / {fin.count('length')}" + (f" ({gto} slow)" if gto else "")]
            lines.append(f"| {cat} | {n_items} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["### Why items were refused (most frequent first)", ""]
    for b in backends:
        why = defaultdict(int)
        for r in results:
            if r["backend"] == b and r["compile"] != "ok":
                why[_reason(r["reason"])] += 1
        top = sorted(why.items(), key=lambda kv: -kv[1])[:12]
        lines.append(f"- **{b}**: " + "; ".join(f"{n} x {w}" for w, n in top))
    return "\n".join(lines) + "\n"


def _reason(text: str) -> str:
    """A refusal reason without its specifics (paths, positions), for counting."""
    text = re.sub(r"^\w+ constraint refused: \w+: ", "", text)
    text = re.sub(r"^(xgrammar: |outlines-core: |xgrammar |outlines-core )", "", text)
    text = re.sub(r" at #\S*", "", text)
    text = re.sub(r"(error at|at position|at line) .*", r"\1 ...", text)
    return text[:90]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpora", type=Path, default=CORPORA)
    ap.add_argument("--backends", nargs="+", default=["xgrammar", "outlines"])
    ap.add_argument("--arch", default="llama", help="random-weight model from modserve.testing")
    ap.add_argument("--samples", type=int, default=4, help="outputs per item")
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--generate-timeout", type=float, default=300, help="seconds for one item's samples")
    ap.add_argument("--compile-timeout", type=float, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=None, help="first N items of each suite (a quick look)")
    ap.add_argument("--suites", nargs="+", default=["jsonschema", "regex", "grammar"])
    ap.add_argument("--out", type=Path, default=Path("build/guided"))
    ap.add_argument("--report-only", action="store_true", help="re-render <out>/corpus.md from <out>/corpus.json")
    args = ap.parse_args()
    if args.report_only:
        data = json.loads((args.out / "corpus.json").read_text())
        md = tables(data["results"], data["settings"]["backends"])
        (args.out / "corpus.md").write_text(md)
        print(md)
        return 0
    # A plain `kill` then still exits through atexit, which terminates the (daemon) workers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not args.corpora.is_dir():
        print(f"corpora not found at {args.corpora}", file=sys.stderr)
        return 2
    from modserve.testing import cached_checkpoint

    args.model = str(cached_checkpoint(args.arch))
    items = [x for x in load_items(args.corpora, args.limit) if x["suite"] in args.suites]
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    results = [r for b in args.backends for r in run_backend(b, items, args)]
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (args.out / "corpus.json").write_text(json.dumps(
        {"settings": settings, "seconds": time.time() - started, "results": results}, indent=1))
    md = tables(results, args.backends)
    (args.out / "corpus.md").write_text(md)
    print(md)
    bad = sum(len(r.get("failures", [])) for r in results)
    print(f"{bad} stopped outputs failed their check", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
