// The kernels' own thread pool: `arborlm_cpu::parallel_for`, called where `at::parallel_for`
// was. A decode step runs a hundred or so short parallel regions back to back, so how the
// threads wait between them decides its speed. OpenMP's ways both lose on a small machine:
// passive waiting puts every worker to sleep after each region, and the futex wake-ups halve
// batch-1 decode; spinning (its default) is fast when the machine is quiet but, when other
// processes want the cores, burns the slices of the thread that holds the work, and throttles
// itself to almost no spin as soon as a second thread of the process has used OpenMP. Here an
// idle worker spins for a bounded time (`ARBORLM_POOL_SPIN_US`, 1000 by default), yielding
// every few dozen pauses so that a busy machine's runnable threads go first, and then sleeps
// on a futex; and the calling thread claims chunks itself, so a worker that is asleep or
// preempted costs a chunk's time, not a wake-up's.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>

namespace arborlm_cpu {

using RangeFn = std::function<void(int64_t, int64_t)>;

// fn over [begin, end) in contiguous chunks of at least `grain` items, one per thread of
// `at::get_num_threads()` at most (as `at::parallel_for` splits it), run by the caller and the
// pool's workers. Inline where there is one chunk, inside a region already, or while another
// thread's region holds the pool. The first exception a chunk throws is rethrown here once
// every chunk has finished.
void parallel_for(int64_t begin, int64_t end, int64_t grain, const RangeFn& fn);

// As `parallel_for`, in up to `split` chunks per thread (each of at least `grain` items), which
// the threads claim as they come free (the caller and most workers the first unclaimed one; the
// first worker, as in every region, the last: `prefetch_hint`): a thread that starts late or
// runs slower (a worker woken a moment after the caller, a vCPU the host is sharing) takes
// fewer, so the region ends when the work does rather than when the slower fixed half does.
// For long regions over uniform items (a linear's output columns); each chunk costs one atomic
// claim.
void parallel_for_balanced(int64_t begin, int64_t end, int64_t grain, int64_t split,
                           const RangeFn& fn);

// `t.to(dtype)`, on the pool where it is float32 <-> bfloat16 of a contiguous tensor (bit for bit
// torch's conversion: round to nearest even). torch's copy would run an OpenMP region for a
// large tensor (a head's 49,152 logits), and OpenMP's threads then spin beside the pool's for
// the rest of the step.
at::Tensor convert(const at::Tensor& t, at::ScalarType dtype);

// n float32 values to bfloat16 bits as `convert` rounds them (torch's rounding: to nearest
// even; NaN to 0x7FC0), 16 at a time where the CPU has AVX-512 (F, BW, VL).
void to_bf16(const float* src, uint16_t* dst, int64_t n);

// Which bytes the next region will read: the pool's first worker, which takes a region's
// chunks from the back, prefetches the last kPrefetchHintBytes of them into its L2 while it
// waits for the region (the caller meanwhile doing the serial steps before it). A decode step
// names each packed weight before the glue that precedes it: on a machine whose memory
// bandwidth bounds batch-1 decode, the bus otherwise idles through that glue. Only a hint: the
// bytes need not stay valid (a prefetch never faults), and a newer hint replaces it.
constexpr int64_t kPrefetchHintBytes = int64_t{1} << 18;
void prefetch_hint(const void* data, int64_t bytes);

// How many times the pool has switched its workers to passive waiting (`thread_pool.cpp`:
// a caller kept waiting by a worker preempted on an oversubscribed machine), since the library
// loaded: `torch.ops.arborlm.pool_passive_switches()`.
int64_t pool_passive_switches();

}  // namespace arborlm_cpu
