"""``modserve serve``: the OpenAI-compatible server under uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import logging
import os
import signal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from modserve.core.config import EngineConfig
    from modserve.engine.client import EngineClient

logger = logging.getLogger("modserve.server")

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
DP_ADDRESS, DP_RPC_PORT = "127.0.0.1", 29550  # vLLM's defaults of --data-parallel-address, -rpc-port
# vLLM's flags that size the KV cache: with one given, the demo model keeps the user's size.


def add_parsers(subparsers: Any) -> None:
    from modserve.cli import add_config_flags

    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API: `modserve serve MODEL`, as `vllm serve "
                    "MODEL`. With neither --config nor a model, serves the built-in demo model (a 5M-parameter "
                    "Llama trained on the King James Bible).")
    # None: not given here (a config file's host/port/api_key may give it), then the default.
    p.add_argument("--host", default=None, help=f"address to bind (default: {DEFAULT_HOST}; 0.0.0.0 for every "
                                                 "interface)")
    p.add_argument("--port", type=int, default=None, help=f"(default: {DEFAULT_PORT})")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $MODSERVE_API_KEY, else "
                        "$VLLM_API_KEY)")
    add_config_flags(p, positional_model=True)
    p.set_defaults(func=cmd_serve)


def stacks_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` prints every thread's stack to stderr (faulthandler): where a server
    that seems stuck is. Not where stderr is no file (a caller that captures it in memory)."""
    with contextlib.suppress(io.UnsupportedOperation, AttributeError, ValueError):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def cmd_serve(args: argparse.Namespace) -> int:
    # NOTE: torch, transformers and the app are imported only once the engine cores are started
    # (engine_client): the cores' imports and this process's then run at once.
    from modserve.cli import config_from_args
    from modserve.generation_defaults import GenerationDefaults
    from modserve.server.demo import use_demo_model

    stacks_on_sigusr1()
    if not args.config and args.cfg_model is None and args.model_tag is None:
        use_demo_model(args)
    config = config_from_args(args)  # a config file's host, port and api_key land on args here
    if config.grammar_compile_isolation != "process":  # a compile in a thread cannot be stopped
        logger.warning("grammar_compile_isolation=%s is for offline use: the server compiles grammars in "
                       "worker processes", config.grammar_compile_isolation)
        config = config.model_copy(update={"grammar_compile_isolation": "process"})
    if getattr(args, "vllm_headless", None):  # this machine's engine cores only (server/headless.py)
        from modserve.server.headless import run_headless

        if config.data_parallel_backend == "ray":
            raise SystemExit("--headless starts this machine's engine cores as processes: with "
                             "--data-parallel-backend ray, Ray places them (run ray start on this machine instead)")

        size_local, start_rank, address, rpc_port = dp_layout(args, config)
        return run_headless(config, size_local, start_rank, address, rpc_port)
    host, port = args.host or DEFAULT_HOST, int(args.port or DEFAULT_PORT)
    api_key = args.api_key or env_api_key()
    if args.host is None:
        logger.warning("listening on %s only (vLLM binds every interface): pass --host 0.0.0.0 to be reachable "
                       "from other machines or from outside a container", host)
    defaults = GenerationDefaults.of(config)  # read before the model loads: a bad file fails at once
    engine = engine_client(config, args)
    try:
        from modserve.server.app import create_app
        from modserve.server.run import run

        app = create_app(engine, api_key=api_key, generation_defaults=defaults)
        access_log = not getattr(args, "vllm_disable_uvicorn_access_log", None)
        return run(app, host, port, args.log_level, api_key, config, access_log=access_log)
    finally:  # drained and stopped, or failed to start: no engine process outlives the server
        engine.stop()
        engine.shutdown_engine()
        if config.data_parallel_backend == "ray":  # the cores' actors and placement groups, a cluster started here
            from modserve.server.ray_cores import shutdown_all

            shutdown_all()


