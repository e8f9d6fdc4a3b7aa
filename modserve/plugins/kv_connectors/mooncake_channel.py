"""The mooncake connector's side channel: small msgpack requests over ZMQ REQ/REP, by which
a consumer asks a producer where blocks are and tells it when it has read them."""

from __future__ import annotations

import threading
from typing import Any, Callable

import msgspec
import zmq

ASK_TIMEOUT_MS = 5000  # a producer that does not answer in this long counts as holding nothing
POLL_MS = 100  # how often the producer's thread also expires held blocks


class SideChannel:
    """The producer's end: a thread answering each request with ``answer(msg)`` and calling
    ``tick()`` between requests (at least every ``POLL_MS``)."""

    def __init__(self, host: str, port: int, answer: Callable[[dict], dict], tick: Callable[[], None]) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        if port:
            self.socket.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.answer, self.tick = answer, tick
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="mooncake-side-channel", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        decoder, encoder = msgspec.msgpack.Decoder(dict), msgspec.msgpack.Encoder()
        while not self.stopping.is_set():
            if self.socket.poll(POLL_MS):
                try:
                    reply = self.answer(decoder.decode(self.socket.recv()))
                except (msgspec.DecodeError, KeyError, TypeError, ValueError) as e:  # a malformed request
                    reply = {"error": f"{type(e).__name__}: {e}"}
                self.socket.send(encoder.encode(reply))
            self.tick()

    def close(self) -> None:
        self.stopping.set()
        self.thread.join()
        self.socket.close()
        self.context.term()


class Client:
    """The consumer's end of one producer rank's side channel."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.context = zmq.Context()
        self.socket: zmq.Socket | None = None
        self.decoder, self.encoder = msgspec.msgpack.Decoder(dict), msgspec.msgpack.Encoder()

    def ask(self, msg: dict[str, Any]) -> dict | None:
        """The producer's reply, or None when it did not answer in time or refused the request."""
        if self.socket is None:
            self.socket = self.context.socket(zmq.REQ)
            self.socket.setsockopt(zmq.LINGER, 0)
            try:
                self.socket.connect(self.address)
            except zmq.ZMQError:  # an address no producer can be at (a request named it)
                self.socket.close()
                self.socket = None
                return None
        self.socket.send(self.encoder.encode(msg))
        if not self.socket.poll(ASK_TIMEOUT_MS):
            # NOTE: a REQ socket that sent and got no reply cannot send again: start a new one.
            self.socket.close()
            self.socket = None
            return None
        reply = self.decoder.decode(self.socket.recv())
        return None if "error" in reply else reply

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close()
        self.context.term()
