"""Embeddings: the pooling runner (``runner: pooling``), ``LLM.embed`` and ``POST /v1/embeddings``.

The oracle is sentence-transformers on the same random weights, in float32: a tiny Qwen2
checkpoint made a sentence-transformers model by its ``modules.json`` (the checkpoint itself as
the Transformer, a Pooling module with last-token or mean pooling, Normalize), whose
``encode`` modserve's vectors must equal within 1e-5; offline, then through a real
``modserve serve`` process and the official openai client.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from server_process import serving

from modserve import LLM, PoolingParams
from modserve.vllm_compat import engine_config

TOL = 1e-5
TEXTS = ["The quick brown fox jumps over the lazy dog", "café naïve 日本語 😀 and then", "a",
         "one two three four five six seven eight nine ten eleven twelve"]
ST_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens"}


def st_dir(src: str, out: Path, mode: str, normalize: bool = True, **config: object) -> str:
    """``src`` (a CausalLM checkpoint) as a sentence-transformers model: Transformer at the root,
    Pooling (``mode``), and Normalize; ``config``: keys added to its config.json."""
    shutil.copytree(src, out)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (out / "2_Normalize").mkdir()
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    hidden = json.loads((out / "config.json").read_text())["hidden_size"]
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": hidden,
                                                               ST_MODES[mode]: True}))
    if config:
        (out / "config.json").write_text(json.dumps({**json.loads((out / "config.json").read_text()), **config}))
    return str(out)


def st_encode(path: str, texts: list[str], **kwargs):
    """sentence-transformers' ``encode``: [N, hidden] float32, or with ``output_value="token_embeddings"``
    each text's [len, hidden] before pooling."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")  # the checkpoint is float32
    return model.encode(texts, convert_to_tensor=True, **kwargs)


@pytest.fixture(scope="module")
def qwen2_dir(checkpoint_dir) -> str:
    return checkpoint_dir("qwen2")


@pytest.fixture(scope="module")
def st_models(qwen2_dir, tmp_path_factory) -> dict[str, tuple[str, torch.Tensor]]:
    """Per pooling mode (a sentence-transformers model dir, its ``encode(TEXTS)``)."""
    root = tmp_path_factory.mktemp("st")
    paths = {mode: st_dir(qwen2_dir, root / mode, mode) for mode in ST_MODES}
    return {mode: (path, st_encode(path, TEXTS)) for mode, path in paths.items()}


@pytest.fixture(scope="module", params=list(ST_MODES))
def model(request, st_models) -> tuple[str, torch.Tensor]:
    return st_models[request.param]


def make_llm(path: str, **overrides) -> LLM:
    return LLM(path, runner="pooling", dtype="float32", max_model_len=128, progress=False, **overrides)


def as_tensor(outputs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outputs])


# -- offline --------------------------------------------------------------------------------------


def test_embed_matches_sentence_transformers(model):
    path, ref = model
    with make_llm(path) as llm:
        got = as_tensor(llm.embed(TEXTS))
        assert got.shape == ref.shape
        assert (got - ref).abs().max() < TOL
        ids = [llm.get_tokenizer().encode(t) for t in TEXTS]
        by_ids = llm.embed([{"prompt_token_ids": p} for p in ids])
        assert [o.prompt_token_ids for o in by_ids] == ids
        assert (as_tensor(by_ids) - ref).abs().max() < TOL
        encoded = llm.encode(TEXTS[0])  # vLLM's encode: the vector as a tensor
        assert (encoded[0].outputs.data - ref[0]).abs().max() < TOL


def test_batches_split_by_the_step_budget_give_the_same_vectors(model):
    path, ref = model
    with make_llm(path, max_num_seqs=2, max_num_batched_tokens=32) as llm:  # several batches
        assert (as_tensor(llm.embed(TEXTS * 3)) - ref.repeat(3, 1)).abs().max() < TOL


def test_a_plain_decoder_pools_its_last_token_normalized(qwen2_dir, st_models):
    _, ref = st_models["last"]
    with make_llm(qwen2_dir) as llm:  # no sentence-transformers files: LAST and normalize
        assert (as_tensor(llm.embed(TEXTS)) - ref).abs().max() < TOL


def test_a_checkpoint_sentence_transformers_saved(checkpoint_dir, tmp_path):
    """As sentence-transformers saves a decoder: ``LlamaModel`` weights (no ``model.`` prefix, no
    LM head) and its v6 Pooling config (``pooling_mode: mean``)."""
    from sentence_transformers import SentenceTransformer, models

    body = models.Transformer(checkpoint_dir("llama"))
    pool = models.Pooling(body.get_word_embedding_dimension(), pooling_mode="mean")
    SentenceTransformer(modules=[body, pool, models.Normalize()], device="cpu").save(str(tmp_path / "st"))
    config = json.loads((tmp_path / "st" / "sentence_bert_config.json").read_text())
    # NOTE: else sentence-transformers 6 runs a text through the tiny tokenizer's chat template
    # first; an embeddings server (vLLM's too) embeds the text as it is.
    config["modality_config"].pop("message", None)
    (tmp_path / "st" / "sentence_bert_config.json").write_text(json.dumps(config))
    assert json.loads((tmp_path / "st" / "config.json").read_text())["architectures"] == ["LlamaModel"]
    ref = st_encode(str(tmp_path / "st"), TEXTS)
    with make_llm(str(tmp_path / "st")) as llm:
        assert (as_tensor(llm.embed(TEXTS)) - ref).abs().max() < TOL


