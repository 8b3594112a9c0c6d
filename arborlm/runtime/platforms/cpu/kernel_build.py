"""Building ArborLM's CPU kernels: the one extension behind `torch.ops.arborlm.*` (`csrc/`).

It is built on first use with torch's extension builder (a C++ compiler and ninja; tens of
seconds, cached on disk after) in ArborLM's cache directory (`build_dir()`, under
`$ARBORLM_CACHE_DIR` or ~/.cache/arborlm), while holding an `fcntl.flock` on a file next to it:
the kernel releases that lock when its holder dies, however it dies, so a build killed midway
(an OOM kill) never blocks a later start. torch's builder has a lock of its own, a plain `lock`
file in the build directory that outlives a killed builder and makes every later build wait for
it forever; whoever holds the flock is the only builder, so a `lock` file found then is stale,
and the half-built directory is removed and built afresh. `kernels` loads it and says where
the operators run.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [CSRC / name for name in ("panel_gemm.cpp", "decode_attention.cpp", "elementwise.cpp",
                                    "packed_linear.cpp", "decode_step.cpp",
                                    "prefill_attention.cpp", "quant_linear.cpp", "quant_wide.cpp",
                                    "quant_amx.cpp", "thread_pool.cpp")]
# The cache entry's name carries a hash of every source and header: the builder itself hashes
# only the .cpp files it is given, so a changed header would otherwise reuse a stale build.
EXTENSION_NAME = "arborlm_cpu_kernels_" + hashlib.sha256(
    b"".join(f.read_bytes() for f in sorted(CSRC.glob("*.[ch]*")))).hexdigest()[:12]


def build_dir() -> Path:
    """Where the extension is built and cached: one directory per version of the sources."""
    from arborlm.runtime.models.factory import cache_root

    return cache_root() / "cpu_kernels" / EXTENSION_NAME


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `<directory>.lock` (the kernel drops it when this process
    dies); say who holds it while waiting, and write this pid into it once held."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f"{directory.name}.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            logger.warning("waiting for pid %s, which is building ArborLM's CPU kernels in %s",
                           holder, directory)
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_extension() -> None:
    """Build (or load the cached build of) the extension, which registers the operators."""
    from torch.utils.cpp_extension import load

    _find_ninja()
    directory = build_dir()
    with _build_lock(directory):
        if (directory / "lock").exists():
            logger.warning("removing %s: a build of ArborLM's CPU kernels died there midway "
                           "(torch's lock file is left); building afresh", directory)
            shutil.rmtree(directory)
        sources = _copy_sources(directory)
        start = time.monotonic()
        logger.info("loading ArborLM's CPU kernels from %s (compiled on first use, ~20 s; "
                    "cached)", directory)
        load(EXTENSION_NAME, [str(s) for s in sources], extra_cflags=["-O3", "-fopenmp"],
             extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False,
             build_directory=str(directory))
        logger.info("ArborLM's CPU kernels loaded in %.1f s", time.monotonic() - start)


def _copy_sources(directory: Path) -> list[Path]:
    """The sources as built: copied into `directory/src` once (the directory is named by their
    hash, so the copy never goes stale). Built from there, the build's commands name the same
    paths whichever checkout or install loads them, so ninja never rebuilds a cached build
    because another checkout of the same sources asked for it."""
    src = directory / "src"
    if not src.is_dir():
        staging = directory / "src.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for f in CSRC.glob("*.[ch]*"):
            shutil.copy2(f, staging / f.name)
        staging.rename(src)
    return [src / s.name for s in SOURCES]


def _find_ninja() -> None:
    """Put the `ninja` package's binary on PATH when none is there (a virtualenv not activated:
    torch's builder runs `ninja` by name)."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
