"""`GrammarCompiler`: compile grammars in a thread pool, cache them, time them out.

The scheduler calls `submit(kind, spec, backend)` when a request with a grammar arrives and
polls `future.done()` each step; the request waits in its `grammar` state meanwhile and no
other request is held up. Both engines release the GIL while compiling, so compiles run truly
beside the scheduler thread.

- Cache: bounded LRU keyed by (backend, kind, spec, strict). Concurrent submits of one key share one
  compile. Failures are cached too, for `error_ttl_s`, so a client repeating a bad schema costs
  a dictionary lookup; after that the spec is tried again.
- Time limit: a compile that runs longer than its backend's `compile_timeout_s` resolves to
  `GrammarError("... timed out after N s")` (cached like any error). Neither engine can be
  interrupted, so the compile keeps its thread until it returns and its result is discarded;
  the pool keeps `max_stalled` spare threads so that such stragglers do not take the workers
  of new compiles (at most `max_workers` compiles run at once besides them). The workers are
  ordinary threads, joined at interpreter exit: a straggler delays a process's exit until it
  returns (killing native code in a daemon thread at exit aborts the process instead).
- Backends are created on first use inside a worker (a large vocabulary takes a second or
  more), so constructing a `GrammarCompiler` is instant.

Each `submit` returns its own future: cancelling it affects that caller only. This module does
not touch tokens or masks.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from arborlm.constrained import GRAMMAR_BACKENDS, create_grammar_backend
from arborlm.constrained.base import DEFAULT_COMPILE_TIMEOUT_S, CompiledGrammar, GrammarBackend
from arborlm.errors import GrammarError

Key = tuple[str, str, str, bool]  # backend, kind, spec, strict


@dataclass
class CompileStats:
    hits: int = 0
    misses: int = 0
    errors: int = 0
    timeouts: int = 0


@dataclass
class _Entry:
    future: Future  # the shared result; never handed out directly
    resolved: bool = False  # set under the compiler's lock by the one call that resolves it
    error_expires_at: float | None = None


@dataclass(order=True)
class _Deadline:
    at: float
    seq: int
    callback: Callable[[], None] = field(compare=False)


class GrammarCompiler:
    """Thread-pool grammar compilation with a bounded cache; see the module docstring."""

    def __init__(self, backends: Mapping[str, GrammarBackend] | Callable[[str], GrammarBackend],
                 default_backend: str = "xgrammar", *, max_workers: int = 2,
                 max_stalled: int = 4, max_entries: int = 512, error_ttl_s: float = 60.0):
        self.default_backend = default_backend
        self._make_backend = backends if callable(backends) else None
        self._backends: dict[str, GrammarBackend] = {} if callable(backends) else dict(backends)
        self._backend_locks = {name: threading.Lock() for name in GRAMMAR_BACKENDS}
        self._pool = ThreadPoolExecutor(max_workers + max_stalled,
                                        thread_name_prefix="arborlm-grammar")
        self._running = threading.Semaphore(max_workers)
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._max_entries = max_entries
        self._error_ttl_s = error_ttl_s
        self._watchdog = _Watchdog()
        self.stats = CompileStats()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                      default_backend: str = "xgrammar", *, any_whitespace: bool = False,
                      compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                      **kwargs: Any) -> GrammarCompiler:
        """A compiler whose backends are built on first use for this tokenizer and model."""
        def make(name: str) -> GrammarBackend:
            return create_grammar_backend(name, tokenizer, vocab_size, stop_token_ids,
                                          any_whitespace=any_whitespace,
                                          compile_timeout_s=compile_timeout_s)

        return cls(make, default_backend, **kwargs)

    def submit(self, kind: str, spec: str, backend: str | None = None, *,
               strict: bool = True) -> Future:
        """A future of the `CompiledGrammar` for (kind, spec); it fails with `GrammarError`.
        `strict` as in `GrammarBackend.compile` (it only matters for json_schema)."""
        name = backend or self.default_backend
        if name not in GRAMMAR_BACKENDS:
            return _failed(GrammarError(f"unknown grammar backend {name!r}; expected one of "
                                        f"{', '.join(GRAMMAR_BACKENDS)}", param="grammar_backend"))
        key = (name, kind, spec, bool(strict) or kind != "json_schema")
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and _expired(entry):
                del self._entries[key]
                entry = None
            if entry is not None:
                self._entries.move_to_end(key)
                self.stats.hits += 1
            else:
                self.stats.misses += 1
                entry = _Entry(Future())
                self._entries[key] = entry
                self._evict()
                job = _Job(self, key, entry)
                self._pool.submit(job.run)
        return _chain(entry.future)

    def backend(self, name: str) -> GrammarBackend:
        """The named backend, created on first use (slow for large vocabularies)."""
        backend = self._backends.get(name)
        if backend is not None:
            return backend
        if self._make_backend is None:
            raise GrammarError(f"grammar backend {name!r} is not configured",
                               param="grammar_backend")
        with self._backend_locks[name]:
            if name not in self._backends:
                self._backends[name] = self._make_backend(name)
            return self._backends[name]

    def __len__(self) -> int:
        return len(self._entries)

    def shutdown(self) -> None:
        """Stop accepting work: queued and running compiles fail their waiters with a
        `GrammarError`; running engine calls end on their own, their results discarded."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._watchdog.stop()
        if self._make_backend is not None:  # backends passed in belong to the caller
            for backend in list(self._backends.values()):
                backend.close()
        with self._lock:
            pending = [entry for entry in self._entries.values() if not entry.resolved]
        for entry in pending:
            self._finish(entry, None, GrammarError("the grammar compiler was shut down"))

    def _finish(self, entry: _Entry, result: CompiledGrammar | None,
                error: GrammarError | None, timed_out: bool = False) -> bool:
        """Resolve an entry once; later calls (a straggler after its timeout) do nothing."""
        with self._lock:
            if entry.resolved:
                return False
            entry.resolved = True
            if error is not None:
                entry.error_expires_at = time.monotonic() + self._error_ttl_s
                self.stats.errors += 1
                self.stats.timeouts += int(timed_out)
        if error is not None:
            entry.future.set_exception(error)
        else:
            entry.future.set_result(result)
        return True

    def _evict(self) -> None:
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)


