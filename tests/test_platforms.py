"""Platforms: the device-specific rules behind one plugin kind. A third platform registered
in-process is chosen by ``platform:`` and used by the engine with no change to the core."""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys
import types

import pytest
import torch

from modserve import LLM, SamplingParams
from modserve.core.hookspecs import hookimpl
from modserve.core.contracts.platform import FinishedModel, ModelLoad
from modserve.runner.linear import LMHead, Unquantized, float_layers
from modserve.core.registry import PluginError, Registry
from modserve.plugins.platforms.cpu.linear import CpuLinear
from modserve.plugins.platforms.cpu.platform import CpuPlatform
from modserve.plugins.platforms.cuda.platform import CudaPlatform

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog", "one two three four five six seven"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


class PlainLinear(Unquantized):
    """``F.linear`` on the weights as loaded, counting its calls."""

    calls = 0

    def apply(self, layer, x):
        PlainLinear.calls += 1
        return super().apply(layer, x)


class PlainCpu(CpuPlatform):
    """The cpu platform with another linear method: plain ``F.linear``, nothing added after loading."""

    finished = 0

    def linear_method(self) -> Unquantized:
        return PlainLinear()

    def finish_model(self, model, load) -> FinishedModel:
        PlainCpu.finished += 1
        return FinishedModel(compiled=False)


def builtin_registry() -> Registry:
    reg = Registry()
    reg.load_entrypoints({"modserve"})
    return reg


def cpu_plain_plugin() -> types.SimpleNamespace:
    return types.SimpleNamespace(register_platforms=hookimpl(lambda register: register("cpu-plain", PlainCpu)))


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_builtin_platforms_and_the_device_picks_one(llama_dir):
    reg = builtin_registry()
    assert reg.names("platform") == ["cpu", "cuda"]
    engine = LLM(llama_dir, num_kv_blocks=256, registry=reg, progress=False).engine
    assert engine.config.platform is None and type(engine.platform) is CpuPlatform
    assert engine.runner.platform is engine.platform
    layers = float_layers(engine.runner.model)
    assert engine.runner.model.lm_head in layers  # the head is made by the linear factory too
    assert {type(m.quantizer) for m in layers} == {CpuLinear}


def test_a_third_platform_is_used_without_any_core_change(llama_dir):
    reg = builtin_registry()
    want = tokens(LLM(llama_dir, num_kv_blocks=256, registry=reg, progress=False))
    with reg.plugin(cpu_plain_plugin(), "test-cpu-plain", distribution="test-platforms", version="0.1"):
        PlainLinear.calls = PlainCpu.finished = 0
        llm = LLM(llama_dir, platform="cpu-plain", num_kv_blocks=256, registry=reg, progress=False)
        assert type(llm.engine.platform) is PlainCpu and PlainCpu.finished == 1
        model = llm.engine.runner.model
        assert isinstance(model.lm_head, LMHead)
        assert {type(m.quantizer) for m in float_layers(model)} == {PlainLinear}
        assert tokens(llm) == want
        # every step: the layers' four projections and the head, through the platform's method
        assert PlainLinear.calls >= GREEDY.max_tokens * (4 * model.config.num_hidden_layers + 1)
    assert "cpu-plain" not in reg.names("platform")


def test_an_unknown_platform_lists_the_known_ones(llama_dir):
    with pytest.raises(ValueError, match=r"unknown platform 'tpu'; available: cpu, cuda"):
        LLM(llama_dir, platform="tpu", num_kv_blocks=256, progress=False)


def test_a_platform_refuses_a_device_of_another_type(llama_dir):
    with pytest.raises(PluginError, match=r"platform 'cpu' .* the cpu platform runs on device cpu, not cuda"):
        LLM(llama_dir, device="cuda", platform="cpu", num_kv_blocks=256, progress=False)


def test_cpu_dtype_auto_keeps_float32_activations_and_says_so(caplog):
    platform = CpuPlatform(torch.device("cpu"))
    with caplog.at_level("INFO", logger="modserve"):
        assert platform.resolve_dtype("auto", torch.bfloat16) == torch.float32
    assert "dtype auto: float32 activations (checkpoint is torch.bfloat16)" in caplog.text
    assert platform.resolve_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert platform.available_memory() > 0


def test_cuda_rules_hold_without_a_gpu(caplog):
    platform = CudaPlatform(torch.device("cuda"))
    assert platform.resolve_dtype("auto", torch.bfloat16) == torch.bfloat16  # the checkpoint's
    assert platform.linear_method() is None  # the runner's default: a plain GEMM
    load = ModelLoad("auto", "auto", "auto", torch.bfloat16, torch.bfloat16, quantized=False)
    with caplog.at_level("INFO", logger="modserve"):
        assert platform.finish_model(torch.nn.Module(), load) == FinishedModel(compiled=False)
    assert "compile auto: off (0 MiB of weights: compiling would take longer than it saves)" in caplog.text
    # auto compiles a model of 64 MiB or more, unquantized or with a quantizer whose apply traces
    assert platform.compile_wanted("auto", 64 * 2**20, quantized=False)
    assert not platform.compile_wanted("auto", 64 * 2**20 - 1, quantized=False)
    assert not platform.compile_wanted("auto", 2**30, quantized=True)
    assert platform.compile_wanted("auto", 2**30, quantized=True, traceable=True)  # e.g. int8's C++ op
    assert platform.compile_wanted("on", 0, quantized=True) and not platform.compile_wanted("off", 2**30, False)
    assert "prepack_weights auto: off (packed weights are for CPU GEMMs, not cuda)" in caplog.text
    with pytest.raises(ValueError, match="prepack_weights: on, but packed weights are for CPU GEMMs, not cuda"):
        platform.finish_model(torch.nn.Module(), dataclasses.replace(load, prepack_weights="on"))


@pytest.mark.parametrize("old, new, name", [
    ("modserve.core.models.llama", "modserve.plugins.models.llama", "LlamaForCausalLM"),
    ("modserve.core.models", "modserve.plugins.models", "register_model_architectures"),
    ("modserve.core.compile", "modserve.plugins.platforms.cpu.linear", "linear_or_gemv"),
    ("modserve.core.prepack", "modserve.plugins.platforms.cpu.prepack", "packed_linear"),
    ("modserve.core.cpu_kernels", "modserve.plugins.platforms.cpu.kernels", "load_kernel"),
    ("modserve.core.host_memory", "modserve.plugins.platforms.cpu.host_memory", "keep_freed_memory"),
    ("modserve.core.fp8", "modserve.api.fp8", "fp8_to_float"),
    ("modserve.quantizers.e4m3", "modserve.api.fp8", "to_fp8"),
    ("modserve.plugins.schedulers.base", "modserve.api", "advance_running"),
])
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # a shim's package warns too
def test_old_paths_stay_importable_and_warn(monkeypatch, old, new, name):
    monkeypatch.delitem(sys.modules, old, raising=False)  # import it afresh, so it warns here
    with pytest.warns(DeprecationWarning, match=f"{old} moved to"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_the_project_imports_no_deprecated_path(llama_dir):
    code = ("import sys, warnings\n"
            "warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    import modserve.server.app, modserve.bench.cli\n"
            "    from modserve import LLM, SamplingParams\n"
            "    LLM(sys.argv[1], num_kv_blocks=256, progress=False).generate(['hi'], SamplingParams(max_tokens=2))\n"
            "print([str(w.message) for w in seen if 'moved to' in str(w.message)])\n")
    run = subprocess.run([sys.executable, "-c", code, llama_dir], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"
