"""The CPU kernels' own thread pool (`csrc/thread_pool.cpp`, `arborlm_cpu::parallel_for`).

Every kernel splits its work through it, so the kernels' own tests cover one caller at a time.
These cover what they do not: more threads asked for than the machine has cores, several
Python threads calling kernels at once (two engines in one process: one region holds the
pool, the other runs on its caller's thread alone), and the pool's threads kept between calls.
Each output must be bit for bit what one thread computes: every output element is one thread's
sum in a fixed order, whichever thread runs it.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
from gguf import GGMLQuantizationType as T

from arborlm.runtime.platforms.cpu import capabilities
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
from arborlm.runtime.platforms.cpu.quant_linear import quantize_weight


@pytest.fixture(scope="module")
def cases():
    if not capabilities.kernel_instructions(torch.bfloat16):
        pytest.skip("this CPU lacks the instructions panel_linear needs for bfloat16")
    assert cpu_kernels.available(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    out = []
    for rows, (n_out, n_in) in [(1, (1536, 576)), (4, (576, 1536)), (13, (700, 320))]:
        w = torch.randn(n_out, n_in, generator=gen) * 0.05
        x = torch.randn(rows, n_in, generator=gen).bfloat16()
        panels = cpu_kernels.pack_panels(w.bfloat16())
        q4 = quantize_weight(w, T.Q4_0)
        out.append((
            lambda x=x, p=panels, n=n_out: cpu_kernels.panel_linear(x, p, n),
            lambda x=x, q=q4: cpu_kernels.quant_linear(x, q, int(T.Q4_0)),
        ))
    return [f for pair in out for f in pair]


def _serial(cases, torch_threads):
    torch_threads(1)
    return [f() for f in cases]


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_any_thread_count_gives_the_one_thread_result(cases, torch_threads, threads):
    expected = _serial(cases, torch_threads)
    torch_threads(threads)
    for _ in range(3):  # the pool's workers are reused (and may have gone to sleep) between calls
        for f, want in zip(cases, expected):
            assert torch.equal(f(), want)


_BACK_TO_BACK = """
import sys, torch
from gguf import GGMLQuantizationType as T
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
from arborlm.runtime.platforms.cpu.quant_linear import quantize_weight
assert cpu_kernels.quant_linear_available()  # loads the operators
gen = torch.Generator().manual_seed(3)
calls = []
for out in (32, 4096, 48, 1000, 16):  # 2 to 16 chunks a region
    q = quantize_weight(torch.randn(out, 256, generator=gen) * 0.05, T.Q4_0)
    x = torch.randn(1, 256, generator=gen).bfloat16()
    calls.append(lambda x=x, q=q: cpu_kernels.quant_linear(x, q, int(T.Q4_0), path="vnni2"))
torch.set_num_threads(1)
expected = [f() for f in calls]
torch.set_num_threads(int(sys.argv[1]))
for i in range(int(sys.argv[2])):
    for f, want in zip(calls, expected):
        assert torch.equal(f(), want), i
