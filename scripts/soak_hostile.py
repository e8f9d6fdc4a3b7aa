"""The hostile half of the soak: clients that try to make the server do unbounded work.

Each kind sends what a hostile or careless client sends and classifies the answer: a
shaped 4xx is `refused` (what the server's limits are for), a 200 is `served`, a stream
the server ended on its own is `cut`, a 5xx or a connection error the server did not
intend is a failure. The normal clients of soak_server.py run beside these as victims.

    grammar_bomb   a constraint whose automaton would explode (regex, JSON schema, grammar)
    fan_out        prompts x n over the per-request bound, and an allowed large n
    huge_response  n samples with echo and prompt logprobs of a long prompt
    many_stops     thousands of stop strings
    slow_reader    a stream whose client reads nothing, with a tiny receive buffer
    abort_storm    a burst of streams closed after their first bytes
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import httpx

GRAMMAR_BOMBS: list[dict[str, Any]] = [
    {"guided_regex": "a{100000}"},
    {"guided_regex": "(a{1000}){1000}"},
    {"guided_regex": "(a|b|c|d){50000}"},
    {"guided_regex": "[0-9a-f]{20000}-[0-9a-f]{20000}"},
    {"guided_json": {"type": "string", "minLength": 1000000}},
    {"guided_json": {"type": "array", "items": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                "required": ["a"]}, "minItems": 100000}},
    {"guided_json": {"enum": [f"value-{i}" for i in range(20000)]}},
    {"guided_choice": [f"choice {i}" for i in range(20000)]},
    {"guided_grammar": 'root ::= "x"{100000}'},
]
# Nested 3,000 deep: a recursive parser of the schema would overflow Python's stack.
DEEP_SCHEMA = '{"guided_json": ' + '{"type": "array", "items": ' * 3000 + '{"type": "integer"}' + "}" * 3000 + "}"


@dataclass
class HostileTally:
    sent: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)  # a shaped 4xx
    served: Counter[str] = field(default_factory=Counter)  # 200, the work was within the bounds
    cut: Counter[str] = field(default_factory=Counter)  # a stream the server ended itself (slow reader)
    failures: Counter[str] = field(default_factory=Counter)  # 5xx, unshaped errors, unexpected drops

    def as_dict(self) -> dict[str, Any]:
        return {k: dict(v) for k, v in vars(self).items()} | {"num_failures": sum(self.failures.values())}


def _shaped(r: httpx.Response) -> bool:
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)


async def _classify(kind: str, tally: HostileTally, send: Awaitable[httpx.Response]) -> None:
    tally.sent[kind] += 1
    try:
        r = await send
    except httpx.HTTPError as e:
        tally.failures[f"{kind}: {type(e).__name__}"] += 1
        return
    if r.status_code == 200:
        tally.served[kind] += 1
    elif 400 <= r.status_code < 500 and _shaped(r):
        tally.refused[kind] += 1
    else:
        tally.failures[f"{kind}: {r.status_code}"] += 1


class Hostile:
    """One hostile client's actions against ``url``; ``max_num_seqs`` sizes the fan-out."""

    def __init__(self, url: str, api_key: str, model: str, max_num_seqs: int, slow_reader_hold: float) -> None:
        self.url = url
        self.headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.slow_reader_hold = slow_reader_hold
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0))

    async def close(self) -> None:
        await self.http.aclose()

    def _post(self, body: dict[str, Any] | str, path: str = "/v1/completions") -> Awaitable[httpx.Response]:
        raw = body if isinstance(body, str) else json.dumps(body)
        return self.http.post(f"{self.url}{path}", content=raw, headers=self.headers)

    async def grammar_bomb(self, rng: random.Random, tally: HostileTally) -> None:
        if rng.random() < 0.15:
            body = DEEP_SCHEMA[:-1] + f', "model": "{self.model}", "prompt": "x", "max_tokens": 4}}'
        else:
            body = {"model": self.model, "prompt": "x", "max_tokens": 4, **rng.choice(GRAMMAR_BOMBS)}
        await _classify("grammar_bomb", tally, self._post(body))

    async def fan_out(self, rng: random.Random, tally: HostileTally) -> None:
        if rng.random() < 0.5:  # the product of two allowed sizes: 64 prompts x n = max_num_seqs
            body = {"model": self.model, "prompt": ["fan out"] * 64, "n": self.max_num_seqs, "max_tokens": 4}
        else:  # allowed: one prompt, every slot, few tokens
            body = {"model": self.model, "prompt": "fan out", "n": self.max_num_seqs, "max_tokens": 4,
                    "temperature": 1.0}
        await _classify("fan_out", tally, self._post(body))

    async def huge_response(self, rng: random.Random, tally: HostileTally) -> None:
        body = {"model": self.model, "prompt": "the words of a long prompt " * 40, "n": self.max_num_seqs,
                "max_tokens": 1, "echo": True, "logprobs": 5, "prompt_logprobs": 20}
        await _classify("huge_response", tally, self._post(body))

    async def many_stops(self, rng: random.Random, tally: HostileTally) -> None:
        stops = [f"stop-{i}-{rng.random():.6f}" for i in range(rng.choice([200, 20000]))]
        body = {"model": self.model, "prompt": "stop me", "max_tokens": 16, "stop": stops}
        await _classify("many_stops", tally, self._post(body))

    async def abort_storm(self, rng: random.Random, tally: HostileTally) -> None:
        async def one() -> None:
            tally.sent["abort_storm"] += 1
            body = {"model": self.model, "prompt": "storm", "max_tokens": 64, "stream": True, "ignore_eos": True}
            try:
                async with self.http.stream("POST", f"{self.url}/v1/completions", content=json.dumps(body),
                                            headers=self.headers) as r:
                    if r.status_code != 200:
                        (tally.refused if 400 <= r.status_code < 500 else tally.failures)[
                            f"abort_storm: {r.status_code}" if r.status_code >= 500 else "abort_storm"] += 1
                        return
                    async for _ in r.aiter_bytes():
                        break  # hang up after the first bytes
                tally.served["abort_storm"] += 1
            except httpx.HTTPError as e:
                tally.failures[f"abort_storm: {type(e).__name__}"] += 1

        await asyncio.gather(*(one() for _ in range(rng.randint(5, 15))))

    async def slow_reader(self, rng: random.Random, tally: HostileTally) -> None:
        """A stream over a raw socket with a 4 KiB receive buffer and small segments (else
        loopback's buffers grow to megabytes and the server never waits), read by nobody for
        ``slow_reader_hold`` seconds: the server must stop computing for it on its own."""
        tally.sent["slow_reader"] += 1
        await asyncio.to_thread(self._slow_reader_blocking, tally)

    def _slow_reader_blocking(self, tally: HostileTally) -> None:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        # 4 samples up to the context's end (max_tokens null), each token with its top 5:
        # megabytes at max_model_len 1024, more than the socket buffers hold.
        body = json.dumps({"model": self.model, "prompt": "read me slowly", "max_tokens": None, "logprobs": 5,
                           "n": min(4, self.max_num_seqs),
                           "stream": True, "ignore_eos": True, "temperature": 1.0}).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window stays small
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
        try:
            s.settimeout(10)
            s.connect((host, int(port)))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                      + f"Authorization: {self.headers['Authorization']}\r\nContent-Length: {len(body)}\r\n\r\n"
                      .encode() + body)
            time.sleep(self.slow_reader_hold)
            # Now read what is there: the stream must have ended (an error event, [DONE]) or be
            # closed by the server; a stream still running after the hold is one nobody stopped.
            s.settimeout(2)
            data = b""
            try:
                while chunk := s.recv(65536):
                    data += chunk
                    if b"[DONE]" in data[-64:]:
                        break
            except TimeoutError:
                tally.failures["slow_reader: still streaming after the hold"] += 1
                return
            if data.startswith(b"HTTP/1.1 200") and b"stream_stalled" in data:
                tally.cut["slow_reader"] += 1
            elif data.startswith(b"HTTP/1.1 200"):  # it ended before the buffers filled: no harm done
                tally.served["slow_reader"] += 1
            elif data.startswith(b"HTTP/1.1 4"):
                tally.refused["slow_reader"] += 1
            else:
                tally.failures[f"slow_reader: {data[:12]!r}"] += 1
        except OSError as e:
            tally.failures[f"slow_reader: {type(e).__name__}"] += 1
        finally:
            s.close()


# In the order each hostile client goes through them (the slowest first, so even a short run
# has a slow reader held past the stall timeout).
KINDS: dict[str, Callable[[Hostile], Callable[[random.Random, HostileTally], Awaitable[None]]]] = {
    "slow_reader": lambda h: h.slow_reader, "grammar_bomb": lambda h: h.grammar_bomb,
    "fan_out": lambda h: h.fan_out, "many_stops": lambda h: h.many_stops,
    "huge_response": lambda h: h.huge_response, "abort_storm": lambda h: h.abort_storm,
}


async def run_hostile(hostile: Hostile, workers: int, seconds: float, seed: int, tally: HostileTally,
                      alive: Callable[[], bool]) -> None:
    """``workers`` hostile clients, each going round the kinds (client i starting at the i-th)
    until ``seconds`` are up; a slow reader holds its client for its whole hold."""
    deadline = time.monotonic() + seconds
    kinds = list(KINDS)

    async def worker(i: int) -> None:
        rng = random.Random(seed * 7919 + i)
        turn = i
        while time.monotonic() < deadline and alive():
            await KINDS[kinds[turn % len(kinds)]](hostile)(rng, tally)
            turn += 1

    await asyncio.gather(*(worker(i) for i in range(workers)))