class _Job:
    """One compile: waits for a running slot, arms the timeout, compiles, resolves once."""

    def __init__(self, compiler: GrammarCompiler, key: Key, entry: _Entry):
        self.compiler, self.key, self.entry = compiler, key, entry
        self._slot_lock = threading.Lock()
        self._holds_slot = False

    def run(self) -> None:
        name, kind, spec, strict = self.key
        try:
            backend = self.compiler.backend(name)
        except Exception as e:  # a backend that cannot be built fails its requests alone
            self.compiler._finish(self.entry, None, _as_grammar_error(e, kind))
            return
        self.compiler._running.acquire()
        self._holds_slot = True
        timeout = backend.compile_timeout_s
        self.compiler._watchdog.watch(time.monotonic() + timeout, lambda: self.expire(timeout))
        try:
            result, error = backend.compile(kind, spec, strict=strict), None
        except Exception as e:
            result, error = None, _as_grammar_error(e, kind)
        finally:
            self._release_slot()
        self.compiler._finish(self.entry, result, error)

    def expire(self, timeout: float) -> None:
        error = GrammarError(f"{self.key[1]} compilation timed out after {timeout:g} s "
                             f"(grammar backend {self.key[0]})", param=self.key[1])
        if self.compiler._finish(self.entry, None, error, timed_out=True):
            self._release_slot()

    def _release_slot(self) -> None:
        with self._slot_lock:
            if self._holds_slot:
                self._holds_slot = False
                self.compiler._running.release()


class _Watchdog:
    """One daemon thread that calls each callback when its deadline passes."""

    def __init__(self) -> None:
        self._heap: list[_Deadline] = []
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def watch(self, at: float, callback: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._heap, _Deadline(at, next(self._seq), callback))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="arborlm-grammar-timeout",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._heap
                                             or self._heap[0].at > time.monotonic()):
                    self._cond.wait(self._heap[0].at - time.monotonic() if self._heap else None)
                if self._stopped:
                    return
                due = heapq.heappop(self._heap)
            due.callback()


def _expired(entry: _Entry) -> bool:
    return entry.error_expires_at is not None and time.monotonic() >= entry.error_expires_at


def _as_grammar_error(error: Exception, kind: str) -> GrammarError:
    if isinstance(error, GrammarError):
        return error
    return GrammarError(f"{kind} failed to compile: {type(error).__name__}: {error}", param=kind)


def _chain(shared: Future) -> Future:
    """A private future that resolves like `shared` (so one caller's cancel harms no other)."""
    mine: Future = Future()

    def copy(done: Future) -> None:
        error = done.exception()
        with contextlib.suppress(InvalidStateError):  # this caller cancelled its future
            if error is not None:
                mine.set_exception(error)
            else:
                mine.set_result(done.result())

    shared.add_done_callback(copy)
    return mine


def _failed(error: Exception) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future
