"""Soak the real server: many streaming clients for a bounded time, then check it is whole again.

    .venv/bin/python scripts/soak_server.py [--duration 120 --concurrency 64 --out report.json]
    .venv/bin/python scripts/soak_server.py --url http://127.0.0.1:8000 [--pid PID]

Starts `python -m modserve serve` on the tiny random-weight llama (or --model DIR), logging to a
file, and drives it with the official openai client: streamed completions and chat completions
of random prompts and lengths, some with n=2 or a seed; some clients hang up mid-stream
(--disconnect-rate) and some give up after a tiny timeout (--abort-rate). After the load the
server must drain: no running or waiting sequences, no KV block in use, resident memory grown
by at most --max-rss-growth-mb, no 5xx or unexpected error, no traceback in its log. Exits 1
when a check fails; the server it started is always stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from soak_hostile import Hostile, HostileTally, run_hostile

WORDS = ("the a of to and in is it that for on with as was by at be this from or have not are but had "
         "they we you one all there what so up out if about who get which go when make can like time "
         "model token cache batch queue layer server request stream memory block page kernel river "
         "window garden mountain letter music silver engine signal market quiet yellow simple bright "
         "winter summer morning evening ocean forest stone paper bread table chair light café über "
         "naïve 東京 日本語 αβγ абв 🚀 42 3.14 {\"k\": 1} def f(x): return x").split()
PROGRESS_EVERY_S = 10.0


# -- the server process -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # Linux: the server gets SIGTERM if this script dies without its finally (SIGKILL, OOM),
    # so a CI runner never keeps an orphaned server.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_server(args: argparse.Namespace, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    """`python -m modserve serve` on 127.0.0.1:port; stdout and stderr to log_path (a pipe
    nobody reads would fill up and block the server)."""
    if args.model is None:
        from modserve.testing import cached_checkpoint  # imports torch: only when we need the default model

        args.model = str(cached_checkpoint())
    model = args.model
    cmd = [sys.executable, "-m", "modserve", "--log-level", "warning", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--model", model, "--served-model-name", "soak",
           "--max-model-len", str(args.max_model_len), "--num-kv-blocks", str(args.num_kv_blocks),
           "--max-num-seqs", str(args.max_num_seqs)]
    if args.num_threads:
        cmd += ["--num-threads", str(args.num_threads)]
    cmd += args.server_arg
    print(f"starting server: {' '.join(cmd)}\n  log: {log_path}", flush=True)
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent)


def wait_healthy(url: str, proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not healthy after {timeout:.0f} s")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    """SIGTERM, then SIGKILL after timeout; says which it took."""
    if proc.poll() is not None:
        return {"returncode": proc.returncode, "killed": False, "note": "had already exited"}
    proc.send_signal(signal.SIGTERM)
    try:
        return {"returncode": proc.wait(timeout), "killed": False}
    except subprocess.TimeoutExpired:
        proc.kill()
        return {"returncode": proc.wait(30), "killed": True}


def rss_mb(pid: int | None) -> float | None:
    """VmRSS of pid in MiB, from /proc (None without a pid or off Linux)."""
    if pid is None:
        return None
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024  # the kernel reports kB
    return None


def log_problems(log_path: Path | None, limit: int = 40) -> list[str]:
    """Lines of the server log that show a traceback or an ERROR/CRITICAL record."""
    if log_path is None or not log_path.exists():
        return []
    lines = log_path.read_text(errors="replace").splitlines()
    return [ln for ln in lines if re.search(r"Traceback|\bERROR\b|\bCRITICAL\b|Exception in ASGI", ln)][:limit]


# -- the server's gauges ---------------------------------------------------------------------


async def scrape(http: httpx.AsyncClient, url: str) -> dict[str, float | None]:
    """The /metrics gauges that say whether the server is idle (None: not exported)."""
    text = (await http.get(f"{url}/metrics", timeout=10)).text
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    values = {s.name: s.value for s in samples if not s.labels}
    finished = {s.labels["finish_reason"]: int(s.value) for s in samples
                if s.name == "modserve_requests_finished_total"}

    def get(name: str) -> float | None:
        v = values.get(name)
        return int(v) if v is not None and v.is_integer() else v  # counts read as ints in the report

    return {"running": get("modserve_num_requests_running"), "waiting": get("modserve_num_requests_waiting"),
            "swapped": get("modserve_num_requests_swapped") or 0, "kv_blocks_used": get("modserve_kv_blocks_used"),
            "kv_blocks_total": get("modserve_kv_blocks_total"), "kv_usage": get("modserve_kv_cache_usage_ratio"),
            "preemptions": get("modserve_num_preemptions_total"), "finished": finished}


def is_idle(m: dict[str, float | None]) -> bool:
    return m["running"] == 0 and m["waiting"] == 0 and m["swapped"] == 0 and m["kv_blocks_used"] == 0


async def wait_idle(url: str, timeout: float) -> tuple[dict[str, float | None], float]:
    """Poll /metrics until idle or timeout; the last reading and the seconds it took."""
    t0 = time.monotonic()
    async with httpx.AsyncClient() as http:
        while True:
            m = await scrape(http, url)
            if is_idle(m) or time.monotonic() - t0 > timeout:
                return m, time.monotonic() - t0
            await asyncio.sleep(0.5)


# -- the load ----------------------------------------------------------------------------------


@dataclass
class Tally:
    started: int = 0
    completed: int = 0
    disconnected: int = 0  # closed by us mid-stream, on purpose
    aborted: int = 0  # the tiny client timeout fired, on purpose
    abort_not_triggered: int = 0  # a tiny-timeout request that finished anyway (counted completed)
    timeouts: int = 0  # a normal request ran past --request-timeout: a failure
    incomplete: int = 0  # the stream ended without a finish_reason for every choice: a failure
    errors: Counter[str] = field(default_factory=Counter)  # HTTP status or exception type
    completion_tokens: int = 0  # usage of completed requests
    chunks: int = 0  # content chunks received, whatever became of the request
    by_kind: Counter[str] = field(default_factory=Counter)
    ttft_s: list[float] = field(default_factory=list)  # completed requests: to the first content chunk
    latency_s: list[float] = field(default_factory=list)  # completed requests: to the end

    @property
    def failures(self) -> int:
        return self.timeouts + self.incomplete + sum(self.errors.values())

    def as_dict(self) -> dict[str, Any]:
        out = {**asdict(self), "errors": dict(self.errors), "by_kind": dict(self.by_kind),
               "failures": self.failures}
        del out["ttft_s"], out["latency_s"]  # their percentiles instead
        return out | {"ttft": percentiles(self.ttft_s), "latency": percentiles(self.latency_s)}


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50 and p99 in seconds (None without values)."""
    if not values:
        return {"p50": None, "p99": None, "count": 0}
    ordered = sorted(values)
    at = lambda q: ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]  # noqa: E731
    return {"p50": at(0.5), "p99": at(0.99), "count": len(ordered)}


