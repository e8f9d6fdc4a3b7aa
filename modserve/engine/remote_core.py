"""What an engine-core process on another machine than its API server (``--headless``) does
besides what every core does: the handshake that gets its sockets' addresses, and ending
itself, with its workers, once its connection to the server drops.

NOTE: on the server's machine a core dies with the server through PR_SET_PDEATHSIG. Across
machines there is no parent to watch: the core watches its inbox's connection instead (ZMQ
socket monitor). The server's process ending closes it at once, and so does the server
closing that socket (it gave up on this core); the server's machine going silent closes it
after KEEPALIVE_TIMEOUT_S of unanswered ZMTP pings (answered by ZMQ's I/O thread, so a
server busy for minutes still answers them).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from modserve.engine import core_handshake as h
from modserve.engine.core_protocol import PROTOCOL_VERSION

logger = logging.getLogger("modserve.engine")

KEEPALIVE_EVERY_S = 1.0
KEEPALIVE_TIMEOUT_S = 10.0
WAIT_LOG_EVERY_S = 30.0
_watch: tuple[threading.Event, threading.Thread] | None = None


def handshake(context: zmq.Context, server: str, dp_rank: int, fingerprint: dict[str, str],
              timeout: float) -> h.Welcome:
    """The addresses the API server at ``server`` bound for this rank; exits the process (2) when
    the server refuses the rank, or (1) when it does not answer within ``timeout`` seconds."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(server)
    dealer.send(h.encode(h.Handshake(dp_rank, PROTOCOL_VERSION, fingerprint, socket.gethostname())))
    started = time.monotonic()
    while not dealer.poll(int(min(WAIT_LOG_EVERY_S, timeout) * 1000)):
        waited = time.monotonic() - started
        if waited >= timeout:
            logger.error("no answer from the API server at %s in %.0f s: is it started with --data-parallel-size-local "
                         "and this --data-parallel-rpc-port?", server, waited)
            os._exit(1)
        logger.info("waiting for the API server at %s (%.0f s)", server, waited)
    answer = h.decode_answer(dealer.recv())
    dealer.close()
    if isinstance(answer, h.Refused):
        logger.error("the API server at %s refused data-parallel rank %d: %s", server, dp_rank, answer.reason)
        os._exit(2)
    logger.info("joined the API server at %s as data-parallel rank %d", server, dp_rank)
    return answer


def keep_alive(*socks: zmq.Socket) -> None:
    """ZMTP heartbeats on each one's tcp connection: a peer silent past the timeout drops it."""
    for sock in socks:
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(KEEPALIVE_EVERY_S * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(KEEPALIVE_TIMEOUT_S * 1000))


def end_with_server(sock: zmq.Socket, server: str) -> None:
    """Watch ``sock``'s connection (the inbox; called before it connects) from a thread; once it
    drops, SIGKILL this process group (this core and its tensor-parallel workers: the core
    leads a session of its own)."""
    global _watch
    # NOTE: DISCONNECTED comes only after a connection was made (a failed connect is
    # CONNECT_RETRIED), so the watch needs no CONNECTED first, which it could miss.
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    stop = threading.Event()

    def watch() -> None:
        try:
            while not stop.is_set():
                if not monitor.poll(200):
                    continue
                if recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED and not stop.is_set():
                    logger.error("the connection to the API server (%s) dropped: the server or its machine is "
                                 "gone; ending this engine core and its workers", server)
                    os.killpg(os.getpgrp(), signal.SIGKILL)
        finally:
            monitor.close(linger=0)

    thread = threading.Thread(target=watch, name="modserve-server-watch", daemon=True)
    thread.start()
    _watch = (stop, thread)


def stop_watching() -> None:
    """Before the core closes its own sockets (no-op on a core without a watch)."""
    if _watch is not None:
        _watch[0].set()
        _watch[1].join()
