"""KV connectors that fail soft.

``shared_storage`` keeps its directory under ``max_gb``, deleting the least recently used
blocks (a load is a use), across restarts and other writers; a save that fails (a full disk,
a connector that raises) costs its blocks, never a request, and is counted and logged once
per kind; a load that fails under ``kv_load_failure_policy: fail`` ends its request with an
error that names the connector and the blocks, a 503 ``kv_load_failed`` over HTTP.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
from pathlib import Path

import openai
import pytest
import torch

from modserve import LLM
from modserve.api import BlockTransfer, KVConnectorContext, hookimpl
from modserve.core.registry import get_registry
from modserve.plugins.kv_connectors import shared_storage
from modserve.plugins.kv_connectors.host import HostMemoryConnector, HostMemoryOptions
from modserve.plugins.kv_connectors.shared_storage import SharedStorageConnector, SharedStorageOptions
from server_process import launch_healthy, stop
from test_kv_connectors import ENGINE, GREEDY, LENGTHS, PREFILL, llm_keys, prompts, stored_files, tokens

BLOCK = 16
SAVED_BLOCKS = sum(n // BLOCK for n in LENGTHS)


@pytest.fixture(scope="module")
def expected(llama_dir) -> list[list[int]]:
    with LLM(llama_dir, **ENGINE) as llm:
        return tokens(llm, prompts())


# -- shared_storage's bound --------------------------------------------------------------
LAYERS, BLOCK_FLOATS = 2, 4
FILE_BYTES = 4 + LAYERS * 2 * BLOCK_FLOATS * 4  # the CRC and [L, 2, 4] float32


def store(path: Path, blocks: int, role: str = "producer") -> SharedStorageConnector:
    """A connector on ``path`` bounded to ``blocks`` files, over a cache of 8 blocks per layer."""
    context = KVConnectorContext(role, None, range(LAYERS), "ns")
    conn = SharedStorageConnector(context, SharedStorageOptions(path=str(path), max_gb=blocks * FILE_BYTES / 2**30))
    conn.register_kv_caches([torch.randn(2, 8, BLOCK_FLOATS) for _ in range(LAYERS)])
    return conn


def save(conn: SharedStorageConnector, *keys: str) -> None:
    for key in keys:
        transfers = [BlockTransfer(key, int(key[1:]) % 8)]
        for layer in range(LAYERS):
            conn.save_layer(layer, conn.kv_caches[layer], transfers)
        conn.finish_saves()
        time.sleep(0.02)  # a file's mtime ticks coarsely (a jiffy): the next use must come later


def on_disk(path: Path) -> set[str]:
    return {p.stem for p in path.rglob("*.kv")}


def test_shared_storage_evicts_the_least_recently_used_past_max_gb(tmp_path):
    conn = store(tmp_path, 3)
    save(conn, "k1", "k2", "k3")
    assert conn.load([BlockTransfer("k1", 5)]) == []  # k1 is used: k2 is now the oldest
    time.sleep(0.02)
    save(conn, "k4")
    assert on_disk(tmp_path) == {"k1", "k3", "k4"}
    assert torch.equal(conn.kv_caches[1][:, 5], conn.kv_caches[1][:, 1])  # k1 came back whole
    assert conn.stats()["evicted_blocks"] == 1 and conn.stats()["stored_bytes"] == 3 * FILE_BYTES

    # A restart counts what is on disk, in the order of use: k3 is the oldest now.
    again = store(tmp_path, 3)
    assert again.stored_bytes == 3 * FILE_BYTES
    save(again, "k5")
    assert on_disk(tmp_path) == {"k1", "k4", "k5"}

    # A consumer reads and bounds nothing; its load is a use all the same.
    reader = store(tmp_path, 1, role="consumer")
    assert reader.load([BlockTransfer("k1", 0)]) == [] and on_disk(tmp_path) == {"k1", "k4", "k5"}
    time.sleep(0.02)
    save(store(tmp_path, 3), "k6")
    assert on_disk(tmp_path) == {"k1", "k5", "k6"}


def test_shared_storage_bound_holds_with_two_writers(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_storage, "RESCAN_S", 0.0)  # recount at every eviction
    first = store(tmp_path, 3)
    save(first, "k1", "k2", "k3")
    second = store(tmp_path, 3)  # counts the first's three
    save(second, "k4")
    assert on_disk(tmp_path) == {"k2", "k3", "k4"}
    save(first, "k5")  # its count is stale (k1 gone, k4 unknown): it recounts before evicting
    assert on_disk(tmp_path) == {"k3", "k4", "k5"}


def test_a_max_gb_below_one_block_is_refused(tmp_path):
    with pytest.raises(ValueError, match="max_gb .* holds not one block"):
        store(tmp_path, 0.5)


# -- saves that fail ---------------------------------------------------------------------
@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB tmpfs: room for a few of the tiny model's blocks (8 KiB each) and no more."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode:
        pytest.skip(f"a tmpfs cannot be mounted here (root with CAP_SYS_ADMIN): {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def one_at_a_time(llm: LLM) -> list[list[int]]:
    """Each prompt in steps of its own: a save per prompt with a full block (four of five)."""
    return [tokens(llm, [p])[0] for p in prompts()]


def save_failure_logs(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "are not stored" in r.getMessage()]


def test_a_full_disk_skips_the_saves_and_the_requests_go_on(llama_dir, tiny_disk, expected, caplog):
    conn = {"name": "shared_storage", "options": {"path": str(tiny_disk)}}
    with caplog.at_level(logging.WARNING, logger="modserve"):
        with LLM(llama_dir, kv_connector=conn, kv_role="producer", **ENGINE) as producer:
            assert one_at_a_time(producer) == expected  # no request failed
            failures = producer.engine.stats()["kv_connector_save_failures"]
    stored = len(stored_files(tiny_disk))
    assert 0 < stored < SAVED_BLOCKS and failures >= 2
    logged = save_failure_logs(caplog)
    assert len(logged) == 1, logged  # once per kind (finish_saves, OSError ENOSPC), however often
    assert "kv_connector 'shared_storage'" in logged[0] and "No space left on device" in logged[0]
    assert not list(tiny_disk.rglob("*.tmp"))  # no half-written file left to fill the disk
    with LLM(llama_dir, kv_connector=conn, kv_role="consumer", **ENGINE) as consumer:  # what was saved is whole
        assert tokens(consumer, prompts()) == expected


class RaisesOnSave:
    """A connector whose ``save_layer`` raises at the last layer (the first ones taken), or
    whose ``finish_saves`` always raises."""

    where = "save_layer"

    def save_layer(self, layer: int, kv_cache: torch.Tensor, transfers: list[BlockTransfer]) -> None:
        if self.where == "save_layer" and layer == self.context.layers[-1]:
            raise RuntimeError("planted save_layer fault")
        super().save_layer(layer, kv_cache, transfers)

    def finish_saves(self) -> None:
        if self.where == "finish_saves":
            raise RuntimeError("planted finish_saves fault")
        super().finish_saves()


class RaisingStore(RaisesOnSave, SharedStorageConnector):
    pass


class RaisingHost(RaisesOnSave, HostMemoryConnector):
    pass


class RaisingPlugin:
    @hookimpl
    def register_kv_connectors(self, register) -> None:
        register("raising_store", lambda: RaisingStore, options=SharedStorageOptions)
        register("raising_host", lambda: RaisingHost, options=HostMemoryOptions)


@pytest.mark.parametrize("where", ["save_layer", "finish_saves"])
def test_a_connector_that_raises_on_save_fails_no_request(llama_dir, tmp_path, expected, where, caplog,
                                                          monkeypatch):
    monkeypatch.setattr(RaisingStore, "where", where)
    conn = {"name": "raising_store", "options": {"path": str(tmp_path)}}
    with get_registry().plugin(RaisingPlugin(), "raising-store"), caplog.at_level(logging.WARNING, "modserve"):
        with LLM(llama_dir, kv_connector=conn, kv_role="producer", **ENGINE) as producer:
            assert one_at_a_time(producer) == expected
            stats = producer.engine.stats()
    assert stats["kv_connector_save_failures"] == 4  # each step that saved
    assert stats["kv_connector_bytes_saved"] == 0
    assert not stored_files(tmp_path)  # no block with a layer missing was stored
    logged = save_failure_logs(caplog)
    assert len(logged) == 1 and f"{where}() raised RuntimeError: planted" in logged[0], logged
    assert "kv_connector 'raising_store'" in logged[0]


# -- loads that fail -----------------------------------------------------------------------
def damaged_store(llama_dir: str, path: Path, ps: list[list[int]]) -> None:
    """A producer's blocks of prompts ``ps`` under ``path``, the fourth one of the last prompt corrupt."""
    with LLM(llama_dir, kv_connector={"name": "shared_storage", "options": {"path": str(path)}},
             kv_role="producer", **ENGINE) as producer:
        tokens(producer, ps, PREFILL)
    target = next(path.rglob(f"{llm_keys(ps[-1])[3]}.kv"))
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))


