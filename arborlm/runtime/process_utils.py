"""The engine's child processes: spawning, the startup handshake, signals and clean exits.

Parent side: `spawn_child(name, entry, *args)` starts `entry` ("module:callable", imported only
in the child, so the parent never loads what the child runs) with the "spawn" start method and
returns a `ChildProcess`; `wait_ready()` blocks until the child reports `ProcessReady` (or
raises with the child's own error). While it waits it logs each startup phase the child
announces (`startup.phase`, sent as `ProcessProgress`) with elapsed times, and every
`STILL_WAITING_LOG_S` the phase a slow child is still in. A child that exits during startup is
noticed at once (its pipe closes); the error names its exit code, its phase and its last lines
of output. The child's stdout and stderr go through a pipe that the parent copies to its own
stderr, keeping the last `OUTPUT_TAIL_LINES` lines for such errors. `register_for_cleanup(obj)`
makes sure `obj.shutdown()` runs at interpreter exit and on SIGTERM (the handler is installed
only from the main thread and only where SIGTERM still has its default action, so pytest's and
servers' handlers stay).

Child side (`_child_main`): the callable builds a *service* (an object with `ready_info()`,
`run(stop)` and `close()`). SIGTERM sets the `StopFlag` the service's loop checks between steps
(during startup it raises `SystemExit` instead); SIGINT is ignored, because Ctrl-C reaches the
whole process group and the parent decides when its children stop. A watch thread polls
`os.getppid()`: when the parent dies, the child stops itself and removes the engine's socket
directory. (`PR_SET_PDEATHSIG` is not used: it fires when the *thread* that spawned the child
exits, which would kill an engine created from a short-lived thread.) Children log at the
parent's log level.

Test hook: while the file named by `$ARBORLM_FAIL_CHILD_START` exists, every child fails its
start (as a child whose model cannot load would), so tests can make engine restarts fail.

This module knows nothing of schedulers or sockets; the services live in `scheduler_process`
and `detokenizer_process`.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any, Protocol

import psutil

import arborlm.errors as errors
from arborlm.errors import ArborLMError, EngineDeadError
from arborlm.runtime import startup
from arborlm.runtime.messages import ProcessFailed, ProcessProgress, ProcessReady, decode, encode

logger = logging.getLogger(__name__)

SPAWN = multiprocessing.get_context("spawn")
PARENT_POLL_S = 0.5  # how often a child checks that its parent is alive
PARENT_DEATH_GRACE_S = 5.0  # after the parent died, a child exits at the latest this much later
READY_POLL_S = 0.1
STILL_WAITING_LOG_S = 30.0  # a starting child still in one phase is logged this often
OUTPUT_TAIL_LINES = 20  # lines of a child's output kept for the error when it dies
FAIL_START_ENV = "ARBORLM_FAIL_CHILD_START"


class StopFlag:
    """Tells a child's loop to stop; set by SIGTERM, by the parent-death watch, or by the loop."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""
        self.parent_died = False
        self.interrupt = True  # raise SystemExit on a signal (startup) instead of only flagging

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    def on_signal(self, signum: int, frame: Any) -> None:
        self.set(f"received {signal.Signals(signum).name}")
        if self.interrupt:
            raise SystemExit(128 + signum)


class Service(Protocol):
    """What a child process runs: built by its entry callable, then `run` until `stop`."""

    def ready_info(self) -> dict[str, Any]: ...

    def run(self, stop: StopFlag) -> None: ...

    def close(self) -> None: ...


# --- parent side ---------------------------------------------------------------------------------


def _error_from(msg: ProcessFailed) -> BaseException:
    """The exception a parent raises for a child's `ProcessFailed`: the same `arborlm.errors`
    class when the child raised one, else `EngineDeadError`."""
    cls = getattr(errors, msg.error_type, None)
    text = f"{msg.process} process: {msg.message}"
    if isinstance(cls, type) and issubclass(cls, ArborLMError):
        return cls(text)
    return EngineDeadError(f"{msg.process} process failed: {msg.error_type}: {msg.message}\n"
                           f"{msg.traceback}".rstrip())