def test_pooler_config_wins_over_the_checkpoint(model):
    path, _ = model
    token_rows = st_encode(path, TEXTS, output_value="token_embeddings")  # per text [len, hidden], pre-pooling
    with make_llm(path, pooler_config={"pooling_type": "MEAN", "normalize": False}) as llm:
        got = as_tensor(llm.embed(TEXTS))
    assert (got - torch.stack([rows.float().mean(0) for rows in token_rows])).abs().max() < TOL


def test_dimensions_only_for_a_matryoshka_model(qwen2_dir, tmp_path):
    path = st_dir(qwen2_dir, tmp_path / "m", "last", is_matryoshka=True)
    token_rows = st_encode(path, TEXTS, output_value="token_embeddings")
    want = torch.nn.functional.normalize(torch.stack([rows[-1, :16].float() for rows in token_rows]), dim=-1)
    with make_llm(path) as llm:
        got = as_tensor(llm.embed(TEXTS, PoolingParams(dimensions=16)))
    assert got.shape == (len(TEXTS), 16) and (got - want).abs().max() < TOL  # cut, then normalized
    with make_llm(qwen2_dir) as llm, pytest.raises(ValueError, match="matryoshka"):
        llm.embed(TEXTS, PoolingParams(dimensions=16))


def test_generate_and_embed_each_refuse_the_other_runner(qwen2_dir):
    with make_llm(qwen2_dir) as llm, pytest.raises(ValueError, match="embed"):
        llm.generate("Hello")
    with LLM(qwen2_dir, dtype="float32", max_model_len=128, num_kv_blocks=16, progress=False) as llm:
        with pytest.raises(ValueError, match="--runner pooling"):
            llm.embed("Hello")


def test_vllm_spellings(qwen2_dir):
    from modserve import cli

    args = cli.build_parser().parse_args(["serve", qwen2_dir, "--runner", "pooling", "--pooler-config",
                                          '{"pooling_type": "MEAN", "normalize": false}'])
    config = cli.config_from_args(args)
    assert config.runner == "pooling"
    assert config.pooler_config.pooling_type == "MEAN" and config.pooler_config.normalize is False
    assert cli.config_from_args(cli.build_parser().parse_args(["serve", qwen2_dir, "--task", "embed"])).runner \
        == "pooling"
    assert engine_config({"model": qwen2_dir, "task": "embed"}).runner == "pooling"
    with pytest.raises(ValueError, match="pooling_type"):
        engine_config({"model": qwen2_dir, "pooler_config": {"pooling_type": "MAX"}})
    with pytest.raises(ValueError, match="task"):
        engine_config({"model": qwen2_dir, "task": "classify"})


# -- the server -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    path, ref = model
    runner = ("--task", "embed") if path.endswith("last") else ("--runner", "pooling")  # vLLM's two spellings
    with serving(tmp_path_factory.mktemp("embeddings"), "server", "--model", path, "--served-model-name", "emb",
                 *runner, "--max-model-len", "64", "--max-embedding-inputs", "8") as srv:
        yield srv, ref


def test_openai_client_gets_sentence_transformers_vectors(server):
    srv, ref = server
    client = srv.client()
    for encoding in ("float", "base64", openai.NOT_GIVEN):  # unless told, the client asks for base64 and decodes it
        out = client.embeddings.create(model="emb", input=TEXTS, encoding_format=encoding)
        assert [d.index for d in out.data] == list(range(len(TEXTS)))
        vectors = [np.frombuffer(base64.b64decode(d.embedding), "<f4").tolist() if encoding == "base64"
                   else d.embedding for d in out.data]
        assert (torch.tensor(vectors) - ref).abs().max() < TOL
    ids = httpx.post(f"{srv.url}/tokenize", json={"prompt": TEXTS[1]}).json()["tokens"]
    one = client.embeddings.create(model="emb", input=TEXTS[1])
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids)
    by_ids = client.embeddings.create(model="emb", input=[ids, ids[:1]])
    assert (torch.tensor(by_ids.data[0].embedding) - ref[1]).abs().max() < TOL
    assert by_ids.usage.prompt_tokens == len(ids) + 1 and by_ids.model == "emb"
    single_ids = client.embeddings.create(model="emb", input=ids)  # one token-id list: one input
    assert len(single_ids.data) == 1


@pytest.mark.parametrize("body, param, words", [
    ({"input": "word " * 100}, "input", "max_model_len"),  # the prompt-length limit completions have
    ({"input": list(range(64))}, "input", "max_model_len"),
    ({"input": ["a"] * 9}, "input", "max_embedding_inputs=8"),
    ({"input": "Hello", "dimensions": 8}, "dimensions", "matryoshka"),
    ({"input": []}, "input", "must be"),
    ({"input": [[10**9]]}, "input", "vocabulary"),
    ({"input": "Hello", "encoding_format": "int8"}, "encoding_format", ""),
])
def test_bad_requests_are_400_naming_the_field(server, body, param, words):
    srv, _ = server
    r = httpx.post(f"{srv.url}/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
def test_a_pooling_server_refuses_generation(server, path, body):
    srv, _ = server
    r = httpx.post(f"{srv.url}{path}", json=body)
    assert r.status_code == 400 and "pooling" in r.json()["error"]["message"], r.text


def test_a_generate_server_refuses_embeddings(qwen2_dir, tmp_path):
    with serving(tmp_path, "generate", "--model", qwen2_dir, "--max-model-len", "64", "--num-kv-blocks", "16") as srv:
        with pytest.raises(openai.BadRequestError, match="not served as an embedding model") as refused:
            srv.client().embeddings.create(model=qwen2_dir, input="Hello")
        assert refused.value.body["code"] == "model_not_supported"  # the route's answer, not the engine's
