"""Building the CPU kernels never waits on a dead builder.

Regression tests for: after one `arborlm serve` was OOM-killed while compiling the kernels,
torch's builder left its `lock` file behind, and every later start waited on it silently until
the 600 s start timeout. The build now runs under an `fcntl.flock` in ArborLM's cache directory
(released by the kernel when its holder dies), and a torch `lock` file found while holding it
is removed with the half-built directory.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from arborlm.runtime.platforms.cpu import kernel_build
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
from tests.conftest import REPO_ROOT

HOLD = """
import sys, time
from pathlib import Path
from arborlm.runtime.platforms.cpu.kernel_build import _build_lock
with _build_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(3600)  # until the test kills it
"""
BUILD = """
from arborlm.runtime.platforms.cpu import kernel_build
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
print("built" if cpu_kernels.build() else "failed", flush=True)
"""
DEADLINE_S = 600.0  # generous bound on one import of torch or one full build on a busy machine


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "ARBORLM_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO_ROOT)}


def _poll(what: str, check, deadline_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not check():
        assert time.monotonic() < deadline, f"{what} not within {deadline_s} s"
        time.sleep(0.05)


def test_build_lock_names_its_holder_and_dies_with_it(tmp_path, caplog):
    directory = tmp_path / "cpu_kernels" / "ext"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], cwd=REPO_ROOT,
                              env=_env(tmp_path), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        acquired = threading.Event()

        def wait_for_lock() -> None:
            with kernel_build._build_lock(directory):
                acquired.set()

        waiter = threading.Thread(target=wait_for_lock)
        with caplog.at_level(logging.WARNING, logger=kernel_build.logger.name):
            waiter.start()
            _poll("the waiting note", lambda: f"waiting for pid {holder.pid}" in caplog.text)
        assert not acquired.is_set()
        holder.send_signal(signal.SIGKILL)  # as the OOM killer would
        holder.wait()
        waiter.join(timeout=DEADLINE_S)
        assert acquired.is_set()
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    with open(directory.parent / "ext.lock") as f:  # and nobody holds it now
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _compiling(proc: psutil.Process) -> bool:
    try:
        names = {p.name() for p in proc.children(recursive=True)}
    except psutil.NoSuchProcess:
        return False
    return bool(names & {"cc1plus", "c++", "g++", "clang++"})


@pytest.mark.slow
@pytest.mark.timeout(3 * DEADLINE_S)
def test_build_killed_midway_does_not_block_the_next(tmp_path):
    if not cpu_kernels.packed_linear_available():
        pytest.skip("the kernels do not build on this machine")
    directory = tmp_path / "cpu_kernels" / kernel_build.EXTENSION_NAME
    first = subprocess.Popen([sys.executable, "-c", BUILD], cwd=REPO_ROOT, env=_env(tmp_path),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        _poll("the compiler", lambda: (directory / "lock").exists()
              and _compiling(psutil.Process(first.pid)))
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the builder, ninja and the compilers
        first.wait()
    assert (directory / "lock").exists()  # torch's lock, left behind as in the bug

    second = subprocess.run([sys.executable, "-c", BUILD], cwd=REPO_ROOT, env=_env(tmp_path),
                            capture_output=True, text=True, timeout=DEADLINE_S)
    assert second.stdout.strip() == "built", second.stderr
    assert "died there midway" in second.stderr
    assert not (directory / "lock").exists()
    assert list(directory.glob("*.so"))


def test_the_build_names_its_own_copy_of_the_sources():
    """Regression: the build's commands named the sources where this checkout keeps them, so a
    second checkout of the same sources (same cache entry, other paths) made ninja rebuild the
    cached kernels, and the two took turns rebuilding them (minutes each on a busy machine)."""
    if not cpu_kernels.packed_linear_available():
        pytest.skip("the kernels do not build on this machine")
    directory = kernel_build.build_dir()
    commands = (directory / "build.ninja").read_text()
    assert str(directory / "src" / "panel_gemm.cpp") in commands
    assert str(kernel_build.CSRC) not in commands
    for source in kernel_build.CSRC.glob("*.[ch]*"):
        assert (directory / "src" / source.name).read_bytes() == source.read_bytes()
