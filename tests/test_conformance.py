"""The conformance kit (modserve.testing.conformance) fails every planted fault of
tests/broken_plugins.py, passes the built-ins registered through that same plugin, and is a
well-behaved pytest plugin (usage errors, deselection, inert in other runs).

The kit runs in-process (``pytest.main``, its reports recorded) with the broken plugin added to
the process registry; one run goes through a subprocess with the plugin installed as a
distribution, as a third party's would be. NOTE: not ``pytester.inline_run``: it drops the
modules a run imported, and torch's (``torch._dynamo``) cannot be imported a second time.
"""

from __future__ import annotations

import ast
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

import broken_plugins
import modserve.testing.conformance as kit
import modserve.testing.conformance.test_executor as kit_executor
from modserve.core.registry import Registry, get_registry
from modserve.testing import cached_checkpoint

pytest_plugins = ["pytester"]

KIT = Path(kit.__file__).parent

# (target, -k expression selecting the kit test that must fail, regex its failure must match)
FAULTS: list[tuple[str, str, str]] = [
    ("attention_backend:no_causal_mask", "test_matches_float64_reference", "positions <= its own"),
    ("attention_backend:gqa_wrong_head", "test_matches_float64_reference and gqa", "differs from causal attention"),
    ("attention_backend:fp8_ignores_scale", "test_matches_float64_reference and fp8kv", "differs from causal"),
    ("attention_backend:float32_output", "test_matches_float64_reference and bfloat16", "must be torch.bfloat16"),
    ("attention_backend:skips_cache_write", "test_writes_kv_into_its_blocks_only", r"are not in kv_cache\[:, "),
    ("attention_backend:stray_write", "test_writes_kv_into_its_blocks_only", "writes nothing there"),
    ("attention_backend:blocks_in_dim_0", "test_kv_cache_shape_indexes_blocks_in_dimension_1",
     "dimension 1 must be the block count"),
    ("attention_backend:graph_reads_host_lists", "test_keeps_its_cuda_graph_promise", "never from seq_lens_cpu"),
    ("attention_backend:graph_pad_writes", "test_keeps_its_cuda_graph_promise", "must write nowhere"),
    ("attention_backend:native_decode_skips_write", "test_native_decode_op_does_forwards_work",
     "differs from causal attention"),
    ("kv_allocator:leaks_on_free", "test_freeing_everything_frees_every_block", "check_integrity found"),
    ("kv_allocator:leaks_and_hides_it", "test_freeing_everything_frees_every_block", "leaked"),
    ("kv_allocator:frees_shared_blocks", "test_random_operations_keep_the_books", "is not its own|counts as free"),
    ("kv_allocator:partial_on_failure", "test_allocate_is_all_or_nothing", "a failed allocate must change nothing"),
    ("kv_allocator:no_copy_on_write", "test_fork_shares_then_copies_on_write", "never written in place"),
    ("kv_allocator:unreported_copies", "test_fork_shares_then_copies_on_write", "without reporting the copy"),
    ("kv_allocator:matches_whole_prompt", "test_match_prefix_leaves_the_last_token", "fewer than all tokens"),
    ("kv_allocator:blocks_needed_underreports", "test_freeing_everything", r"blocks_needed\(\) said 0"),
    ("kv_allocator:refuses_when_exactly_full", "test_allocate_is_all_or_nothing", "refused, though blocks_needed"),
    ("kv_allocator:free_keeps_the_table", "test_freeing_everything", "left its table"),
    ("kv_allocator:fork_drops_the_last_block", "test_fork_shares_then_copies_on_write", "must be the parent's"),
    ("kv_allocator:misses_block_removed", "test_kv_events_say_what_is_cached", "a BlockRemoved was not recorded"),
    ("kv_allocator:misses_block_stored", "test_kv_events_say_what_is_cached", "a BlockStored never recorded"),
    ("scheduler:ignores_token_budget", "test_valid_schedules", "over max_num_batched_tokens"),
    ("scheduler:ignores_max_num_seqs", "test_valid_schedules", "over max_num_seqs"),
    ("scheduler:ignores_blocks", "test_valid_schedules", "are free after its preemptions"),
    ("scheduler:preempts_waiting", "test_valid_schedules", "preempted but not running"),
    ("scheduler:starves_long_prompts", "test_valid_schedules", "spin forever|starves them"),
    ("scheduler:returns_dict", "test_valid_schedules", "must return a Schedule"),
    ("scheduler:reorders_the_queue", "test_valid_schedules", "changed the view"),
    ("scheduler:gives_too_many_tokens", "test_valid_schedules", "to compute"),
    ("scheduler:schedules_a_preempted_one", "test_valid_schedules", "both preempted and scheduled"),
    ("sampler:greedy_not_argmax", "test_greedy_rows_take_the_argmax", "must take the argmax"),
    ("sampler:int32_token_ids", "test_greedy_rows_take_the_argmax", "int64"),
    ("sampler:token_ids_out_of_range", "test_greedy_rows_take_the_argmax", "token ids outside"),
    ("sampler:ignores_temperature", "test_sampling_follows_the_distribution", "drawn with frequency"),
    ("sampler:top_k_off_by_one", "test_sampling_follows_the_distribution and k3", "probability 0 but was drawn"),
    ("sampler:probs_ignore_top_p", "test_probs_is_the_sampling_distribution", "probs gave"),
    ("sampler:seeded_rows_are_greedy", "test_seeded_rows_follow_the_distribution", "drawn with frequency"),
    ("sampler:seeded_rows_are_greedy", "test_seeded_rows_do_not_depend_on_the_batch", "must still sample"),
    ("sampler:seeded_rows_use_the_global_rng", "test_seeded_rows_do_not_depend_on_the_batch", "must not depend"),
    ("sampler:ignores_bitmask", "test_bitmask_is_honoured", "must take|probability 0"),
    ("sampler:ignores_banned_tokens", "test_banned_tokens_are_never_sampled", "banned must take"),
    ("sampler:processed_logprobs", "test_logprobs_are_of_the_raw_distribution", "raw distribution"),
    ("sampler:ranks_from_zero", "test_logprobs_are_of_the_raw_distribution", "1 = most likely"),
    ("grammar_backend:allows_everything", "test_bitmask_is_exactly_what_may_come_next", r"\(extra: \["),
    ("grammar_backend:eos_anywhere", "test_bitmask_is_exactly_what_may_come_next", r"extra: \['EOS'\]"),
    ("grammar_backend:ors_into_row", "test_bitmask_is_exactly_what_may_come_next", r"\(extra: \["),
    ("grammar_backend:writes_other_rows", "test_bitmask_is_exactly_what_may_come_next", "it owns row 1 only"),
    ("grammar_backend:eos_does_not_terminate", "test_bitmask_is_exactly_what_may_come_next",
     "EOS must be accepted and terminate"),
    ("grammar_backend:terminated_from_the_start", "test_bitmask_is_exactly_what_may_come_next", "without EOS"),
    ("grammar_backend:refusal_resets", "test_refused_tokens_change_nothing", "changed what the matcher allows"),
    ("grammar_backend:accepts_anything", "test_refused_tokens_change_nothing", "accepted a forbidden token"),
    ("grammar_backend:rollback_noop", "test_rollback_restores_earlier_states", "rollback"),
    ("grammar_backend:reset_noop", "test_reset_returns_to_the_start", "must return to the start"),
    ("grammar_backend:compile_raises_runtime_error", "test_compile_refuses_an_invalid_regex", "raised RuntimeError"),
    ("grammar_backend:default_serialize", "test_a_deserialized_grammar_makes_the_same_matcher", "does not pickle"),
    ("grammar_backend:deserialize_another_grammar", "test_a_deserialized_grammar_makes_the_same_matcher",
     "the deserialized grammar's matcher allows"),
    ("quantizer:apply_ignores_bias", "test_apply_matches_the_dequantized_weight", r"\+ bias by"),
    ("quantizer:native_op_drops_scales", "test_native_op_is_apply", r"differs from apply\(layer, x\)"),
    ("quantizer:apply_returns_float32", "test_apply_matches_the_dequantized_weight and bfloat16",
     r"must return \[T, out\]"),
    ("quantizer:gptq_zero_off_by_one", "test_dequantize_stands_for_the_checkpoint",
     "differs from the checkpoint's dequantization"),
    ("quantizer:dequantize_transposed", "test_dequantize_stands_for_the_checkpoint", r"must be \[out, in\]"),
    ("quantizer:zero_weights", "test_dequantize_stands_for_the_checkpoint", "must stand for"),
    ("quantizer:weight_bytes_forget_scales", "test_weight_bytes_are_what_the_layer_keeps", "but the layer keeps"),
    ("quantizer:ignores_shard_offsets", "test_fused_shards_load_in_any_order", "dequantize differently"),
    ("quantizer:ignores_unknown_names", "test_an_unknown_tensor_name_is_an_error_naming_it", "without an error"),
    ("quantizer:awq_layout_unpacked", "test_tensor_parallel_shards_are_slices_of_the_whole_layer",
     r"loading its slices of the checkpoint tensors failed.*tensor_layout"),
    ("quantizer:row_shards_ignore_in_start", "test_tensor_parallel_shards_are_slices_of_the_whole_layer and o_proj",
     "rank 1 of 2: dequantize differs from its own layer of columns 32:64"),
    ("proposer:too_many_tokens", "test_proposals_fit_what_was_asked", "at most"),
    ("proposer:out_of_vocab", "test_proposals_fit_what_was_asked", "are not token ids"),
    ("proposer:unnormalized_probs", "test_proposals_fit_what_was_asked", "it must be a distribution"),
    ("proposer:probs_missing_a_token", "test_proposals_fit_what_was_asked", r"probs must be \[B, K, V\]"),
    ("proposer:drafts_its_improbable", "test_proposals_fit_what_was_asked", "has probability 0"),
    ("proposer:drops_a_sequence", "test_proposals_fit_what_was_asked", "token lists for"),
    ("proposer:forget_unknown_raises", "test_forget_then_propose_for_new_sequences", "one it never proposed for"),
    # Each an engine of two ranks (seconds to start). The kill test waits all of the kit's FAILED_WITHIN
    # for failed(), shortened to FAILED_WITHIN_HERE below: the same check, not 10 s of waiting.
    ("executor:workers_get_another_model", "test_tp2_gives_the_greedy_tokens_of_one_rank", "must run the spec"),
    ("executor:failed_blocks", "test_failed_is_none_and_quick_while_healthy", "it is polled"),
    ("executor:shutdown_forgets_workers", "test_shutdown_leaves_no_worker", "still there"),
    ("executor:shutdown_never_kills", "test_shutdown_ends_a_worker_that_does_not_exit", "still running"),
    ("executor:failed_never_says", "test_a_killed_worker_is_reported_and_ends_the_engine",
     r"failed\(\) still returned None 2 s after"),
    ("executor:uni_refuses_vaguely", "test_one_rank_executor_refuses_more_ranks_clearly",
     "must refuse with a ValueError"),
    ("kv_connector:loads_the_wrong_layer", "test_saved_blocks_load_back_bit_for_bit", "came back different"),
    ("kv_connector:counts_every_key", "test_stored_blocks_is_the_leading_run", "only the blocks before it count"),
    ("kv_connector:fails_the_rest_after_a_miss", "test_a_block_it_does_not_hold_fails_alone",
     "must return the index of the block it lacks"),
    ("kv_connector:saves_a_view", "test_a_save_is_a_copy", "not keep a view"),
    ("kv_connector:stores_half_saved_blocks", "test_a_step_whose_save_layer_raised", "store only whole blocks"),
    ("tool_parser:drops_the_last_streamed_call", "test_a_stream_joins_to_what_extract_gives",
     "a stream must join to extract's result"),
    ("tool_parser:arguments_as_python", "test_examples_give_calls_with_json_arguments",
     "must be a JSON object's text"),
    ("reasoning_parser:sends_a_partial_marker", "test_a_stream_joins_to_what_extract_gives",
     "a stream must join to extract's result"),
    ("reasoning_parser:finds_no_reasoning", "test_examples_give_reasoning", "found no reasoning"),
    ("reasoning_parser:names_the_wrong_end_marker", "test_the_content_is_what_follows_the_end_marker",
     "which a constraint holds"),
    ("logits_processor:acts_on_every_row", "test_rows_without_arguments_are_untouched", "must be unchanged"),
    ("logits_processor:claims_argmax_invariance", "test_argmax_invariant_processors_keep_the_argmax",
     "changed the argmax"),
    ("logits_processor:ignores_moves", "test_state_follows_the_requests_when_rows_change", "must follow it"),
    ("lora_resolver:escapes_its_directory", "test_names_outside_its_source", "outside its source"),
    ("lora_resolver:ignores_the_base_model", "test_another_base_models_adapter_is_refused", "it must be refused"),
    ("lora_resolver:renames_the_adapter", "test_a_resolved_adapter_is_the_one_named", "must be the name asked"),
    ("lora_resolver:raises_on_unknown_names", "test_an_unknown_name_resolves_to_nothing", "FileNotFoundError"),
]
CONTROLS = [f"{kind}:{name}" for kind, names in broken_plugins.CONTROLS.items() for name in names]


