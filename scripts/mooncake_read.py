"""How fast ``kv_connector: mooncake`` reads blocks over TCP (loopback): one connector of role
``both`` saves blocks into its pool, then reads them back with its transfer engine into other
cache blocks, as a consumer would from a producer (side-channel lookup and release included).

    python scripts/mooncake_read.py --layers 12 --blocks 128 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import torch

from modserve.api import AttentionSpec, BlockTransfer, KVConnectorContext
from modserve.plugins.kv_connectors.mooncake import MooncakeConnector, MooncakeOptions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    L, B = args.layers, args.blocks
    spec = AttentionSpec(num_layers=L, num_heads=args.kv_heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                         scale=1.0, block_size=args.block_size, dtype=torch.float32, device=torch.device("cpu"),
                         kv_cache_dtype=torch.float32)
    conn = MooncakeConnector(KVConnectorContext("both", spec, range(L), "bench"),
                             MooncakeOptions(bootstrap_port=0, num_blocks=B))
    # [K/V, blocks, block_size, kv_heads, head_dim] per layer: blocks [0, B) saved, [B, 2B) read into.
    caches = [torch.randn(2, 2 * B, args.block_size, args.kv_heads, args.head_dim) for _ in range(L)]
    conn.register_kv_caches(caches)
    seconds = []
    try:
        for _ in range(args.repeats):
            keys = [uuid.uuid4().hex * 2 for _ in range(B)]
            for layer in range(L):
                conn.save_layer(layer, caches[layer], [BlockTransfer(k, i) for i, k in enumerate(keys)])
            conn.finish_saves()
            start = time.perf_counter()
            assert conn.stored_blocks(keys) == B
            assert conn.load([BlockTransfer(k, B + i) for i, k in enumerate(keys)]) == []
            seconds.append(time.perf_counter() - start)
            assert all(torch.equal(c[:, B:], c[:, :B]) for c in caches)
    finally:
        conn.close()
    mib = B * conn.block_bytes / 2**20
    med = statistics.median(seconds)
    print(f"{B} blocks of {conn.block_bytes // 1024} KiB ({mib:.0f} MiB): median {med * 1e3:.0f} ms "
          f"[{min(seconds) * 1e3:.0f}-{max(seconds) * 1e3:.0f}], {mib / med:.0f} MiB/s")


if __name__ == "__main__":
    main()