def random_prompt(rng: random.Random, max_words: int) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(1, max_words)))


async def one_request(client: openai.AsyncOpenAI, model: str, rng: random.Random,
                      args: argparse.Namespace, tally: Tally) -> None:
    """One streamed request, read to the end, hung up on, or timed out, as the dice say."""
    chat = rng.random() < 0.5
    n = 2 if rng.random() < 0.2 else 1
    abort = rng.random() < args.abort_rate
    # The tiny timeout bounds the whole request, not only each read (httpx's timeout), so it
    # fires even when tokens stream quickly: the request is cut off before, during or after prefill.
    limit = rng.uniform(0.05, 0.5) if abort else args.request_timeout
    stop_after = rng.randint(1, 8) if not abort and rng.random() < args.disconnect_rate else None
    kw: dict[str, Any] = dict(model=model, stream=True, n=n, max_tokens=rng.randint(8, args.max_tokens),
                              temperature=rng.choice([0.0, 0.7, 1.0]), stream_options={"include_usage": True},
                              timeout=limit)
    if rng.random() < 0.3:
        kw["seed"] = rng.randrange(2**31)
    if rng.random() < 0.2:
        kw["extra_body"] = {"ignore_eos": True}  # runs to max_tokens: the longest sequences
    tally.started += 1
    tally.by_kind[f"{'chat' if chat else 'completion'} n={n}"] += 1
    finished: set[int] = set()
    got = usage_tokens = 0
    started = time.monotonic()
    first: float | None = None
    try:
        async with asyncio.timeout(limit + (0 if abort else 5)):  # a hard bound, whatever httpx does
            if chat:
                messages = [{"role": "user", "content": random_prompt(rng, args.max_prompt_words)}]
                stream = await client.chat.completions.create(messages=messages, **kw)
            else:
                stream = await client.completions.create(prompt=random_prompt(rng, args.max_prompt_words), **kw)
            try:
                async for chunk in stream:
                    if chunk.usage is not None:
                        usage_tokens = chunk.usage.completion_tokens
                    for c in chunk.choices:
                        if (c.delta.content if chat else c.text):
                            got += 1
                            tally.chunks += 1
                            first = first or time.monotonic()
                        if c.finish_reason is not None:
                            finished.add(c.index)
                    if stop_after is not None and got >= stop_after and len(finished) < n:
                        break  # a finished stream is read on, for its usage chunk
            finally:
                await stream.close()  # closes the connection: a mid-stream disconnect if unread
        if stop_after is not None and got >= stop_after and len(finished) < n:
            tally.disconnected += 1
        elif len(finished) < n:
            tally.incomplete += 1
        else:
            tally.completed += 1
            tally.completion_tokens += usage_tokens
            tally.abort_not_triggered += abort
            if not abort:
                tally.latency_s.append(time.monotonic() - started)
                if first is not None:
                    tally.ttft_s.append(first - started)
    except (openai.APITimeoutError, httpx.TimeoutException, TimeoutError):
        if abort:
            tally.aborted += 1
        else:
            tally.timeouts += 1
    except openai.APIStatusError as e:
        tally.errors[str(e.status_code)] += 1
    except openai.APIError as e:  # an error event inside the stream, or the connection broke
        tally.errors[type(e).__name__] += 1
    except httpx.HTTPError as e:
        tally.errors[type(e).__name__] += 1


