"""The constraint compiler: bounded in time, cached by hash, off the engine's step loop.

    compiler = ConstraintCompiler(tokenizer, vocab_size, eos_token_ids)
    grammar = compiler.compile(params.structured_outputs)    # StructuredOutputError if bad
    request.matcher = grammar.matcher(params, label)          # one per sample

``compile`` validates the constraint, then waits (at most ``timeout_s``) for its compiled grammar
from a small thread pool. Compiles of one constraint are shared: the cache holds the future, so
concurrent requests with one schema wait on one compile, and later ones find it done. The
cache keeps the ``max_cached`` most recently used grammars (least recently used goes first);
failed compiles are not kept. A compile that outlives its caller's wait finishes in the pool
and is cached, but the caller has its error: the limit bounds what a request waits, and the
pool's size bounds how much CPU slow compiles take. ``compile`` is thread-safe: a service calls
it from its handler threads before it hands the request to the engine thread, which then finds
the grammar in the cache; the engine's own ``add_request`` calls it too (a cache hit).

No constraint (``None``) compiles to ``NO_CONSTRAINT``, whose matchers are ``NO_MATCHER``. The
tokenizer's vocabulary is read (~70 ms) at the first constraint, not at engine start.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.structured.errors import StructuredOutputError
from engine.structured.params import StructuredOutputsParams
from engine.structured.protocol import NO_MATCHER, MatcherProtocol

if TYPE_CHECKING:
    import xgrammar as xgr

    from engine.models.tokenizer import Tokenizer
    from engine.sampling_params import SamplingParams
    from engine.structured.backend import GrammarBackend

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_CACHED = 256
DEFAULT_NUM_THREADS = 2


@dataclass(frozen=True)
class CompiledConstraint:
    """A compiled grammar; ``matcher`` gives each sample its own position in it."""

    grammar: xgr.CompiledGrammar
    compile_s: float  # wall time of the compile itself (not the wait)

    def matcher(self, params: SamplingParams, eos_token_ids: tuple[int, ...], label: str = "") -> MatcherProtocol:
        from engine.structured.matcher import GrammarMatcher
        stop = [*(() if params.ignore_eos else eos_token_ids), *params.stop_token_ids] or list(eos_token_ids)
        return GrammarMatcher(self.grammar, stop, label)


class NoConstraint:
    """What ``compile(None)`` returns: every sample's matcher is ``NO_MATCHER``."""

    def matcher(self, params: SamplingParams, eos_token_ids: tuple[int, ...], label: str = "") -> MatcherProtocol:
        return NO_MATCHER


NO_CONSTRAINT = NoConstraint()


@dataclass
class CompilerStats:
    num_compiled: int = 0
    num_hits: int = 0
    num_failed: int = 0
    compile_s: deque[float] = field(default_factory=lambda: deque(maxlen=1024))  # recent compiles' times


class ConstraintCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...], *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_cached: int = DEFAULT_MAX_CACHED,
                 num_threads: int = DEFAULT_NUM_THREADS) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self.timeout_s = timeout_s
        self.max_cached = max_cached
        self._num_threads = num_threads
        self._lock = threading.Lock()
        self._backend_lock = threading.Lock()  # the vocabulary is read once, outside the cache's lock
        self._cache: OrderedDict[str, Future[CompiledConstraint]] = OrderedDict()
        self._backend: GrammarBackend | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.stats = CompilerStats()

    def compile(self, params: StructuredOutputsParams | None) -> CompiledConstraint | NoConstraint:
        """The compiled constraint of ``params`` (None: ``NO_CONSTRAINT``). Raises
        StructuredOutputError naming the field: malformed, unsupported, not compiling, or not
        compiled within ``timeout_s``."""
        if params is None:
            return NO_CONSTRAINT
        params.validate()
        future = self._future(params)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise StructuredOutputError(params.field_name, f"did not compile within {self.timeout_s:g} s; "
                                        f"simplify the constraint") from None
        except StructuredOutputError as e:
            # the cached failure carries the field of whoever compiled it first
            raise StructuredOutputError(params.field_name, e.reason) from None

    def _future(self, params: StructuredOutputsParams) -> Future[CompiledConstraint]:
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.stats.num_hits += 1
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._num_threads, thread_name_prefix="grammar-compile")
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: self._forget_failed(key, f))
        return future

    def _forget_failed(self, key: str, future: Future[CompiledConstraint]) -> None:
        if future.exception() is not None:
            with self._lock:
                self.stats.num_failed += 1
                if self._cache.get(key) is future:
                    del self._cache[key]

    def _compile(self, params: StructuredOutputsParams) -> CompiledConstraint:
        backend = self._get_backend()
        start = time.perf_counter()
        grammar = backend.compile(params)
        seconds = time.perf_counter() - start
        with self._lock:
            self.stats.num_compiled += 1
            self.stats.compile_s.append(seconds)
        return CompiledConstraint(grammar, seconds)

    def _get_backend(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                from engine.structured.backend import GrammarBackend
                self._backend = GrammarBackend(self._tokenizer, self._vocab_size, self._stop_token_ids)
            return self._backend

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        """Stop the pool (compiles in flight finish); idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