@pytest.fixture
def with_broken_plugins() -> Iterator[Registry]:
    """The process registry (the kit's) with the broken plugin in it, for in-process runs."""
    registry = get_registry()
    with registry.plugin(broken_plugins, "broken-plugins"):
        yield registry


class Reports:
    """A pytest plugin object keeping every test report of a run."""

    def __init__(self) -> None:
        self.all: list[pytest.TestReport] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.all.append(report)

    def outcome(self, what: str) -> list[pytest.TestReport]:
        return [r for r in self.all if getattr(r, what) and (r.when == "call" or not r.passed)]


FAILED_WITHIN_HERE = 2.0  # seconds the kit waits for failed() after a SIGKILL when the fault is that it never says


def run_kit(*args: str) -> tuple[int, Reports]:
    """The kit in this process, as ``pytest --pyargs modserve.testing.conformance *args``."""
    reports = Reports()
    code = pytest.main(["--pyargs", kit.PACKAGE, "-p", "no:cacheprovider", "-q", *args], plugins=[reports])
    return int(code), reports


def test_every_planted_fault_is_checked() -> None:
    targets = {t for t, _, _ in FAULTS}
    broken = {f"{kind}:{name}" for kind, names in broken_plugins.BROKEN.items() for name in names}
    assert targets == broken, (
        f"registered, not checked: {broken - targets}; checked, not registered: {targets - broken}")