async def run_load(url: str, model: str, seconds: float, args: argparse.Namespace, seed: int,
                   label: str, alive: Callable[[], bool]) -> tuple[Tally, float]:
    """--concurrency clients, each looping one_request until `seconds` are up (or the server
    process is gone); then the requests in flight finish (each bounded by --request-timeout)."""
    tally = Tally()
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=args.api_key, max_retries=0,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(
                                    max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency)))
    t0 = time.monotonic()
    deadline = t0 + seconds

    async def worker(i: int) -> None:
        rng = random.Random(seed * 100_003 + i)
        while time.monotonic() < deadline and alive():
            try:
                await one_request(client, model, rng, args, tally)
            except Exception as e:  # noqa: BLE001 - an unexpected client bug still counts, not crashes the soak
                tally.errors[f"client:{type(e).__name__}: {e}"[:120]] += 1

    async def progress() -> None:
        async with httpx.AsyncClient() as http:
            while True:
                await asyncio.sleep(PROGRESS_EVERY_S)
                server = ""
                with contextlib.suppress(httpx.HTTPError):
                    m = await scrape(http, url)
                    server = f" | server running {m['running']} waiting {m['waiting']} kv {m['kv_usage'] or 0:.0%}"
                el = time.monotonic() - t0
                print(f"[{label} {el:5.0f}/{seconds:.0f} s] started {tally.started} completed {tally.completed} "
                      f"disconnected {tally.disconnected} aborted {tally.aborted} failures {tally.failures} "
                      f"chunks {tally.chunks} ({tally.chunks / el:.0f}/s){server}", flush=True)

    reporter = asyncio.create_task(progress())
    try:
        await asyncio.gather(*(worker(i) for i in range(args.concurrency)))
    finally:
        reporter.cancel()
        await client.close()
    return tally, time.monotonic() - t0


