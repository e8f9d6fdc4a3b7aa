"""The docs stay true: every config key and built-in plugin is documented."""

from pathlib import Path

from modserve.core.config import EngineConfig
from modserve.core.registry import Registry

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_every_config_key_is_in_the_configuration_reference():
    text = (DOCS / "configuration.md").read_text()
    missing = [name for name in EngineConfig.model_fields if f"`{name}`" not in text]
    assert not missing, f"docs/configuration.md does not describe: {missing}"


def test_every_builtin_plugin_is_in_the_configuration_reference():
    text = (DOCS / "configuration.md").read_text()
    reg = Registry()
    reg.load_entrypoints({"modserve"})
    missing = [f"{kind} {name}" for kind, regs in reg.registrations().items() if kind != "model_architecture"
               for name in regs if f"`{name}`" not in text]
    assert not missing, f"docs/configuration.md does not mention: {missing}"


def _python_blocks(name: str) -> list[str]:
    text = (DOCS / name).read_text()
    return [block.split("\n", 1)[1] for block in text.split("```")[1::2] if block.startswith("python\n")]


def test_plugin_examples_import_only_the_plugin_api():
    import ast

    for block in _python_blocks("writing-a-plugin.md"):
        tree = ast.parse(block)  # every example is valid Python
        modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        plugin_side = "def test_" not in block  # a test may use the host (LLM, Registry, testing)
        if plugin_side:
            past = [m for m in modules if m.startswith("modserve") and m != "modserve.api"]
            assert not past, f"a plugin example imports past modserve.api: {past}"


def test_the_documented_attention_backend_matches_the_reference():
    import torch

    from modserve.api import AttentionSpec, build_batch
    from modserve.attention_backends.reference import ReferenceAttention

    [block] = [b for b in _python_blocks("writing-a-plugin.md") if "class MyAttention" in b]
    namespace: dict = {}
    exec(compile(block, "writing-a-plugin.md", "exec"), namespace)
    torch.manual_seed(0)
    spec = AttentionSpec(num_layers=1, num_heads=8, num_kv_heads=2, head_dim=16, scale=0.25, block_size=4,
                         dtype=torch.float32, device=torch.device("cpu"))
    # (context, new tokens) per sequence: a decode, a prefill, a chunked prefill across blocks
    shape = [(9, 1), (0, 6), (5, 7)]
    tables = [[3, 7, 1], [0, 5], [2, 6, 4]]
    _, meta = build_batch([[0] * n for _, n in shape], [c for c, _ in shape], tables, spec.block_size,
                          spec.device)
    T = meta.num_tokens
    q, k, v = torch.randn(T, 8, 16), torch.randn(T, 2, 16), torch.randn(T, 2, 16)
    cache = torch.randn(2, 8, spec.block_size, 2, 16)  # earlier context: random, as if written before
    expected = ReferenceAttention(spec).forward(q, k, v, cache.clone(), meta, None)
    got = namespace["MyAttention"](spec).forward(q, k, v, cache.clone(), meta, None)
    torch.testing.assert_close(got, expected)