def test_every_kit_test_is_shown_to_fail_on_some_fault() -> None:
    """No kit test that cannot fail: each is the one a planted fault selects."""
    kit_tests = {node.name for path in KIT.glob("test_*.py") for node in ast.parse(path.read_text()).body
                 if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    selected = {name for name in kit_tests for _, expr, _ in FAULTS if expr.split(" and ")[0] in name}
    assert kit_tests - selected == set(), f"kit tests no planted fault shows failing: {sorted(kit_tests - selected)}"


@pytest.mark.parametrize("target,select,reason", FAULTS, ids=[f"{t}-{k.split()[0]}" for t, k, _ in FAULTS])
def test_the_kit_fails_a_planted_fault(with_broken_plugins: Registry, monkeypatch: pytest.MonkeyPatch,
                                       tmp_path: Path, target: str, select: str, reason: str) -> None:
    monkeypatch.chdir(tmp_path)
    if target == "executor:failed_never_says":  # the kit (imported once, run in-process) reads it per test
        monkeypatch.setattr(kit_executor, "FAILED_WITHIN", FAILED_WITHIN_HERE)
    code, reports = run_kit("--modserve-conformance", target, "-k", select)
    ran, failed = reports.outcome("passed") + reports.outcome("failed"), reports.outcome("failed")
    assert ran, f"-k {select!r} selected no kit test for {target}"
    assert failed and code == pytest.ExitCode.TESTS_FAILED, (
        f"the kit passed {target} ({select}): the planted fault went unnoticed")
    assert all(f"[{target}" in r.nodeid for r in ran), "a test of another implementation ran"
    texts = [r.longreprtext for r in failed]
    assert any(re.search(reason, t) for t in texts), (
        f"{target} failed, but not for the planted reason /{reason}/:\n" + texts[0][-3000:])


def test_the_kit_passes_the_builtins_through_the_same_plugin(with_broken_plugins: Registry,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    code, reports = run_kit(*[a for target in CONTROLS for a in ("--modserve-conformance", target)])
    failed = reports.outcome("failed")
    assert not failed, "the kit failed a built-in: " + "\n".join(r.longreprtext[-2000:] for r in failed)
    assert code == pytest.ExitCode.OK
    for target in CONTROLS:
        assert any(f"[{target}" in r.nodeid for r in reports.outcome("passed")), f"no kit test passed for {target}"


# target -> (its options, kit tests passed, skipped): uni refuses two ranks. NOTE: not mp (three
# engines of two ranks): the suite's run of the kit itself (modserve/testing/conformance is a test
# path) checks it under its own name, and quick_mp through the plugin above.
BUILTIN_EXECUTORS = {"executor:uni": (None, 1, 5)}


def run_executor_kit(target: str, options: dict | None) -> Reports:
    args = ["--modserve-conformance", target]
    if options is not None:
        args += ["--modserve-conformance-options", f"{target}={json.dumps(options)}"]
    code, reports = run_kit(*args)
    failed = reports.outcome("failed")
    assert not failed, f"the kit failed {target}: " + "\n".join(r.longreprtext[-2000:] for r in failed)
    assert code == pytest.ExitCode.OK
    return reports


@pytest.mark.parametrize("target", list(BUILTIN_EXECUTORS))
def test_the_kit_passes_the_builtin_executors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, target: str) -> None:
    """The built-ins under their own names (the process registry, no plugin added: a worker
    imports what the driver registered)."""
    monkeypatch.chdir(tmp_path)
    options, passed, skipped = BUILTIN_EXECUTORS[target]
    reports = run_executor_kit(target, options)
    assert (len(reports.outcome("passed")), len(reports.outcome("skipped"))) == (passed, skipped), \
        [(r.nodeid, r.outcome) for r in reports.all if r.when == "call" or not r.passed]
    assert multiprocessing.active_children() == []


def test_targets_select_one_kind_and_deselect_the_others(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code, reports = run_kit("--modserve-conformance", "kv_allocator:contiguous", "-k", "all_or_nothing",
                            "-v")  # with run_kit's -q: the default verbosity, which prints the header
    out = capsys.readouterr().out
    assert code == pytest.ExitCode.OK
    assert [r.nodeid.split("::")[1] for r in reports.outcome("passed")] == [
        "test_allocate_is_all_or_nothing[kv_allocator:contiguous-4]",
        "test_allocate_is_all_or_nothing[kv_allocator:contiguous-16]"]
    assert "modserve conformance: kv_allocator:contiguous (kit tests of other kinds are deselected)" in out
    assert re.search(r"2 passed, \d+ deselected", out), out


def test_options_reach_the_implementation(with_broken_plugins: Registry, monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    """An implementation whose options have a required field is skipped, saying how to pass them,
    and runs with them (the built-in draft_model gets its draft checkpoint from the kit)."""
    monkeypatch.chdir(tmp_path)
    target, select = "proposer:draft_model_copy", "fit_what_was_asked"
    _, reports = run_kit("--modserve-conformance", target, "-k", select)
    [skipped] = reports.outcome("skipped")
    assert f"pass them with --modserve-conformance-options '{target}={{...}}'" in skipped.longrepr[2]
    draft = str(cached_checkpoint("llama", "tiny"))
    code, reports = run_kit("--modserve-conformance", target, "-k", select,
                            "--modserve-conformance-options", f'{target}={{"model": "{draft}"}}')
    assert code == pytest.ExitCode.OK and len(reports.outcome("passed")) == 1


@pytest.mark.parametrize("args,message", [
    (["--modserve-conformance", "attention_backend:nope"],
     "*attention_backend:nope: unknown attention_backend 'nope'; available: paged, reference*"),
    (["--modserve-conformance", "platform:cpu"],
     "*the conformance kit has no tests for kind 'platform'; kinds it checks: attention_backend, kv_allocator, "
     "scheduler, sampler, grammar_backend, quantizer, proposer, executor*"),
    (["--modserve-conformance", "paged"],
     "*--modserve-conformance takes KIND:NAME (e.g. attention_backend:paged), got 'paged'*"),
    (["--modserve-conformance", "sampler:default", "--modserve-conformance-options", "proposer:ngram={}"],
     "*--modserve-conformance-options names proposer:ngram, which no --modserve-conformance selects*"),
    (["--modserve-conformance-options", "proposer:ngram={max_ngram: 2}"],
     "*--modserve-conformance-options proposer:ngram: the options are not valid JSON*"),
], ids=["unknown-name", "unknown-kind", "no-kind", "options-not-selected", "options-not-json"])
def test_bad_targets_are_usage_errors_listing_what_exists(pytester: pytest.Pytester, args: list[str],
                                                          message: str) -> None:
    result = pytester.runpytest("--pyargs", kit.PACKAGE, "-p", "no:cacheprovider", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_the_plugin_leaves_other_tests_alone(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain="import pytest\n@pytest.mark.parametrize('implementation', [1, 2])\n"
                                   "def test_plain(implementation):\n    assert implementation\n")
    plain = pytester.runpytest("-p", "no:cacheprovider")
    plain.assert_outcomes(passed=2)
    assert "modserve conformance" not in plain.stdout.str()
    targeted = pytester.runpytest("-p", "no:cacheprovider", "--modserve-conformance", "sampler:default")
    targeted.assert_outcomes(passed=2)  # not a kit test: never deselected


def test_run_invokes_the_kit(with_broken_plugins: Registry, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    quiet = ["-q", "-p", "no:cacheprovider", "-k", "all_or_nothing"]
    assert kit.run(["kv_allocator:paged"], quiet) == pytest.ExitCode.OK
    assert kit.run(["kv_allocator:partial_on_failure"], quiet) == pytest.ExitCode.TESTS_FAILED


def test_a_third_party_distribution_is_checked_in_a_fresh_process(tmp_path: Path) -> None:
    """The plugin installed as a distribution (entry points found by importlib.metadata),
    allowed by MODSERVE_LOAD_PLUGINS, and the kit run as its author would run it."""
    shutil.copy(Path(broken_plugins.__file__), tmp_path / "broken_plugins.py")
    info = tmp_path / "broken_plugins-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugins\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[modserve]\nbroken = broken_plugins\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "MODSERVE_LOAD_PLUGINS": "broken-plugins"}
    cmd = [sys.executable, "-m", "pytest", "--pyargs", kit.PACKAGE, "-p", "no:cacheprovider", "-q", "-rfp",
           "--modserve-conformance", "sampler:greedy_not_argmax", "--modserve-conformance", "sampler:default_copy"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, out
    lines = out.splitlines()
    failed = [line for line in lines if line.startswith("FAILED")]
    passed = [line for line in lines if line.startswith("PASSED")]
    assert failed and all("sampler:greedy_not_argmax" in line for line in failed), out
    assert any("test_greedy_rows_take_the_argmax" in line for line in failed), out
    assert any("sampler:default_copy" in line for line in passed), out