# -- the run -----------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), cpu)
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "python": sys.version.split()[0]}


def checks(report: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    if "error" in report:
        out = [{"check": "the soak ran to the end", "ok": False, "detail": report["error"]}]
        if "load" in report:  # what the clients saw before it stopped
            load = report["load"]
            out.append({"check": "no failed requests", "ok": load["failures"] == 0,
                        "detail": f"{load['failures']}: errors {load['errors']}, timeouts {load['timeouts']}"})
        return out
    load, after, rss = report["load"], report["metrics_after"], report["rss_mb"]
    out = [
        ("no failed requests (5xx, unexpected errors, timeouts, incomplete streams)", load["failures"] == 0,
         f"{load['failures']}: errors {load['errors']}, timeouts {load['timeouts']}, incomplete {load['incomplete']}"),
        ("requests completed", load["completed"] > 0, f"{load['completed']}"),
        ("no sequence running after the load", after.get("running") == 0, f"{after.get('running')}"),
        ("no sequence waiting after the load", after.get("waiting") == 0, f"{after.get('waiting')}"),
        ("no sequence swapped out after the load", after.get("swapped", 0) == 0, f"{after.get('swapped')}"),
        ("no KV block in use after the load", after.get("kv_blocks_used") == 0,
         f"{after.get('kv_blocks_used')} of {after.get('kv_blocks_total')}"),
        ("the server ended no request with an error", report["server_finished"].get("error", 0) == 0,
         f"{report['server_finished']}"),
        # A hang-up the server never noticed would run to max_tokens: it must count aborts.
        ("the server aborted requests its clients left",
         report["server_finished"].get("abort", 0) > 0 or load["disconnected"] + load["aborted"] == 0,
         f"{report['server_finished'].get('abort', 0)} aborts for {load['disconnected']} disconnects "
         f"and {load['aborted']} timeouts"),
    ]
    if "hostile" in report:
        victims, hostile = report["hostile"]["victims"], report["hostile"]["hostile"]
        clean_p99, hostile_p99 = load["latency"]["p99"], victims["latency"]["p99"]
        slowdown = hostile_p99 / clean_p99 if clean_p99 and hostile_p99 else None
        out += [
            ("no victim failed beside the hostile clients", victims["failures"] == 0,
             f"{victims['failures']}: errors {victims['errors']}, timeouts {victims['timeouts']}"),
            ("every hostile request refused (4xx), served within bounds or cut by the server",
             hostile["num_failures"] == 0, f"{hostile['num_failures']}: {hostile['failures']}"),
            (f"victims' p99 latency at most {args.max_victim_slowdown:g}x the clean run's",
             slowdown is not None and slowdown <= args.max_victim_slowdown,
             f"{hostile_p99 or 0:.2f} s against {clean_p99 or 0:.2f} s"
             + (f" ({slowdown:.2f}x)" if slowdown else "")),
        ]
    if report["server"].get("log"):  # only the server this script started has a log to read
        out.append(("no traceback or ERROR in the server log", not report["server_log_problems"],
                    f"{len(report['server_log_problems'])} lines"))
    if rss["growth"] is not None:
        out.append((f"RSS growth <= {args.max_rss_growth_mb} MiB", rss["growth"] <= args.max_rss_growth_mb,
                    f"{rss['before']:.0f} -> {rss['after']:.0f} MiB ({rss['growth']:+.0f})"))
    if report["server"].get("stop") is not None:
        stop = report["server"]["stop"]
        # NOTE: -15 is a clean stop: uvicorn re-raises SIGTERM once its graceful shutdown is done.
        out.append((f"server stopped on SIGTERM within {args.stop_timeout:.0f} s", not stop["killed"],
                    f"returncode {stop['returncode']}"))
    return [{"check": name, "ok": bool(ok), "detail": detail} for name, ok, detail in out]


def _p(latency: dict[str, Any]) -> str:
    if not latency["count"]:
        return "n/a"
    return f"{latency['p50']:.2f} / {latency['p99']:.2f} ({latency['count']} requests)"


def _hostile_rows(hostile: dict[str, Any] | None) -> list[tuple[str, Any]]:
    if hostile is None:
        return []
    h = hostile["hostile"]
    return [("hostile phase: victims completed / failed", f"{hostile['victims']['completed']} / "
             f"{hostile['victims']['failures']}"),
            ("hostile phase: victims' latency p50 / p99 (s)", _p(hostile["victims"]["latency"])),
            ("hostile requests sent", json.dumps(h["sent"])),
            ("  refused (4xx)", json.dumps(h["refused"])),
            ("  served", json.dumps(h["served"])),
            ("  cut by the server", json.dumps(h["cut"])),
            ("  failures", json.dumps(h["failures"]))]


def print_summary(report: dict[str, Any]) -> None:
    if "error" in report:
        print("\n" + "\n".join(f"  [FAIL] {c['check']}: {c['detail']}" for c in report["checks"]))
        for line in report["server_log_problems"][:10]:
            print(f"  server log: {line}")
        return
    load, rss, after = report["load"], report["rss_mb"], report["metrics_after"]

    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.1f}"

    rows = [
        ("duration (load, s)", f"{report['load_wall_s']:.1f}"),
        ("concurrency", report["config"]["concurrency"]),
        ("requests started", load["started"]),
        ("completed", load["completed"]),
        ("disconnected mid-stream", load["disconnected"]),
        ("aborted by tiny timeout", f"{load['aborted']} (+{load['abort_not_triggered']} finished first)"),
        ("unexpected timeouts", load["timeouts"]),
        ("incomplete streams", load["incomplete"]),
        ("errors", json.dumps(load["errors"]) if load["errors"] else 0),
        ("completion tokens (completed)", load["completion_tokens"]),
        ("content chunks received", f"{load['chunks']} ({load['chunks'] / report['load_wall_s']:.0f}/s)"),
        ("by kind", ", ".join(f"{k}: {v}" for k, v in sorted(load["by_kind"].items()))),
        ("idle after (s)", f"{report['idle_wait_s']:.1f}"),
        ("running / waiting after", f"{after.get('running')} / {after.get('waiting')}"),
        ("KV blocks used after", f"{after.get('kv_blocks_used')} of {after.get('kv_blocks_total')}"),
        ("preemptions (total)", after.get("preemptions")),
        ("server: requests ended, by reason", json.dumps(report["server_finished"])),
        ("RSS before / after / growth (MiB)", f"{fmt(rss['before'])} / {fmt(rss['after'])} / {fmt(rss['growth'])}"),
        ("victims' latency p50 / p99 (s)", _p(load["latency"])),
        *_hostile_rows(report.get("hostile")),
        ("machine", f"{report['machine']['cpus']} CPUs, {report['machine']['cpu_model']}"),
        ("server log", report["server"].get("log", "n/a (not started here)")),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows))
    print("\n" + "\n".join(f"  [{'ok' if c['ok'] else 'FAIL'}] {c['check']}: {c['detail']}" for c in report["checks"]))
    for line in report["server_log_problems"][:10]:
        print(f"  server log: {line}")


