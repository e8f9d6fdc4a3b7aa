"""KV connector: blocks saved layer by layer come back bit for bit, into other blocks.

One instance (role ``both``) over a small paged cache of 3 layers of which it owns 2 (as a
pipeline stage or a rank would: the other layer's tensor is empty), in float32, float16 and
fp8 bytes. Each test gets a namespace of its own, so a store shared between tests (files,
shared memory) never answers for another test's blocks.
"""

from __future__ import annotations

import uuid
from typing import Iterator

import pytest
import torch

from modserve.api import AttentionSpec, BlockTransfer, KVConnector, KVConnectorContext
from modserve.testing.conformance.targets import Implementation

CONFORMANCE_KIND = "kv_connector"
DTYPES = [torch.float32, torch.float16, torch.float8_e4m3fn]
pytestmark = [pytest.mark.usefixtures("modserve_one_thread"),
              pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))]

LAYERS = range(1, 3)  # of 3: layer 0 belongs to another stage
BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 8, 4, 2, 8


def caches(dtype: torch.dtype, fill: bool) -> list[torch.Tensor]:
    """[2, blocks, block_size, kv_heads, head_dim] per owned layer, random or zero; empty for layer 0."""
    shape = (2, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    made = [torch.empty(0, dtype=dtype)]
    for _ in LAYERS:
        t = torch.randn(shape) if fill else torch.zeros(shape)
        made.append(t.to(dtype))
    return made


@pytest.fixture
def connector(dtype: torch.dtype, implementation: Implementation) -> Iterator[KVConnector]:
    spec = AttentionSpec(num_layers=3, num_heads=4, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, scale=HEAD_DIM**-0.5,
                         block_size=BLOCK_SIZE, dtype=torch.float32, device=torch.device("cpu"),
                         kv_cache_dtype=dtype)
    made = implementation.create(KVConnectorContext("both", spec, LAYERS, f"kit-{uuid.uuid4().hex}"))
    made.register_kv_caches(caches(dtype, fill=False))
    yield made
    made.close()


def save(connector: KVConnector, source: list[torch.Tensor], transfers: list[BlockTransfer]) -> None:
    """What the core does in a step that saves: each layer as it is written, then finish."""
    for layer in LAYERS:
        connector.save_layer(layer, source[layer], transfers)
    connector.finish_saves()


def keys(n: int) -> list[str]:
    return [uuid.uuid4().hex * 2 for _ in range(n)]  # 64 hex digits, like the core's


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_saved_blocks_load_back_bit_for_bit_into_other_blocks(connector: KVConnector) -> None:
    dtype = connector.kv_caches[1].dtype
    source = caches(dtype, fill=True)
    k = keys(3)
    save(connector, source, [BlockTransfer(k[0], 1), BlockTransfer(k[1], 3), BlockTransfer(k[2], 4)])
    assert connector.stored_blocks(k) == 3, "stored_blocks must count the blocks just saved"
    failed = connector.load([BlockTransfer(k[0], 6), BlockTransfer(k[1], 0), BlockTransfer(k[2], 2)])
    assert failed == [], f"load() of blocks just saved reported failures: {failed}"
    for layer in LAYERS:
        cache = connector.kv_caches[layer]
        for src, dst in ((1, 6), (3, 0), (4, 2)):
            assert same_bytes(cache[:, dst], source[layer][:, src]), (
                f"layer {layer}: block {src} saved, loaded into block {dst}, came back different")
        for untouched in (1, 3, 4, 5, 7):
            assert not cache[:, untouched].float().any(), f"layer {layer}: load() wrote block {untouched}"
    assert connector.kv_caches[0].numel() == 0, "the connector must leave other ranks' layers alone"


def test_stored_blocks_is_the_leading_run_it_holds(connector: KVConnector) -> None:
    source = caches(connector.kv_caches[1].dtype, fill=True)
    k = keys(4)
    save(connector, source, [BlockTransfer(k[0], 0), BlockTransfer(k[2], 1)])
    assert connector.stored_blocks(k) == 1, "k[1] is missing: only the blocks before it count"
    assert connector.stored_blocks(k[2:3]) == 1
    assert connector.stored_blocks(keys(2)) == 0
    assert connector.stored_blocks([]) == 0


def test_a_block_it_does_not_hold_fails_alone(connector: KVConnector) -> None:
    source = caches(connector.kv_caches[1].dtype, fill=True)
    k = keys(2)
    save(connector, source, [BlockTransfer(k[0], 2), BlockTransfer(k[1], 5)])
    failed = connector.load([BlockTransfer(k[0], 0), BlockTransfer(keys(1)[0], 1), BlockTransfer(k[1], 3)])
    assert failed == [1], f"load() must return the index of the block it lacks (1), got {failed}"
    for layer in LAYERS:
        assert same_bytes(connector.kv_caches[layer][:, 0], source[layer][:, 2])
        assert same_bytes(connector.kv_caches[layer][:, 3], source[layer][:, 5])


def test_a_save_is_a_copy_of_the_block_as_it_was_written(connector: KVConnector) -> None:
    """Once the step ends the engine may reuse a saved block for other tokens: what loads is
    what the block held when it was saved. The same key saved again (a prompt recomputed
    after a preemption) holds the same content and loads it."""
    dtype = connector.kv_caches[1].dtype
    source = caches(dtype, fill=True)
    saved = [c.clone() for c in source]
    k = keys(2)
    save(connector, source, [BlockTransfer(k[0], 1), BlockTransfer(k[1], 2)])
    for layer in LAYERS:  # the blocks go to other sequences
        source[layer][:, 1:3] = torch.randn(source[layer][:, 1:3].shape).to(dtype)
    save(connector, saved, [BlockTransfer(k[0], 1)])
    assert connector.load([BlockTransfer(k[0], 4), BlockTransfer(k[1], 5)]) == []
    for layer in LAYERS:
        for src, dst in ((1, 4), (2, 5)):
            assert same_bytes(connector.kv_caches[layer][:, dst], saved[layer][:, src]), (
                f"layer {layer}: block {src} loaded what the cache held after the save, not at it: a save must "
                "copy the block, not keep a view of the cache")


def test_a_step_whose_save_layer_raised_stores_no_half_block(connector: KVConnector) -> None:
    """After a ``save_layer`` that raised the core offers none of the step's later layers and
    still calls ``finish_saves``: a block missing a layer must not be stored (it would load as
    KV of its prompt), and the next step saves as usual."""
    source = caches(connector.kv_caches[1].dtype, fill=True)
    k = keys(2)
    connector.save_layer(LAYERS[0], source[LAYERS[0]], [BlockTransfer(k[0], 1)])  # the last layer never comes
    connector.finish_saves()
    assert connector.stored_blocks(k[:1]) == 0, (
        "finish_saves() stored a block one of whose layers save_layer never took: store only whole blocks")
    save(connector, source, [BlockTransfer(k[1], 2)])
    assert connector.stored_blocks(k[1:]) == 1, "a step after a failed one must save as usual"