print("ok")
"""


@pytest.mark.parametrize("threads", [2, 3])
def test_back_to_back_regions_of_different_chunk_counts(threads):
    """Regions follow each other with different numbers of chunks (a decode step: a linear's
    output columns in 8 chunks a thread, then 2-chunk glue, then the next linear). A worker
    still holding the last region's ticket must never claim a chunk of the next one: while the
    chunk count was checked apart from the ticket, one now and then did, ran a chunk with the
    next region's fields and counted it there; the caller then hung, or returned while a chunk
    still ran (a segfault; with 3 threads this loop hung within seconds). In a child process,
    so that a hang fails the test rather than the session."""
    if not cpu_kernels.quant_linear_available() or "vnni2" not in cpu_kernels.quant_paths():
        pytest.skip("needs the integer quant_linear path")
    proc = subprocess.run([sys.executable, "-c", _BACK_TO_BACK, str(threads), "30000"],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_concurrent_callers_each_get_their_own_result(cases, torch_threads):
    expected = _serial(cases, torch_threads)
    torch_threads(2)
    failures: list[str] = []
    start = threading.Barrier(3)

    def hammer(order: list[int]) -> None:
        # torch's thread count is per thread under OpenMP: this one's as the test's
        torch.set_num_threads(2)
        start.wait()
        for _ in range(40):
            for i in order:
                if not torch.equal(cases[i](), expected[i]):
                    failures.append(f"case {i}")

    threads = [threading.Thread(target=hammer, args=(list(range(len(cases))),)),
               threading.Thread(target=hammer, args=(list(reversed(range(len(cases)))),))]
    for t in threads:
        t.start()
    start.wait()
    for _ in range(40):  # and this thread at the same time
        for i, f in enumerate(cases):
            if not torch.equal(f(), expected[i]):
                failures.append(f"case {i} (main)")
    for t in threads:
        t.join()
    assert not failures, failures[:5]


def test_a_forked_child_gets_a_pool_of_its_own(cases, torch_threads):
    """The child of a fork has none of the parent's workers: it starts a pool of its own (a
    new worker thread, where the parent's pool would run every chunk on the caller), and its
    kernels give the one-thread result."""
    import multiprocessing

    expected = _serial(cases, torch_threads)
    torch_threads(2)
    for f in cases:  # the parent's workers exist (and may be mid-spin) when it forks
        f()
    _FORK_CASES[:] = list(zip(cases, expected))
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as children:
        got, before, after = children.apply_async(_run_all_in_child,
                                                  (len(cases),)).get(timeout=300)
    assert got == [True] * len(cases)
    assert after == before + 1, (before, after)
    assert all(torch.equal(f(), want) for f, want in zip(cases, expected))


_FORK_CASES: list = []  # (kernel call, its one-thread result), inherited by the forked child


def _run_all_in_child(n: int) -> tuple[list[bool], int, int]:
    import os

    torch.set_num_threads(2)
    before = len(os.listdir("/proc/self/task"))
    got = [bool(torch.equal(f(), want)) for f, want in _FORK_CASES[:n]]
    return got, before, len(os.listdir("/proc/self/task"))


def test_an_oversubscribed_machine_switches_the_pool_to_passive(torch_threads):
    """With a busy-looping process per CPU beside it, the pool's worker is preempted holding a
    chunk: the caller, kept waiting, finds more threads runnable than CPUs (/proc/loadavg) and
    puts the workers to passive waiting (`pool_passive_switches` counts it). Bounded by calls,
    not time: on an oversubscribed machine a preemption mid-chunk comes within a few hundred."""
    import os
    import subprocess
    import sys

    if not cpu_kernels.quant_linear_available():
        pytest.skip("the quantized kernels are not built")
    gen = torch.Generator().manual_seed(1)
    weight = quantize_weight(torch.randn(4096, 2048, generator=gen) * 0.05, T.Q4_0)
    x = torch.randn(1, 2048, generator=gen).bfloat16()
    torch_threads(2)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 2)]
    try:
        before = cpu_kernels.pool_passive_switches()
        for _ in range(20_000):
            cpu_kernels.quant_linear(x, weight, int(T.Q4_0))
            if cpu_kernels.pool_passive_switches() > before:
                break
        assert cpu_kernels.pool_passive_switches() > before
    finally:
        for p in busy:
            p.kill()
            p.wait()


@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 40_000])
def test_convert_rounds_as_torch_does(n):
    """The kernels' float32 -> bfloat16 narrowing (16 lanes at a time where AVX-512 is granted,
    the rest one by one) and widening are torch's conversions bit for bit, on every kind of
    value: halfway cases (ties to even, both ways), values that round up into the next binade
    or to infinity, subnormals, signed zeros, infinities, and NaNs, which stay NaN (their bits
    are c10::BFloat16's 0x7FC0; torch's own vectorized copy gives 0xFFFF, its scalar one
    0x7FC0)."""
    if not cpu_kernels.packed_linear_available():
        pytest.skip("the kernels do not build here")
    gen = torch.Generator().manual_seed(n)
    bits = torch.randint(-2**31, 2**31, (n,), generator=gen, dtype=torch.int64)
    special = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x7F7F8000, 0x00000001,
                            0x807FFFFF, 0x00000000, 0x80000000, 0x7F800000, 0xFF800000,
                            0x7FC00001, 0xFFFFFFFF, 0x7F800001, 0x3F7FFFFF, 0xBF808000],
                           dtype=torch.int64)
    k = min(n, len(special))
    bits[:k] = special[:k]
    x = bits.to(torch.int32).view(torch.float32)
    got = cpu_kernels.convert(x, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    want = x.to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    back = cpu_kernels.convert(got, torch.float32)
    assert torch.equal(back.view(torch.int32), got.float().view(torch.int32))