async def soak(args: argparse.Namespace, url: str, pid: int | None, report: dict[str, Any],
               alive: Callable[[], bool]) -> None:
    """Warm up, take the RSS baseline, load, drain, measure: into report, as it goes, so a
    server that dies halfway still leaves what was seen before."""
    model = args.served_model_name
    if model is None:  # a server we did not start: ask it what it serves
        async with httpx.AsyncClient() as http:
            model = (await http.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {args.api_key}"},
                                    timeout=10)).json()["data"][0]["id"]
    report.update(url=url, model=model)
    if args.warmup > 0:
        # Warm-up at full concurrency: the allocator's and torch's pools reach their working size
        # before the RSS baseline, so growth measures what the soak itself leaves behind.
        warm, _ = await run_load(url, model, args.warmup, args, seed=args.seed + 1, label="warm-up", alive=alive)
        report["warmup"] = warm.as_dict()
        report["metrics_after_warmup"], _ = await wait_idle(url, args.idle_timeout)
    else:
        async with httpx.AsyncClient() as http:
            report["metrics_after_warmup"] = await scrape(http, url)
    rss_before = rss_mb(pid)
    print(f"load: {args.duration:.0f} s, {args.concurrency} clients; server RSS "
          f"{'n/a' if rss_before is None else f'{rss_before:.0f} MiB'}", flush=True)
    tally, wall = await run_load(url, model, args.duration, args, seed=args.seed, label="soak", alive=alive)
    report["load"], report["load_wall_s"] = tally.as_dict(), wall
    if not alive():
        raise RuntimeError("the server process exited during the load")
    if args.hostile_workers:
        report["hostile"] = await hostile_phase(args, url, model, alive)
        if not alive():
            raise RuntimeError("the server process exited during the hostile load")
    report["metrics_after"], report["idle_wait_s"] = await wait_idle(url, args.idle_timeout)
    before, after = report["metrics_after_warmup"]["finished"], report["metrics_after"]["finished"]
    # Requests the server ended during the soak, by finish reason (per sample when n > 1; an
    # abort is counted once per engine request).
    report["server_finished"] = {k: after.get(k, 0) - before.get(k, 0) for k in sorted({*before, *after})}
    rss_after = rss_mb(pid)
    growth = None if rss_before is None or rss_after is None else rss_after - rss_before
    report["rss_mb"] = {"before": rss_before, "after": rss_after, "growth": growth}


