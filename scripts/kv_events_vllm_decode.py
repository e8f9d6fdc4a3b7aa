"""Decode modserve's KV-cache event stream with vLLM's own event classes.

Runs an offline engine with ``kv_events_config`` (a small model of its own, prefix caching on, a
KV cache small enough to evict, then ``reset_prefix_cache``), records every batch the ZMQ PUB
socket sends, and hands the payloads to a Python that has vLLM installed, which decodes each
with ``msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)`` and rebuilds the set
of cached blocks from them. Prints what vLLM's decoder saw; exits non-zero on any decode error
or if the rebuilt set is not empty after the reset.

    .venv/bin/python scripts/kv_events_vllm_decode.py --vllm-python ../vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

VLLM_SIDE = r"""
import json, sys
import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
cached, counts = set(), {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
for payload in json.load(open(sys.argv[1])):
    batch = decoder.decode(bytes.fromhex(payload))
    for event in batch.events:
        counts[type(event).__name__] += 1
        if isinstance(event, BlockStored):
            cached.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= cached, f"removes a block never stored: {event}"
            cached.difference_update(event.block_hashes)
        else:
            cached.clear()
print(json.dumps({"batches": len(json.load(open(sys.argv[1]))), "events": counts, "cached_after": len(cached)}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def record_events(model: str, port: int) -> list[bytes]:
    from modserve.llm import LLM
    from modserve.sampling_params import SamplingParams

    llm = LLM(model=model, num_kv_blocks=24, block_size=4, max_model_len=64, num_threads=1,
              kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    time.sleep(1.0)  # a SUB that joins after a PUB sends misses it
    try:
        greedy = SamplingParams(max_tokens=4, temperature=0)
        shared = list(range(10, 26))
        for i in range(4):  # a shared prefix, then prompts of their own, more than the cache holds
            llm.generate([shared + [40 + i, 41 + i, 42 + i]], greedy, use_tqdm=False)
        for i in range(8):
            llm.generate([list(range(100 + 20 * i, 116 + 20 * i))], greedy, use_tqdm=False)
        llm.reset_prefix_cache()
        payloads = []
        while sub.poll(1000):
            _topic, _seq, payload = sub.recv_multipart()
            payloads.append(payload)
        return payloads
    finally:
        context.destroy(linger=0)
        llm.engine.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True, help="a Python with vLLM installed")
    ap.add_argument("--model", help="a checkpoint (default: a tiny random Llama of modserve.testing)")
    args = ap.parse_args()
    if args.model is None:
        from modserve.testing import cached_checkpoint
        args.model = str(cached_checkpoint("llama", "tiny"))
    payloads = record_events(args.model, free_port())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "events.json"
        path.write_text(json.dumps([p.hex() for p in payloads]))
        done = subprocess.run([args.vllm_python, "-c", VLLM_SIDE, str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"vLLM's decoder failed on modserve's events:\n{done.stderr[-3000:]}", file=sys.stderr)
        return 1
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"vLLM's KVEventBatch decoder read {seen['batches']} batches: {seen['events']}; "
          f"blocks cached after reset_prefix_cache: {seen['cached_after']}")
    ok = seen["events"]["BlockStored"] > 0 and seen["events"]["BlockRemoved"] > 0 and seen["cached_after"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
