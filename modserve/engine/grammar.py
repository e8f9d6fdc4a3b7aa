"""Structured outputs in the core: compile off the step path, cache, fill the batch mask.

``GrammarCompiler.submit(spec)`` returns a Future: a worker compiles the spec
once, and later requests with the same (kind, spec, tokenizer) share it from an
LRU cache. The engine keeps a request out of the scheduler until its Future is
done, so other requests keep decoding meanwhile. Workers are processes
(:mod:`modserve.engine.grammar_processes`: a compile past the timeout is killed), or
threads with ``grammar_compile_isolation=thread`` (cheaper to start, never stopped).

``auto`` is core behaviour, not a plugin: it tries the registered backends in
an order per kind (the priorities the backends declared when they registered) and takes the first that
compiles the spec; when none does, the error gives each backend's reason.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Iterable


from modserve.core.config import PluginChoice
from modserve.core.contracts.grammar_backend import GrammarBackend, GrammarVocab
from modserve.core.plugin_calls import calling
from modserve.core.registry import PluginError, Registry
from modserve.core.structured_outputs import GrammarSpec
from modserve.engine.grammar_compile import START_TIMEOUT_S, CompiledGrammar, compile_spec

logger = logging.getLogger("modserve")

AUTO = "auto"






class GrammarCompiler:
    """Backends (made lazily), a worker pool and the compiled-grammar LRU cache.

    NOTE: ``submit`` may be called from any thread (the server validates specs on
    its event loop before the engine thread sees the request); the cache and the
    backends are guarded by one lock each, compiles run on the pool. With processes,
    this process's backends only ``deserialize`` and make matchers.
    """

    def __init__(self, registry: Registry, choice: PluginChoice, tokenizer_path: str, vocab_size: int,
                 eos_token_ids: Iterable[int], cache_size: int = 256, num_workers: int = 2,
                 timeout: float = 10.0, isolation: str = "process", memory_mb: int = 1024) -> None:
        self.registry = registry
        self.auto = choice.name == AUTO
        if self.auto:
            if choice.options:
                raise ValueError("grammar_backend 'auto' takes no options; name a backend to configure it")
            self.names = registry.names("grammar_backend")
        else:
            registry.get("grammar_backend", choice.name)  # an unknown name fails at start-up
            self.names = [choice.name]
        self.choice = choice
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self.tokenizer_key = f"{tokenizer_path}@{vocab_size}"
        self.cache_size = cache_size
        self.num_workers = num_workers
        self.timeout = timeout  # seconds a compile may take (see result)
        self.isolation = isolation
        self.memory_mb = memory_mb
        self.hits = self.misses = 0
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._backends: dict[str, GrammarBackend | Exception] = {}
        self._vocab: GrammarVocab | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._workers: Any = None  # CompileWorkers, with isolation "process"
        self._setup: Any = None  # their WorkerSetup
        self._lock = threading.Lock()
        self._backend_lock = threading.Lock()

    # -- compiling ---------------------------------------------------------------------
    def submit(self, spec: GrammarSpec) -> Future:
        """A Future of the :class:`CompiledGrammar` for ``spec``; its exception is a
        ValueError saying why the spec was refused."""
        key = (spec.kind, spec.value, self.tokenizer_key)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return future
            self.misses += 1
            if self.isolation == "process":
                future = self._processes().submit(spec, self.order(spec.kind))
            else:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="modserve-grammar")
                future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)  # whoever holds that Future still has it
        future.add_done_callback(lambda f: self._forget_failure(key, f))
        return future

    def compile(self, spec: GrammarSpec, timeout: float | None = None) -> CompiledGrammar:
        """``submit`` and wait: raises the ValueError of a refused spec."""
        return self.submit(spec).result(timeout)

    def result(self, future: Future, spec: GrammarSpec) -> CompiledGrammar:
        """Wait for ``future``: a ValueError naming the timeout past it. A worker process
        ends the Future itself (the compile killed, start-up not counted); a thread's
        compile goes on, and its grammar is cached when done."""
        try:
            return future.result(self.timeout + START_TIMEOUT_S if self.isolation == "process" else self.timeout)
        except TimeoutError:
            raise ValueError(timeout_message(spec, self.timeout, stopped=self.isolation == "process")) from None

    def close(self) -> None:
        """Kill the worker processes (thread compiles cannot be stopped: not waited for); what
        was queued or running fails with CompilerClosed. A later ``submit`` starts new ones."""
        with self._lock:
            workers, self._workers = self._workers, None
            pool, self._pool = self._pool, None
        if workers is not None:
            workers.close()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def worker_pids(self) -> list[int]:
        return self._workers.pids() if self._workers is not None else []

    def _processes(self) -> Any:
        from modserve.engine.grammar_processes import CompileWorkers  # NOTE: it imports this module

        if self._workers is None:
            self._workers = CompileWorkers(
                self.num_workers, self.timeout, self._worker_setup, self._deserialized,
                lambda spec: ValueError(timeout_message(spec, self.timeout)),
                lambda spec, how: ValueError(memory_message(spec, self.memory_mb, how)))
        return self._workers

    def _worker_setup(self) -> Any:
        from modserve.engine.grammar_processes import picklable
        from modserve.engine.grammar_worker import WorkerSetup

        with self._backend_lock:
            if self._setup is None:
                made_by = {}
                for name in self.names:
                    choice = self.choice if name == self.choice.name else PluginChoice(name=name)
                    made_by[name] = picklable(self.registry.get("grammar_backend", name), choice)
                self._setup = WorkerSetup(made_by, self.vocab(), self.memory_mb, len(self.names) == 1)
            return self._setup

    def _deserialized(self, name: str, data: bytes, seconds: float, spec: GrammarSpec) -> CompiledGrammar:
        backend = self._backend(name)
        if isinstance(backend, Exception):  # it compiled in the worker, but cannot be made here
            raise PluginError(f"grammar backend {name!r} is unavailable in the engine's process: {backend}")
        with calling(backend, "grammar_backend", "deserialize()"):
            compiled = backend.deserialize(data)
        logger.debug("grammar %s compiled by %s in %.3f s", spec.describe(), name, seconds)
        return CompiledGrammar(name, backend, compiled, spec, seconds)


    def _forget_failure(self, key: tuple, future: Future) -> None:
        # Refused specs are not kept: a cache full of bad schemas would push out good ones.
        if future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        grammar = compile_spec(spec, self.order(spec.kind), self._backend, len(self.names) == 1)
        logger.debug("grammar %s compiled by %s in %.3f s", spec.describe(), grammar.backend_name,
                     grammar.compile_seconds)
        return grammar

    def order(self, kind: str) -> list[str]:
        """The backends to try for a spec of ``kind``: by the priority each declared for
        that kind when it registered (higher first, 0 if none), ties by name."""
        if not self.auto:
            return self.names
        priority = {n: self.registry.get("grammar_backend", n).priority.get(kind, 0) for n in self.names}
        return sorted(self.names, key=lambda n: (-priority[n], n))

    def _backend(self, name: str) -> GrammarBackend | Exception:
        with self._backend_lock:
            if name not in self._backends:
                choice = self.choice if name == self.choice.name else PluginChoice(name=name)
                try:
                    self._backends[name] = self.registry.create("grammar_backend", choice, self.vocab())
                except Exception as e:  # remembered: auto then skips it with this reason
                    logger.warning("grammar backend %r is unavailable: %s", name, e)
                    self._backends[name] = e
            return self._backends[name]

    def vocab(self) -> GrammarVocab:
        """The tokenizer as bytes per token id; built on first use (a worker thread)."""
        if self._vocab is None:
            from transformers import AutoTokenizer

            from modserve.engine.token_bytes import token_bytes

            # Its own tokenizer object: the engine thread's is never shared across threads.
            hf = AutoTokenizer.from_pretrained(self.tokenizer_path, local_files_only=True)
            self._vocab = GrammarVocab(tuple(token_bytes(hf, self.vocab_size)), self.eos_token_ids,
                                       self.tokenizer_key)
        return self._vocab

    def stats(self) -> dict[str, int]:
        return {"grammar_cache_size": len(self._cache), "grammar_cache_hits": self.hits,
                "grammar_cache_misses": self.misses}






def timeout_message(spec: GrammarSpec, timeout: float, stopped: bool = True) -> str:
    return (f"the {spec.kind} constraint did not compile within grammar_compile_timeout={timeout:g} s; " +
            ("the compile was stopped: simplify the constraint" if stopped else
             "simplify it, or retry later (the compile goes on in a thread and is cached)"))


def memory_message(spec: GrammarSpec, memory_mb: int, how: str) -> str:
    return (f"the {spec.kind} constraint's compile ran out of memory (grammar_compile_memory_mb={memory_mb}; "
            f"{how}) and was stopped: simplify the constraint")


def wait_any(futures: Iterable[Future], timeout: float) -> None:
    """Block until one of ``futures`` is done or ``timeout`` passes."""
    wait(list(futures), timeout=timeout, return_when="FIRST_COMPLETED")


