"""`IndexProcesses`: outlines-core `Index` builds in child processes that can be killed.

An outlines-core index is a DFA over token ids; some schemas' regexes make it explode (a
counted repetition inside an alternation, for one: a single regex built 20 GB of states on the
development machine before the kernel killed the process). Inside the server that would be
one request taking every other request's memory, and a compile that `GrammarCompiler` times
out would keep its thread and its CPU core until it ended on its own.

So each build runs in a child process (`outlines_index_worker.py`, which imports outlines-core
and nothing else): its address space is capped (`memory_bytes`; an allocation past the cap
kills the child, not the server) and it is killed when the build passes its time limit. The
index comes back pickled. Idle children are kept for the next build (at most `max_idle`);
starting one and sending it the vocabulary happens before a build's clock starts, so a busy
machine's slow process start never counts as the build's time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from arborlm.errors import GrammarError

WORKER = Path(__file__).resolve().with_name("outlines_index_worker.py")
# A child's start: process creation, importing outlines-core and building the vocabulary.
START_TIMEOUT_S = 120.0


def default_memory_bytes() -> int:
    """The cap on one build's address space: 4 GiB, or a quarter of the machine's memory
    where that is less."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 16 << 30
    return min(4 << 30, total // 4)


class _Child:
    """One worker process and our end of its socket."""

    def __init__(self, eos_id: int, tokens: dict[bytes, list[int]], memory_bytes: int):
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER), str(theirs.fileno()), str(memory_bytes)],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        try:
            self.conn.send((eos_id, tokens))
            if not self.conn.poll(START_TIMEOUT_S) or self.conn.recv() != "ready":
                raise GrammarError("the outlines index process did not start",
                                   param="grammar_backend")
        except (EOFError, OSError) as e:
            self.kill()
            raise GrammarError(f"the outlines index process did not start: {self._death()}",
                               param="grammar_backend") from e
        except BaseException:
            self.kill()
            raise

    def build(self, regex: str, timeout_s: float, memory_bytes: int) -> Any:
        """The index of `regex`; `ValueError` with outlines-core's message where the regex is
        invalid; `GrammarError` past `timeout_s` or the memory cap (the child is then dead)."""
        try:
            self.conn.send(regex)
            if not self.conn.poll(timeout_s):
                self.kill()
                raise GrammarError(f"the outlines index build passed its time limit of "
                                   f"{timeout_s:g} s", param="regex")
            status, value = self.conn.recv()
        except (EOFError, OSError) as e:
            self.kill()
            raise GrammarError(f"the outlines index build {self._death(memory_bytes)}",
                               param="regex") from e
        if status == "ok":
            return value
        if status == "memory":
            self.kill()
            raise GrammarError(f"the outlines index build {_over_memory(memory_bytes)}",
                               param="regex")
        raise ValueError(value)

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        self.conn.close()

    def _death(self, memory_bytes: int = 0) -> str:
        code = self.proc.wait()
        if code == -signal.SIGABRT and memory_bytes:
            return _over_memory(memory_bytes)  # a native allocation past the cap aborts
        return f"process ended (exit status {code})"


def _over_memory(memory_bytes: int) -> str:
    return f"ran past its memory limit of {memory_bytes / (1 << 30):.1f} GiB"


class IndexProcesses:
    """Builds indexes for one vocabulary in killable, memory-capped child processes."""

    def __init__(self, eos_id: int, tokens: dict[bytes, list[int]], *,
                 memory_bytes: int | None = None, max_idle: int = 2):
        self.eos_id, self.tokens = eos_id, tokens
        self.memory_bytes = default_memory_bytes() if memory_bytes is None else memory_bytes
        self.max_idle = max_idle
        self._idle: list[_Child] = []
        self._lock = threading.Lock()
        self._closed = False
        self.started = 0  # children started so far (tests read it)

    def build(self, regex: str, timeout_s: float) -> Any:
        """The outlines-core `Index` of `regex` (against this vocabulary), built within
        `timeout_s` seconds in a child process. `ValueError` (outlines-core's message) for an
        invalid regex; `GrammarError` past the time limit or the memory cap."""
        child = self._take()
        try:
            index = child.build(regex, timeout_s, self.memory_bytes)
        except GrammarError:  # (a ValueError too) `child.build` has killed the child
            raise
        except ValueError:
            self._give_back(child)  # a bad regex: the child is fine
            raise
        except BaseException:
            child.kill()
            raise
        self._give_back(child)
        return index

    def close(self) -> None:
        """Kill every idle child; builds running now end with their callers."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()

    def _take(self) -> _Child:
        with self._lock:
            if self._closed:
                raise GrammarError("the grammar backend was shut down", param="grammar_backend")
            if self._idle:
                return self._idle.pop()
            self.started += 1
        return _Child(self.eos_id, self.tokens, self.memory_bytes)

    def _give_back(self, child: _Child) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.max_idle:
                self._idle.append(child)
                return
        child.kill()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
