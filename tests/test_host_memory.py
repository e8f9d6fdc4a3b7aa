"""A CPU engine's process reuses freed host memory: large buffers do not page-fault each step."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# torch's CPU allocator is a 64-byte posix_memalign and free; a prefill step makes and frees
# activations of tens of MB in turn. Called through ctypes, nothing else allocates between.
CHURN = """
import ctypes, resource, sys
from modserve import LLM
llm = LLM(sys.argv[1], dtype="float32", progress=False)
libc = ctypes.CDLL("libc.so.6")
libc.free.argtypes = [ctypes.c_void_p]
size = 30 << 20
def step():
    buffers = []
    for _ in range(4):
        p = ctypes.c_void_p()
        assert libc.posix_memalign(ctypes.byref(p), 64, size) == 0
        ctypes.memset(p, 1, size)
        buffers.append(p.value)
    for p in reversed(buffers):
        libc.free(p)
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_cpu_engine_keeps_freed_memory(llama_dir):
    # In a fresh process: glibc's thresholds are process-wide and this one's are set already.
    run = subprocess.run([sys.executable, "-c", CHURN, llama_dir], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    faults = [int(n) for n in run.stdout.split()[-10:]]
    pages = 4 * (30 << 20) // 4096  # a step that faults in every page it touches
    # glibc's bins take a few steps to settle on the pattern; after that, no step faults
    assert max(faults[5:]) < pages // 20, f"minor page faults per step: {faults} ({pages} pages touched a step)"