def test_a_failed_load_names_the_connector_and_the_blocks(llama_dir, tmp_path, expected):
    ps = prompts()
    damaged_store(llama_dir, tmp_path, ps[:3])  # the consumer's first step loads 2 + 4 + 6 blocks
    with LLM(llama_dir, kv_connector={"name": "shared_storage", "options": {"path": str(tmp_path)}},
             kv_role="consumer", kv_load_failure_policy="fail", **ENGINE) as consumer:
        outs = consumer.generate(ps[:3], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:2]] == expected[:2]
    assert outs[2].outputs[0].finish_reason == "error"
    assert outs[2].error == ("kv_connector shared_storage: 1 of 6 blocks could not be loaded for this request "
                             "(kv_load_failure_policy: fail)")
    assert outs[2].error_kind == "kv_load"


def test_a_failed_load_is_a_503_kv_load_failed_over_http(llama_dir, tmp_path, expected):
    ps = prompts()
    damaged_store(llama_dir, tmp_path, ps[:3])
    server = launch_healthy(tmp_path, "consumer", "--model", llama_dir, "--served-model-name", "m",
                            "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "512",
                            "--block-size", str(BLOCK), "--num-threads", "1", "--compile", "off",
                            "--kv-transfer-config", json.dumps({
                                "kv_connector": "SharedStorageConnector", "kv_role": "kv_consumer",
                                "kv_load_failure_policy": "fail",
                                "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}))
    try:
        client = server.client()
        with pytest.raises(openai.APIStatusError) as failed:
            client.completions.create(model="m", prompt=ps[2], max_tokens=4, temperature=0.0)
        assert failed.value.status_code == 503
        error = failed.value.body
        assert error["code"] == "kv_load_failed" and error["type"] == "server_error"
        assert error["message"].startswith("kv_connector shared_storage: 1 of 6 blocks could not be loaded")
        ok = client.completions.create(model="m", prompt=ps[1], max_tokens=12, temperature=0.0,
                                       extra_body={"ignore_eos": True})  # the server goes on
        assert ok.choices[0].finish_reason == "length"
        metrics = server.metrics()
        assert metrics["modserve_kv_blocks_used"] == 0  # the failed request's blocks too
        assert metrics["modserve_kv_connector_blocks_load_failed_total"] == 6  # its blocks, all dropped
    finally:
        stop(server)


def test_the_host_tier_publishes_no_block_a_failed_save_layer_left_half_copied(llama_dir, expected):
    conn = {"name": "raising_host", "options": {"num_blocks": 64}}
    with get_registry().plugin(RaisingPlugin(), "raising-store"):
        with LLM(llama_dir, kv_connector=conn, **ENGINE) as llm:
            assert one_at_a_time(llm) == expected
            assert llm.engine.stats()["kv_connector_host_blocks_used"] == 0
            llm.engine.allocator.reset_prefix_cache()
            assert one_at_a_time(llm) == expected  # nothing half copied is loaded
            stats = llm.engine.stats()
    assert stats["kv_connector_host_hit_blocks"] == 0 and stats["kv_connector_save_failures"] == 8