def engine_client(config: EngineConfig, args: argparse.Namespace) -> EngineClient:
    """The engine(s) the server talks to: one engine-core process per data-parallel rank (each
    of tensor x pipeline parallel ranks), or, with vLLM's --disable-frontend-multiprocessing,
    engines stepping in threads of this process. --data-parallel-rank N serves that rank alone."""
    from modserve.server.core_launch import end_launches, launch_cores
    from modserve.server.rank_configs import replica_configs
    from modserve.server.remote_cores import RemoteRanks

    configs, first = replica_configs(config), 0
    rank = getattr(args, "vllm_data_parallel_rank", None)
    if rank is not None:  # external load balancing: this server is one rank of the set
        if not 0 <= rank < config.data_parallel_size:
            raise SystemExit(f"--data-parallel-rank {rank} is not a rank of --data-parallel-size "
                             f"{config.data_parallel_size}")
        configs, first = [configs[rank]], rank
    size_local, start_rank, address, rpc_port = dp_layout(args, config)
    remote = None
    if size_local < config.data_parallel_size and rank is None:  # the other ranks join from --headless nodes
        if start_rank != 0 or getattr(args, "vllm_disable_frontend_multiprocessing", None):
            raise SystemExit("--data-parallel-size-local below --data-parallel-size: the API server's node holds "
                             "ranks from 0 (--data-parallel-start-rank is for --headless nodes) in engine-core "
                             "processes (not --disable-frontend-multiprocessing)")
        from modserve.server.headless import node_configs

        remote = RemoteRanks(size_local, address, rpc_port, config)
        configs = node_configs(config, 0, size_local) + configs[size_local:]  # this machine's memory: its ranks'
    if config.data_parallel_backend == "ray":  # Ray places every rank (server/ray_cores.py)
        if remote is not None or rank is not None or getattr(args, "vllm_disable_frontend_multiprocessing", None):
            raise SystemExit("--data-parallel-backend ray places every rank itself: it takes no "
                             "--data-parallel-size-local, --data-parallel-rank or --disable-frontend-multiprocessing")
        from modserve.server.ray_cores import RayRanks

        remote = RayRanks(config, getattr(args, "vllm_data_parallel_address", None), rpc_port)
    if getattr(args, "vllm_disable_frontend_multiprocessing", None):
        from modserve.engine.engine import LLMEngine
        from modserve.server.async_engine import AsyncEngine

        engines: list[Any] = []
        try:
            for i, c in enumerate(configs, first):  # one after the other: each sizes its KV cache on what is left
                engines.append(LLMEngine(c, progress=False, dp_rank=i))
        except BaseException:
            for e in engines:
                e.shutdown()
            raise
        if len(engines) == 1:
            return AsyncEngine(engines[0])
    else:
        num_local = len(configs) if remote is None else remote.num_local
        launched = launch_cores(configs[:num_local], first)
        try:
            from modserve.server.engine_process import start_engine_processes
        except BaseException:
            end_launches(launched)
            raise
        try:  # from here start_engine_processes owns the launched cores (kills them if it fails)
            engines = start_engine_processes(configs, first_rank=first, remote=remote, launched=launched)
        except BaseException:
            if config.data_parallel_backend == "ray":
                from modserve.server.ray_cores import shutdown_all

                shutdown_all()
            raise
    if len(engines) > 1:
        from modserve.server.replicas import ReplicaSet

        return ReplicaSet(engines)
    return engines[0]


def dp_layout(args: argparse.Namespace, config: EngineConfig) -> tuple[int, int, str, int]:
    """vLLM's multi-node data parallel flags, defaulted as vLLM does: (ranks on this machine, the
    first of them, the API server's address, the handshake's port)."""
    size_local = getattr(args, "vllm_data_parallel_size_local", None)
    return (config.data_parallel_size if size_local is None else size_local,
            getattr(args, "vllm_data_parallel_start_rank", None) or 0,
            getattr(args, "vllm_data_parallel_address", None) or DP_ADDRESS,
            getattr(args, "vllm_data_parallel_rpc_port", None) or DP_RPC_PORT)


def env_api_key() -> str | None:
    """The key from the environment: ``MODSERVE_API_KEY``, else vLLM's ``VLLM_API_KEY`` (a server
    started as vLLM is must not come up open). The key itself is never logged."""
    ours, vllms = os.environ.get("MODSERVE_API_KEY") or None, os.environ.get("VLLM_API_KEY") or None
    if ours and vllms:
        logger.warning("MODSERVE_API_KEY and VLLM_API_KEY are both set: using MODSERVE_API_KEY")
    return ours or vllms
