"""The child side of `index_process`: builds outlines-core `Index`es in its own process.

Run as a script (`python outlines_index_worker.py FD MEMORY_BYTES`), never imported by the
runtime: it imports outlines-core and the standard library only, so it starts in a fraction of
a second. FD is its end of a socket pair. It caps its own address space at MEMORY_BYTES (an
allocation past it aborts this process, not the server), receives the vocabulary once (the
EOS id and `{token bytes: [ids]}`), answers "ready", then for each regex it receives sends
back `("ok", index)` or `("error", message)`. It exits when the socket closes or its parent
dies.
"""

import os
import sys

# Run by path, Python puts this file's directory first on sys.path; its siblings must not
# shadow the standard library.
del sys.path[0]

import resource  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from multiprocessing.connection import Connection  # noqa: E402


def _exit_with_parent(parent: int) -> None:
    """An index build cannot be interrupted: end the process once its parent is gone."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def main() -> None:
    fd, memory_bytes = int(sys.argv[1]), int(sys.argv[2])
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    conn = Connection(fd)
    import outlines_core

    eos_id, tokens = conn.recv()
    vocabulary = outlines_core.Vocabulary(eos_id, tokens)
    del tokens
    conn.send("ready")
    while True:
        try:
            regex = conn.recv()
        except EOFError:
            return
        try:
            reply = ("ok", outlines_core.Index(regex, vocabulary))
        except MemoryError:
            reply = ("memory", "")
        except Exception as e:  # outlines-core raises ValueError and friends on a bad regex
            reply = ("error", " ".join(str(e).split()))
        conn.send(reply)


if __name__ == "__main__":
    main()
