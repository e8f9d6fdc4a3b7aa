"""The example third-party plugin (examples/modserve-example-plugin), tested as a user meets it.

``make test`` pip-installs it (not editable) after modserve. These tests see it only through
the host: ``modserve plugins``, engine configs, ``modserve compare`` and ``modserve
conformance``, plus one direct check of what its sampler adds (typical filtering).
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from modserve import LLM, SamplingParams
from modserve.api import SamplingBatch
from modserve.core.registry import Registry
from modserve.testing import cached_checkpoint

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "modserve-example-plugin"
DIST = "modserve-example-plugin"
REINSTALL = f"make install, or: pip install --no-deps {EXAMPLE.relative_to(ROOT)}"

# Built-ins and this example only; the built-ins load whatever the list says.
ENV_ALLOW = f"modserve,{DIST}"
# One CPU thread: these engines are tiny, and spinning thread pools only slow a shared machine.
ENGINE: dict[str, Any] = dict(dtype="float32", max_model_len=256, num_kv_blocks=128, max_num_seqs=3,
                              max_num_batched_tokens=32, num_threads=1)
BUILTIN: dict[str, Any] = {"attention_backend": "reference", "scheduler": "fcfs", "sampler": "default"}
# Each example implementation swapped in alone. typical's default (typical_p 1) is no typical
# filtering, so the seeded requests below must draw exactly the built-in sampler's tokens too.
SWAPS: dict[str, dict[str, Any]] = {
    "example_sdpa": {"attention_backend": "example_sdpa"},
    "example_sdpa-repeat": {"attention_backend": {"name": "example_sdpa", "options": {"gqa": "repeat"}}},
    "shortest_first": {"scheduler": {"name": "shortest_first", "options": {"max_wait_s": 10.0}}},
    "typical": {"sampler": "typical"},
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# Greedy with one penalty each, on a prompt whose greedy continuation repeats tokens.
PENALISED = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, **{penalty: value})
             for penalty, value in (("repetition_penalty", 1.3), ("presence_penalty", 1.0), ("frequency_penalty", 1.0))]
# Seeded random rows, one setting each, strong enough that dropping it changes the draw
# (the tiny random model's distribution is nearly flat).
SEEDED = [SamplingParams(temperature=0.8, top_p=0.8, repetition_penalty=1.2, max_tokens=10, ignore_eos=True,
                         seed=1234, logprobs=2),
          SamplingParams(temperature=1.5, top_k=3, max_tokens=10, ignore_eos=True, seed=5),
          SamplingParams(temperature=1.0, min_p=0.9, max_tokens=10, ignore_eos=True, seed=6)]


def modserve(*args: str, timeout: float = 60, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MODSERVE_LOAD_PLUGINS": ENV_ALLOW, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "modserve", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=cwd)


@pytest.fixture(scope="module")
def installed() -> md.Distribution:
    """The installed distribution, which must be the example's current source (a stale copy
    would test old code)."""
    try:
        dist = md.distribution(DIST)
    except md.PackageNotFoundError:
        pytest.fail(f"{DIST} is not installed: {REINSTALL}")
    version = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]["version"]
    assert dist.version == version, f"installed {DIST} {dist.version}, source {version}: {REINSTALL}"

    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    source = {p.name: digest(p) for p in (EXAMPLE / "modserve_example_plugin").glob("*.py")}
    copy = {f.name: digest(Path(f.locate())) for f in dist.files or []
            if f.parts[0] == "modserve_example_plugin" and f.suffix == ".py"}
    assert copy == source, f"the installed {DIST} differs from {EXAMPLE.relative_to(ROOT)}: {REINSTALL}"
    return dist


@pytest.fixture(scope="module")
def registry(installed: md.Distribution) -> Registry:
    reg = Registry()
    reg.load_entrypoints({DIST})
    assert not reg.failures, reg.failures
    return reg


@pytest.fixture(scope="module")
def model() -> str:
    return str(cached_checkpoint())


def engine(registry: Registry, tmp_path: Path, model: str, **choices: Any) -> LLM:
    """An engine built as a user builds it: from a YAML config file."""
    path = tmp_path / f"engine-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump({"model": model, **ENGINE, **choices}))
    return LLM.from_config(path, registry=registry, progress=False)


def requests() -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of mixed lengths: with 3 slots and 32 tokens a step, they queue, and the long
    ones are prefilled in chunks beside decodes (so the scheduler's order matters)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (37, 5, 21, 9, 50, 3, 14, 28)]
    # NOTE: prompt 1's greedy continuation repeats a token: what the penalties act on.
    return [*prompts, *[prompts[1]] * len(PENALISED)], [GREEDY] * 5 + SEEDED + PENALISED


def outputs(llm: LLM) -> list[tuple[list[int], list[float] | None]]:
    outs = llm.generate(*requests(), use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs and [e["logprob"] for e in o.outputs[0].logprobs])
            for o in outs]


@pytest.fixture(scope="module")
def builtin_outputs(registry: Registry, tmp_path_factory: pytest.TempPathFactory,
                    model: str) -> list[tuple[list[int], list[float] | None]]:
    return outputs(engine(registry, tmp_path_factory.mktemp("builtin"), model, **BUILTIN))


def test_installed_and_listed_by_modserve_plugins(installed: md.Distribution) -> None:
    import modserve_example_plugin

    assert modserve_example_plugin.MODSERVE_PLUGIN_API == "1.0"
    run = modserve("plugins", "--json")
    assert run.returncode == 0, run.stderr
    dist = {d["distribution"]: d for d in json.loads(run.stdout)}[DIST]
    assert dist["version"] == installed.version and dist["errors"] == []
    regs = {(r["kind"], r["name"]): r for r in dist["registrations"]}
    assert set(regs) == {("attention_backend", "example_sdpa"), ("scheduler", "shortest_first"),
                         ("sampler", "typical")}
    assert all(r["description"].startswith("example: ") and r["error"] is None for r in regs.values())
    (gqa,) = regs["attention_backend", "example_sdpa"]["options"]
    assert (gqa["name"], gqa["type"], gqa["default"]) == ("gqa", "Literal['enable_gqa', 'repeat']", "enable_gqa")
    (wait,) = regs["scheduler", "shortest_first"]["options"]
    assert (wait["name"], wait["type"], wait["default"], wait["constraints"]) == ("max_wait_s", "float", 10.0,
                                                                                  ["gt=0"])
    assert "starvation" in wait["description"]
    (typical,) = regs["sampler", "typical"]["options"]
    assert (typical["name"], typical["default"], typical["constraints"]) == ("typical_p", 1.0, ["gt=0", "le=1"])

    text = modserve("plugins")
    assert text.returncode == 0, text.stderr
    mine = text.stdout[text.stdout.index(f"{DIST} {installed.version}\n"):]
    for line in ("  scheduler\n    shortest_first — example: running sequences first",
                 "max_wait_s (float, gt=0) = 10.0", "typical_p (float, gt=0, le=1) = 1.0"):
        assert line in mine, text.stdout


@pytest.mark.parametrize("swap", list(SWAPS))
def test_selected_by_config_matches_the_builtins(
        swap: str, registry: Registry, tmp_path: Path, model: str,
        builtin_outputs: list[tuple[list[int], list[float] | None]]) -> None:
    llm = engine(registry, tmp_path, model, **{**BUILTIN, **SWAPS[swap]})
    kind, choice = next(iter(SWAPS[swap].items()))
    name = choice if isinstance(choice, str) else choice["name"]
    made = {"attention_backend": llm.engine.runner.attn, "scheduler": llm.engine.scheduler.policy,
            "sampler": llm.engine.runner.sampler}[kind]
    assert type(made) is registry.load(kind, name)  # the config selected the example's class
    mine = outputs(llm)
    assert [ids for ids, _ in mine] == [ids for ids, _ in builtin_outputs]  # greedy, seeded, penalised
    torch.testing.assert_close(mine[5][1], builtin_outputs[5][1], atol=1e-4, rtol=0)  # raw logprobs


@pytest.mark.parametrize("max_wait_s, served", [(10.0, [1, 3, 2, 0]), (1e-9, [0, 1, 2, 3])],
                         ids=["shortest-first", "overdue-oldest-first"])
def test_shortest_first_order_and_its_age_bound(max_wait_s: float, served: list[int], registry: Registry,
                                                tmp_path: Path, model: str) -> None:
    """One sequence slot, so requests are served one at a time: shortest prompt first; once
    everything has waited past max_wait_s, in arrival order (what keeps long prompts from starving)."""
    llm = engine(registry, tmp_path, model, scheduler={"name": "shortest_first", "options": {"max_wait_s": max_wait_s}},
                 max_num_seqs=1)
    gen = torch.Generator().manual_seed(1)
    lens = (40, 8, 24, 16)
    outs = llm.generate([torch.randint(3, 4000, (n,), generator=gen).tolist() for n in lens],
                        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    first_token = [o.metrics.first_token_time for o in outs]
    assert sorted(range(len(lens)), key=first_token.__getitem__) == served


def sampling_batch(rows: int, temperature: float) -> SamplingBatch:
    def full(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype)

    return SamplingBatch(
        temperature=full(temperature), top_k=full(0, torch.int64), top_p=full(1.0), min_p=full(0.0),
        repetition_penalty=full(1.0), presence_penalty=full(0.0), frequency_penalty=full(0.0),
        all_greedy=temperature == 0, any_top_k=False, any_top_p=False, any_min_p=False, any_penalty=False,
        generators={}, prompt_token_ids=None, output_token_ids=None, banned_token_ids=[], max_num_logprobs=-1)


def test_typical_sampler_keeps_the_most_typical_tokens(registry: Registry) -> None:
    """p = [0.5, 0.3, 0.2]: entropy 1.03 nats; surprisals 0.69, 1.20, 1.61. Token 1 is the most
    typical, so typical_p 0.2 samples only it, where plain sampling draws all three."""
    reg = registry.get("sampler", "typical")
    cls, options = reg.load(), reg.options_model()
    logits = torch.tensor([0.5, 0.3, 0.2]).log().expand(512, 3)  # [B, V]
    typical = cls(3, options(typical_p=0.2))
    assert typical(logits, sampling_batch(512, 1.0)).token_ids.unique().tolist() == [1]
    torch.testing.assert_close(typical.probs(logits[:1], sampling_batch(1, 1.0)), torch.tensor([[0.0, 1.0, 0.0]]))
    assert typical(logits, sampling_batch(512, 0.0)).token_ids.unique().tolist() == [0]  # greedy: the argmax
    plain = cls(3, options(typical_p=1.0))
    assert plain(logits, sampling_batch(512, 1.0)).token_ids.unique().tolist() == [0, 1, 2]


def test_compare_gate_against_the_builtins(installed: md.Distribution, model: str, tmp_path: Path) -> None:
    """The CI gate of ``make ab``, between the built-in reference config and the example's."""
    run = modserve("--log-level", "WARNING", "compare", "configs/ab/attention-reference.yaml",
                   str((EXAMPLE / "example.yaml").relative_to(ROOT)), "--model", model, "--out-dir", str(tmp_path),
                   "--threads", "1", "--workload", "random", "--input-len", "32", "--num-prompts", "4",
                   "--output-len", "8", "--repeats", "1", "--min-agreement", "1.0", "--max-logit-diff", "1e-3",
                   timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (tmp_path / "compare.md").is_file()


def test_conformance_kit_passes(installed: md.Distribution, tmp_path: Path) -> None:
    targets = ["attention_backend:example_sdpa", "scheduler:shortest_first", "sampler:typical"]
    # cwd: a scratch folder, so the repo's pytest settings and cache stay out of it.
    run = modserve("conformance", *targets, "--", "-v", "-p", "no:cacheprovider", timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
    for target in targets:  # each target's own tests ran (ids name it: test_x[kind:name...])
        assert re.search(rf"\[{re.escape(target)}[-\]].* PASSED", run.stdout), run.stdout[-3000:]
