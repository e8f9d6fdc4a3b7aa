"""``modserve quantize``: GPTQ's Hessian rounding and AWQ's scale and clip search on the tiny Llama.

What a user relies on: a calibrated checkpoint has less output error than round-to-nearest on
the same grid, AWQ's scaling leaves the float model as it was, and what is written is what was
computed (the engine's logits from the checkpoint equal transformers' with the solver's weights).
"""

from __future__ import annotations

import json

import pytest
import torch

from modserve.cli import main
from modserve.quantizers.calibration import quantize
from modserve.quantizers.calibration.capture import calibration_windows, layer_inputs
from modserve.quantizers.calibration.quantize import Settings, quantize_checkpoint

PARAGRAPH = ("The river rose in the spring and the farmers moved their herds to the high fields. "
             "In the autumn the water fell again, and the villages counted what the flood had left them: "
             "new soil on the lower terraces, a broken bridge, and fish in the ditches for a week. ")
G = 32  # the tiny model's hidden size is 64


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("calibration") / "text.txt"
    path.write_text("".join(f"{i}. {PARAGRAPH}" for i in range(60)))
    return path


def _settings(method: str, **kw) -> Settings:
    return Settings(method, group_size=G, num_samples=8, seq_len=64, **kw)


@pytest.fixture(scope="module")
def calibrated(llama_dir, text, tmp_path_factory):
    """(out dir, report) per method."""
    out = {}
    for name, settings in (("gptq", _settings("gptq")), ("gptq-act", _settings("gptq", desc_act=True)),
                           ("awq", _settings("awq"))):
        path = tmp_path_factory.mktemp(name)
        out[name] = path, quantize_checkpoint(llama_dir, path, text, settings, progress=False)
    return out


@pytest.mark.parametrize("name", ["gptq", "gptq-act"])
def test_gptq_has_less_output_error_than_rounding_to_nearest_on_every_linear(calibrated, name):
    _, report = calibrated[name]
    assert len(report.calibrated) == 2 * 7
    for linear, err in report.calibrated.items():
        assert err < 0.9 * report.rtn[linear], (linear, err, report.rtn[linear])


def test_awq_search_never_loses_to_rounding_to_nearest_and_wins_on_average(calibrated):
    _, report = calibrated["awq"]
    ratios = [report.calibrated[k] / report.rtn[k] for k in report.calibrated]
    assert max(ratios) < 1.02, ratios  # alpha 0 and clip ratio 1 are round to nearest itself
    assert sum(ratios) / len(ratios) < 0.95, ratios


def test_awq_scaling_alone_leaves_the_float_model_unchanged(llama_dir, text, monkeypatch):
    """The fold (norm weights / s, next linears * s; up_proj's rows / s, down_proj * s) with the
    final rounding taken out (the search still rounds, so it finds real scales): the model must
    compute what it did before."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    ids = calibration_windows(AutoTokenizer.from_pretrained(llama_dir), text, 2, 48)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    identity = lambda w, group_size: w.float()  # noqa: E731
    monkeypatch.setattr(quantize, "fake_quantize", identity)
    for i, layer in enumerate(model.model.layers):
        _, folds = quantize._awq_layer(layer, layer_inputs(model, ids, i), _settings("awq", clip=False))
        assert any(not torch.equal(s, torch.ones_like(s)) for s, _ in folds.values())  # it did scale
    with torch.no_grad():
        after = model(input_ids=ids).logits
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["gptq", "gptq-act", "awq"])
def test_the_engine_computes_what_the_solver_wrote(calibrated, name, text, llama_dir):
    """Prefill logits of the written checkpoint through the engine's awq/gptq plugin against
    transformers with the solver's dequantized weights (and AWQ's rescaled norms)."""
    from transformers import AutoTokenizer

    from modserve import LLM, SamplingParams

    path, report = calibrated[name]
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == name.split("-")[0] and config["group_size"] == G
    ids = calibration_windows(AutoTokenizer.from_pretrained(llama_dir), text, 1, 40)[0].tolist()
    with torch.no_grad():
        expected = torch.log_softmax(report.model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32, max_model_len=128, progress=False,
              quantization={"name": name.split("-")[0], "options": {"kernel": "dequant"}})
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)[0]
    got = torch.tensor([e["logprob"] for e in out.prompt_logprobs[1:]])
    torch.testing.assert_close(got, expected.gather(1, torch.tensor(ids[1:])[:, None])[:, 0], atol=1e-4, rtol=1e-4)


def test_act_order_writes_an_unsorted_g_idx_shared_by_fused_shards(calibrated):
    from safetensors.torch import load_file

    path, _ = calibrated["gptq-act"]
    tensors = load_file(path / "model.safetensors")
    g_idx = tensors["model.layers.0.self_attn.q_proj.g_idx"]
    assert not torch.equal(g_idx, torch.sort(g_idx).values)
    assert torch.equal(g_idx, tensors["model.layers.0.self_attn.v_proj.g_idx"])  # q, k, v read the same input
    assert torch.bincount(g_idx.long()).tolist() == [G] * (g_idx.numel() // G)


def test_cli_writes_a_checkpoint_and_names_what_is_wrong(llama_dir, text, tmp_path, capsys):
    out = tmp_path / "awq"
    assert main(["quantize", "--model", llama_dir, "--out", str(out), "--method", "awq", "--group-size", str(G),
                 "--calibration-text", str(text), "--num-samples", "4", "--seq-len", "64"]) == 0
    printed = capsys.readouterr().out
    assert "| mlp.down_proj |" in printed and "calibrated on 256 tokens" in printed
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    bad = [(["--method", "gptq"], "--calibration-text FILE is required"),
           (["--method", "gptq", "--calibration-text", str(tmp_path / "none.txt")], "none.txt does not exist"),
           (["--method", "gptq", "--calibration-text", str(text), "--seq-len", "100000"], "fewer than one window"),
           (["--method", "gptq", "--calibration-text", str(text), "--group-size", "48"], "--group-size 48 does not "),
           (["--method", "awq", "--bits", "8", "--calibration-text", str(text)], "awq writes 4-bit"),
           (["--method", "gptq", "--rtn", "--desc-act"], "--desc-act needs calibration")]
    for flags, message in bad:
        assert main(["quantize", "--model", llama_dir, "--out", str(tmp_path / "x"), "--group-size", str(G),
                     *flags][: None]) == 2, flags
        assert message in capsys.readouterr().err, flags
    assert main(["quantize", "--model", str(out), "--out", str(tmp_path / "y"), "--method", "gptq",
                 "--calibration-text", str(text), "--group-size", str(G)]) == 2
    assert "is already quantized (awq)" in capsys.readouterr().err
    rtn = tmp_path / "rtn"
    assert main(["quantize", "--model", llama_dir, "--out", str(rtn), "--method", "gptq", "--rtn",
                 "--group-size", str(G)]) == 0
    assert "round to nearest" in capsys.readouterr().out
    config = json.loads((rtn / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["bits"], config["group_size"]) == ("gptq", 4, G)
