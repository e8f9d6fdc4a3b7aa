"""The tensor/pipeline-parallel rendezvous port (vLLM's --master-port): fixed when configured,
one per data-parallel replica, else a free port."""

from __future__ import annotations

import socket

from modserve.cli import build_parser
from modserve.core.config import EngineConfig
from modserve.runner.ranks import rendezvous_port
from modserve.server.rank_configs import replica_configs
from server_process import free_port


def test_a_configured_master_port_is_the_rendezvous_and_each_replica_takes_its_own(llama_dir):
    port = free_port()
    args = build_parser().parse_args(["serve", llama_dir, "-tp", "2", "-dp", "2", "--master-port", str(port)])
    from modserve.cli import config_from_args

    config = config_from_args(args)
    assert rendezvous_port(config, "127.0.0.1") == port
    assert [rendezvous_port(c, "127.0.0.1") for c in replica_configs(config)] == [port, port + 1]


def test_without_master_port_the_rendezvous_is_a_free_port(llama_dir):
    config = EngineConfig(model=llama_dir, tensor_parallel_size=2)
    got = {rendezvous_port(config, "127.0.0.1") for _ in range(3)}
    for port in got:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: nobody holds it
    assert len(got) > 1  # not one fixed port
