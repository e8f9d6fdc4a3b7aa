"""Benchmarks, A/B comparison and capacity planning (``modserve bench|compare|plan``).

One job per module:

- ``workloads``: what to send (default ShareGPT sample, random, prefix-repetition, custom, ShareGPT)
- ``metrics``: percentiles, per-request results, SLOs and goodput, spreads over repeats
- ``pinning``: cores, threads and the repeat flags every benchmark shares
- ``offline``: throughput and single-stream latency through ``LLM.generate``, interleaved runners
- ``hf_baseline``: transformers ``generate`` on static left-padded batches
- ``serve_client``: the load generator for OpenAI-compatible servers
- ``compare``: A/B of two engine configs
- ``plan``: memory, KV and speed-of-light arithmetic; tensor- and pipeline-parallel communication
- ``collectives``: all-reduce and all-gather latency and bandwidth over real process groups
- ``report``: tables and figures
- ``cli``: the subcommands
"""