async def hostile_phase(args: argparse.Namespace, url: str, model: str,
                        alive: Callable[[], bool]) -> dict[str, Any]:
    """The same clients again (same seed: the same requests), now beside --hostile-workers
    hostile clients; the victims' latencies against the clean phase's say what the hostile
    ones cost the others."""
    print(f"hostile load: {args.duration:.0f} s, {args.concurrency} victims and {args.hostile_workers} "
          "hostile clients", flush=True)
    hostile = Hostile(url, args.api_key, model, args.max_num_seqs, args.slow_reader_hold)
    htally = HostileTally()
    try:
        (victims, wall), _ = await asyncio.gather(
            run_load(url, model, args.duration, args, seed=args.seed, label="hostile", alive=alive),
            run_hostile(hostile, args.hostile_workers, args.duration, args.seed, htally, alive))
    finally:
        await hostile.close()
    return {"victims": victims.as_dict(), "hostile": htally.as_dict(), "wall_s": wall}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load (after the warm-up)")
    p.add_argument("--concurrency", type=int, default=64, help="concurrent clients")
    p.add_argument("--disconnect-rate", type=float, default=0.3, help="share of requests hung up on mid-stream")
    p.add_argument("--abort-rate", type=float, default=0.05, help="share of requests with a tiny client timeout")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens is drawn from 8..this")
    p.add_argument("--max-prompt-words", type=int, default=40, help="prompt words are drawn from 1..this")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of load before the RSS baseline")
    p.add_argument("--request-timeout", type=float, default=120.0, help="a normal request past this fails")
    p.add_argument("--idle-timeout", type=float, default=30.0, help="how long the server may take to drain")
    p.add_argument("--max-rss-growth-mb", type=float, default=200.0)
    p.add_argument("--seed", type=int, default=0, help="seed of the clients' dice")
    p.add_argument("--out", type=Path, help="write the JSON report here")
    p.add_argument("--hostile-workers", type=int, default=0,
                   help="after the load, run it again beside this many hostile clients (scripts/soak_hostile.py)")
    p.add_argument("--max-num-seqs", type=int, default=16,
                   help="the server's max_num_seqs: sizes the hostile fan-out (passed to a server started here)")
    p.add_argument("--slow-reader-hold", type=float, default=8.0,
                   help="seconds a hostile slow reader reads nothing; past the server's stream_stall_timeout")
    p.add_argument("--max-victim-slowdown", type=float, default=4.0,
                   help="victims' p99 latency in the hostile phase over the clean phase's, at most")
    server = p.add_argument_group("the server this script starts")
    server.add_argument("--model", help="checkpoint directory (default: modserve.testing.cached_checkpoint())")
    server.add_argument("--max-model-len", type=int, default=256)
    server.add_argument("--num-kv-blocks", type=int, default=256)
    server.add_argument("--num-threads", type=int, help="torch threads of the server (default: torch's)")
    server.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for `modserve serve` (repeatable: --server-arg=--seed --server-arg=3)")
    server.add_argument("--log-file", type=Path, help="the server's log (default: a temporary file)")
    server.add_argument("--startup-timeout", type=float, default=300.0)
    server.add_argument("--stop-timeout", type=float, default=30.0, help="SIGTERM, then SIGKILL after this")
    remote = p.add_argument_group("a server already running instead")
    remote.add_argument("--url", help="e.g. http://127.0.0.1:8000 (no server is started)")
    remote.add_argument("--pid", type=int, help="its process id, to read its RSS from /proc")
    remote.add_argument("--api-key", default=os.environ.get("MODSERVE_API_KEY", "none"))
    remote.add_argument("--served-model-name", help="default: the first model /v1/models lists")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (a CI timeout) is handled as Ctrl-C: asyncio.run cancels the load cleanly and the
    # finally below stops the server.
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))
    t0 = time.monotonic()
    proc, log_path, pid, url = None, None, args.pid, args.url
    report: dict[str, Any] = {}
    server_info: dict[str, Any] = {}
    try:
        if url is None:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log_path = args.log_file or Path(tempfile.gettempdir()) / f"modserve-soak-{port}.log"
            proc = start_server(args, port, log_path)
            pid = proc.pid
            args.served_model_name = "soak"
            server_info.update(pid=pid, log=str(log_path), args=proc.args)
        wait_healthy(url, proc, args.startup_timeout)
        server_info["startup_s"] = time.monotonic() - t0
        print(f"server healthy at {url} after {server_info['startup_s']:.1f} s", flush=True)
        asyncio.run(soak(args, url, pid, report, alive=lambda: proc is None or proc.poll() is None))
    except (RuntimeError, httpx.HTTPError, OSError, ValueError, KeyError) as e:
        # The server died or never came up: still a report, and a failing one.
        report["error"] = f"{type(e).__name__}: {e}"
        print(f"soak aborted: {report['error']}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        report["error"] = "interrupted (SIGINT or SIGTERM)"
        print(f"soak aborted: {report['error']}", file=sys.stderr, flush=True)
    finally:
        if proc is not None:
            server_info["stop"] = stop_server(proc, args.stop_timeout)
    report.update(config={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  machine=machine(), server=server_info, server_log_problems=log_problems(log_path),
                  wall_s=time.monotonic() - t0)
    report["checks"] = checks(report, args)
    report["ok"] = all(c["ok"] for c in report["checks"])
    print_summary(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str))
        print(f"\nreport: {args.out}")
    print(f"\nsoak {'passed' if report['ok'] else 'FAILED'} in {report['wall_s']:.0f} s")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