class OutputTail:
    """Copies a child's output pipe to this process's stderr (fd 2), keeping the last lines."""

    def __init__(self, name: str, reader: Connection):
        self.lines: deque[str] = deque(maxlen=OUTPUT_TAIL_LINES)
        self._reader = reader
        self._partial = b""
        self._thread = threading.Thread(target=self._copy, name=f"arborlm-{name}-output",
                                        daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        fd = self._reader.fileno()
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:
                break
            if not data:
                break
            view = memoryview(data)
            with contextlib.suppress(OSError):
                while view:
                    view = view[os.write(2, view):]
            *whole, self._partial = (self._partial + data).split(b"\n")
            self.lines.extend(line.decode(errors="replace") for line in whole if line.strip())
        if self._partial.strip():
            self.lines.append(self._partial.decode(errors="replace"))
        self._reader.close()

    def text(self, wait_s: float = 0.0) -> str:
        """The last lines, after waiting up to `wait_s` for the pipe to close (a dead child's
        last words may still be in it)."""
        self._thread.join(wait_s)
        return "\n".join(self.lines)


class ChildProcess:
    """A spawned child, the pipe on which it reports its startup, and its output."""

    def __init__(self, name: str, process: Any, conn: Connection, output: OutputTail):
        self.name = name
        self.process = process
        self.conn = conn
        self.output = output
        self.spawned = time.monotonic()
        self.phase = "starting"  # the startup phase it announced last ("ready" once started)
        self.phase_since = self.spawned
        self._failure: ProcessFailed | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def _read(self) -> ProcessProgress | ProcessReady | ProcessFailed | None:
        try:
            msg = decode(self.conn.recv_bytes())
        except (EOFError, OSError):
            return None
        if isinstance(msg, ProcessFailed):
            self._failure = msg
        if isinstance(msg, ProcessProgress):
            self._enter(msg.phase)
        return msg if isinstance(msg, ProcessProgress | ProcessReady | ProcessFailed) else None

    def _enter(self, phase: str) -> None:
        now = time.monotonic()
        logger.info("%s process: %s (%.1f s since start; %s took %.1f s)", self.name, phase,
                    now - self.spawned, self.phase, now - self.phase_since)
        self.phase, self.phase_since = phase, now

    def poll_ready(self, wait: float) -> dict[str, Any] | None:
        """The child's `ProcessReady.info` if it arrives within `wait` seconds, else None;
        raises the child's error if it failed or exited instead."""
        deadline = time.monotonic() + wait
        while self.conn.poll(max(0.0, deadline - time.monotonic())):
            msg = self._read()
            if isinstance(msg, ProcessProgress):
                continue
            if isinstance(msg, ProcessReady):
                self._enter("ready")
                return msg.info
            if isinstance(msg, ProcessFailed):
                raise _error_from(msg)
            self.process.join(1.0)  # the pipe closed: the child is gone
            raise EngineDeadError(self.startup_death())
        if not self.process.is_alive():
            raise EngineDeadError(self.startup_death())
        return None

    def startup_death(self) -> str:
        """Why the child is gone during its start: exit code, phase, last output lines."""
        text = self.death_message(f"exited during startup ({self.phase})")
        tail = self.output.text(wait_s=1.0)
        return f"{text}; its last output:\n{tail}" if tail else f"{text}; it wrote no output"

    def death_message(self, what: str = "died") -> str:
        """E.g. "scheduler process died (exit code -9)", plus the child's own error if sent."""
        with contextlib.suppress(OSError, EOFError):
            while self._failure is None and self.conn.poll(0):
                if self._read() is None:
                    break
        text = f"{self.name} process {what} (exit code {self.process.exitcode})"
        if self._failure is not None:
            text += f": {self._failure.error_type}: {self._failure.message}"
        return text

    def stop(self, timeout: float) -> None:
        """Wait up to `timeout` for a requested exit, then SIGTERM, then SIGKILL the tree."""
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(2.0)
        if self.process.is_alive():
            kill_process_tree(self.process.pid)
            self.process.join(2.0)
        self.conn.close()


_spawn_lock = threading.Lock()


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """Set `env` in this process's environment (which a spawned child inherits), then undo."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def spawn_child(name: str, entry: str, *args: Any, cleanup_dir: str | None = None,
                env: dict[str, str] | None = None) -> ChildProcess:
    """Start `entry(*args)` ("module:callable" returning a `Service`) in a spawned process.

    `cleanup_dir` is removed by the child if the parent dies before shutting it down. `env`
    holds environment variables the child starts with (read by libraries at load time).
    """
    reader, writer = SPAWN.Pipe(duplex=False)
    out_reader, out_writer = SPAWN.Pipe(duplex=False)
    level = logging.getLogger().getEffectiveLevel()
    process = SPAWN.Process(target=_child_main, name=f"arborlm-{name}", daemon=True,
                            args=(name, entry, writer, out_writer, level, os.getpid(),
                                  cleanup_dir, args))
    with _spawn_lock, _environment(env or {}):
        process.start()
    writer.close()
    out_writer.close()
    return ChildProcess(name, process, reader, OutputTail(name, out_reader))


def wait_ready(children: list[ChildProcess], timeout: float,
               cancel: threading.Event | None = None) -> dict[str, dict[str, Any]]:
    """Wait for every child's `ProcessReady`; the first failure, the timeout, or `cancel`
    being set raises `EngineDeadError`."""
    infos: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(infos) < len(children):
        late = [c for c in children if c.name not in infos]
        if time.monotonic() > deadline:
            raise EngineDeadError("; ".join(_late_message(c, timeout) for c in late))
        if cancel is not None and cancel.is_set():
            raise EngineDeadError("the engine's start was cancelled")
        for child in late:
            info = child.poll_ready(READY_POLL_S / len(late))
            if info is not None:
                infos[child.name] = info
            elif time.monotonic() - child.phase_since > STILL_WAITING_LOG_S:
                logger.warning("%s process: still %s after %.0f s", child.name, child.phase,
                               time.monotonic() - child.phase_since)
                child.phase_since = time.monotonic()  # (the next note after as long again)
    return infos


def _late_message(child: ChildProcess, timeout: float) -> str:
    tail = child.output.text()
    return (f"{child.name} process did not start within {timeout:.0f} s (its last phase: "
            f"{child.phase})" + (f"; its last output:\n{tail}" if tail else ""))


def kill_process_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send `sig` to `pid` and every descendant of it (those already gone are skipped)."""
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(sig)


_live: weakref.WeakSet = weakref.WeakSet()
_atexit_registered = False


def register_for_cleanup(obj: Any) -> None:
    """Call `obj.shutdown()` at interpreter exit and on SIGTERM (until `unregister`)."""
    global _atexit_registered
    _live.add(obj)
    if not _atexit_registered:
        _atexit_registered = True
        atexit.register(_shutdown_all)
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def unregister(obj: Any) -> None:
    _live.discard(obj)


def _shutdown_all() -> None:
    for obj in list(_live):
        try:
            obj.shutdown()
        except Exception:  # noqa: BLE001 - keep stopping the others
            logger.exception("shutdown at exit failed")


def _on_sigterm(signum: int, frame: Any) -> None:
    """Stop every engine's children, then die of SIGTERM as if no handler were installed."""
    _shutdown_all()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


# --- child side ----------------------------------------------------------------------------------


def _report_failure(conn: Connection, name: str, exc: BaseException) -> None:
    msg = ProcessFailed(process=name, error_type=type(exc).__name__, message=str(exc),
                        traceback=traceback.format_exc())
    with contextlib.suppress(OSError):
        conn.send_bytes(encode(msg))


def _watch_parent(parent_pid: int, stop: StopFlag) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    stop.parent_died = True
    os.kill(os.getpid(), signal.SIGTERM)  # delivered to the main thread: ends startup or loop
    time.sleep(PARENT_DEATH_GRACE_S)
    os._exit(1)


def _report_phase(conn: Connection, name: str, phase: str) -> None:
    with contextlib.suppress(OSError):
        conn.send_bytes(encode(ProcessProgress(process=name, phase=phase)))


def _redirect_output(out: Connection) -> None:
    """Point this process's stdout and stderr (the fds, so C++ and compilers too) at `out`."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    out.close()


def _check_fail_hook() -> None:
    path = os.environ.get(FAIL_START_ENV)
    if path and os.path.exists(path):
        raise EngineDeadError(f"start refused by the test hook: {path} exists "
                              f"(${FAIL_START_ENV})")


def _child_main(name: str, entry: str, conn: Connection, out: Connection, log_level: int,
                parent_pid: int, cleanup_dir: str | None, args: tuple) -> None:
    _redirect_output(out)
    stop = StopFlag()
    signal.signal(signal.SIGTERM, stop.on_signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid, stop), name="parent-watch",
                     daemon=True).start()
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s [{name}] %(levelname)s %(name)s: %(message)s")
    startup.set_reporter(lambda phase: _report_phase(conn, name, phase))
    code = 0
    try:
        startup.phase("importing modules")
        _check_fail_hook()
        module, attr = entry.split(":")
        service = getattr(importlib.import_module(module), attr)(*args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        _report_failure(conn, name, e)
        _exit(1)
    startup.set_reporter(None)
    try:
        conn.send_bytes(encode(ProcessReady(process=name, info=service.ready_info())))
        stop.interrupt = False
        service.run(stop)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        if not stop.is_set():
            logger.exception("%s process failed", name)
            _report_failure(conn, name, e)
            code = 1
    finally:
        service.close()
        if stop.parent_died and cleanup_dir:
            shutil.rmtree(cleanup_dir, ignore_errors=True)
    _exit(code)


def _exit(code: int) -> None:
    """Leave without interpreter finalization: the service has closed what it owns, and
    finalizing torch and ZeroMQ state can take seconds (or hang) in a child."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
