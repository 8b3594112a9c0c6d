"""`IpcAddresses`: every `ipc://` address of one engine, derived in one place.

The engine's parent process calls `IpcAddresses.create()`, which makes a private directory
(mode 0700, so no other user can connect to the sockets), passes the object (plain strings,
picklable) to its child processes, and calls `cleanup()` when the engine shuts down. Which side
binds each address is the queue owner's choice; by convention the receiving end binds.

This module only names sockets; it opens none (see `zmq_queues`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

# sockaddr_un.sun_path holds 108 bytes on Linux, including the terminating NUL.
MAX_IPC_PATH_BYTES = 107


def _address(run_dir: str, name: str) -> str:
    path = os.path.join(run_dir, name)
    if len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
        raise ValueError(
            f"IPC socket path {path!r} is longer than {MAX_IPC_PATH_BYTES} bytes; "
            "choose a shorter run directory"
        )
    return f"ipc://{path}"


@dataclass(frozen=True)
class IpcAddresses:
    """Socket addresses of one engine, all inside `run_dir`."""

    run_dir: str
    tokenizer_to_scheduler: str
    scheduler_to_detokenizer: str
    detokenizer_to_tokenizer: str

    @classmethod
    def create(cls, run_dir: str | None = None) -> IpcAddresses:
        """Make a fresh private directory (inside `run_dir` when given) and name the sockets."""
        if run_dir is not None:
            os.makedirs(run_dir, exist_ok=True)
        path = tempfile.mkdtemp(prefix="arborlm-", dir=run_dir)  # created with mode 0700
        try:
            return cls(
                run_dir=path,
                tokenizer_to_scheduler=_address(path, "tokenizer-to-scheduler"),
                scheduler_to_detokenizer=_address(path, "scheduler-to-detokenizer"),
                detokenizer_to_tokenizer=_address(path, "detokenizer-to-tokenizer"),
            )
        except ValueError:
            os.rmdir(path)
            raise

    def all_addresses(self) -> list[str]:
        """Every address of the engine."""
        return [self.tokenizer_to_scheduler, self.scheduler_to_detokenizer,
                self.detokenizer_to_tokenizer]

    def cleanup(self) -> None:
        """Remove the directory and any socket files in it; safe to call twice."""
        shutil.rmtree(self.run_dir, ignore_errors=True)
