// `arborlm_cpu::parallel_for`: the kernels' own thread pool (`thread_pool.h` says why).

#include "thread_pool.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <fcntl.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>

namespace arborlm_cpu {
namespace {

using Clock = std::chrono::steady_clock;

// How long an idle worker spins before it sleeps (`ARBORLM_POOL_SPIN_US`).
int64_t spin_us_from_env() {
  const char* v = std::getenv("ARBORLM_POOL_SPIN_US");
  if (v == nullptr || *v == '\0') return 1000;
  char* end = nullptr;
  const long long us = std::strtoll(v, &end, 10);
  return end != v && us >= 0 ? static_cast<int64_t>(us) : 1000;
}

constexpr int kYieldEvery = 64;  // pause instructions between sched_yield calls of a spin
// The machine counts as oversubscribed when, after its own chunks, the caller waited this long
// for a worker's (and over a quarter of its own chunks' time) and more threads are runnable than
// there are CPUs (`oversubscribed`): a worker was preempted holding a chunk. Workers then sleep
// at once after each region, as OpenMP's passive policy does, for `kPassiveFor`, and spin again
// after.
constexpr auto kContendedWait = std::chrono::microseconds(200);
constexpr auto kPassiveFor = std::chrono::milliseconds(100);

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr,
          nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
}

// Whether more threads are runnable than the machine has CPUs online (both counted system-wide:
// /proc/loadavg's "running/total" field). Asked only when a wait looked like a preempted worker:
// on a quiet VM a long region's halves also differ by hundreds of microseconds, and a worker
// that slept answers its wake-up that late, so without this check the pool went passive on a
// quiet machine and, every region then waking its workers, stayed so.
bool oversubscribed() {
  const int fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return true;  // unknown: as if it were
  char buf[128];
  const ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return true;
  buf[n] = '\0';
  const char* slash = std::strchr(buf, '/');
  if (slash == nullptr) return true;
  const char* p = slash;
  while (p > buf && p[-1] >= '0' && p[-1] <= '9') --p;
  const long running = std::strtol(p, nullptr, 10);
  return running > sysconf(_SC_NPROCESSORS_ONLN);
}

constexpr uint64_t kChunkMask = 0xffff;  // a ticket's chunk fields
constexpr int64_t kMaxChunks = static_cast<int64_t>(kChunkMask);  // chunks of a region, at most

thread_local bool in_region = false;  // this thread is running a region's chunk
std::atomic<int64_t> passive_switches{0};  // times any pool of the process went passive

class Pool {
 public:
  // Runs fn over [begin, end) in `tasks` chunks of `chunk` items on up to `threads` threads,
  // the caller one of them. Returns false when another thread's region holds the pool.
  bool run(int64_t begin, int64_t end, int64_t chunk, int64_t tasks, int64_t threads,
           const RangeFn& fn) {
    std::unique_lock<std::mutex> hold(call_, std::try_to_lock);
    if (!hold.owns_lock()) return false;
    grow(std::min(tasks, threads) - 1);
    active_.store(threads - 1, std::memory_order_relaxed);
    fn_ = &fn;
    begin_ = begin;
    end_ = end;
    chunk_ = chunk;
    done_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    const uint64_t gen = (ticket_.load(std::memory_order_relaxed) >> 32) + 1;
    // Publishes the fields above: a worker reads them only after claiming a chunk of `gen`.
    ticket_.store(gen << 32 | static_cast<uint64_t>(tasks), std::memory_order_release);
    signal_.fetch_add(1);
    if (sleepers_.load() > 0) futex_wake_all(&signal_);
    const auto start = Clock::now();
    while (claim(gen, false)) {
    }
    // The chunks claimed by workers: spin (yielding) until they finish; a worker holding one
    // was running a moment ago, so the wait is short unless the machine is oversubscribed.
    if (done_.load(std::memory_order_acquire) != tasks) {
      const auto mine_done = Clock::now();
      for (int i = 1; done_.load(std::memory_order_acquire) != tasks; ++i) {
        _mm_pause();
        if (i % kYieldEvery == 0) sched_yield();
      }
      const auto waited = Clock::now() - mine_done;
      if (waited > kContendedWait && waited * 4 > mine_done - start && oversubscribed()) {
        passive_until_.store((Clock::now() + kPassiveFor).time_since_epoch().count(),
                             std::memory_order_relaxed);
        passive_switches.fetch_add(1, std::memory_order_relaxed);
      }
    }
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
    return true;
  }

 private:
  // Claims and runs the first unclaimed chunk of region `gen` (with `from_back`, the last);
  // false when none is left (or `gen` is over).
  bool claim(uint64_t gen, bool from_back) {
    // The unclaimed chunks travel in the ticket itself: checked apart (a field of the pool), a
    // worker holding a ticket of a region that has just ended could read the next region's
    // larger count before its ticket is published, and its claim then succeeded on the old
    // ticket, ran a chunk with the next region's fields and counted it as done there.
    uint64_t t = ticket_.load(std::memory_order_acquire);
    uint64_t task;
    for (;;) {
      const uint64_t front = (t >> 16) & kChunkMask, back = t & kChunkMask;
      if ((t >> 32) != gen || front >= back) return false;
      task = from_back ? back - 1 : front;
      const uint64_t next = from_back ? t - 1 : t + (uint64_t{1} << 16);
      if (ticket_.compare_exchange_weak(t, next, std::memory_order_acq_rel)) break;
    }
    const int64_t b = begin_ + static_cast<int64_t>(task) * chunk_;
    const int64_t e = std::min(end_, b + chunk_);
    in_region = true;
    try {
      if (b < e) (*fn_)(b, e);
    } catch (...) {
      std::lock_guard<std::mutex> g(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
    in_region = false;
    done_.fetch_add(1, std::memory_order_acq_rel);
    return true;
  }

  // Starts workers up to `workers`. Where the system refuses a thread, the pool goes on with
  // those it has: the caller claims whatever chunks no worker takes.
  void grow(int64_t workers) {
    while (workers_ < workers) {
      try {
        std::thread([this, id = workers_] { work(id); }).detach();
      } catch (const std::system_error&) {
        return;
      }
      ++workers_;
    }
  }

  // Where a worker's prefetching of a hinted range has got to (`prefetch_hint`).
  struct Prefetching {
    uint64_t hint = 0;  // the last hint seen
    const uint8_t* begin = nullptr;
    const uint8_t* next = nullptr;  // the range's lines below this one are still to be fetched
  };

  // Worker `id` (0, 1, ...): it takes chunks of the regions that allow as many workers (a
  // region asks for fewer threads than the pool has grown to after set_num_threads lowers them).
  // Worker 0 takes them from the back, where it has prefetched the hinted weight's end.
  void work(int64_t id) {
    uint32_t seen = signal_.load(std::memory_order_acquire);
    Prefetching fetching;
    for (;;) {
      seen = wait_for_signal(seen, id == 0 ? &fetching : nullptr);
      const uint64_t gen = ticket_.load(std::memory_order_acquire) >> 32;
      if (id >= active_.load(std::memory_order_relaxed)) continue;
      while (claim(gen, id == 0)) {
      }
    }
  }

  // Waits until `signal_` moves past `seen`: spinning (yielding now and then, so that on a busy
  // machine the threads that have work run) for up to `spin_us_`, then asleep on the futex; at
  // once while the machine counts as oversubscribed (`kContendedWait`). With `fetching`, the
  // spin first prefetches the hinted range into this core's L2, from its end down, a few lines
  // between looks at the signal.
  uint32_t wait_for_signal(uint32_t seen, Prefetching* fetching) {
    const auto now = Clock::now();
    const bool passive =
        now.time_since_epoch().count() < passive_until_.load(std::memory_order_relaxed);
    const auto until = now + std::chrono::microseconds(passive ? 0 : spin_us_);
    for (int i = 1; !passive; ++i) {
      const uint32_t sig = signal_.load(std::memory_order_acquire);
      if (sig != seen) return sig;
      if (fetching != nullptr && prefetch_some(*fetching)) continue;
      _mm_pause();
      if (i % kYieldEvery == 0) {
        if (Clock::now() >= until) break;
        sched_yield();
      }
    }
    for (;;) {
      // seq_cst with `run`'s bump and check: either it sees this sleeper or this sees the bump
      sleepers_.fetch_add(1);
      if (signal_.load() == seen) futex_wait(&signal_, seen);
      sleepers_.fetch_sub(1, std::memory_order_acq_rel);
      const uint32_t after = signal_.load(std::memory_order_acquire);
      if (after != seen) return after;
    }
  }

  // Prefetches up to kLinesPerLook more lines of the latest hint; false when none were left.
  bool prefetch_some(Prefetching& f) {
    const uint64_t hint = hint_seq_.load(std::memory_order_acquire);
    if (hint != f.hint) {  // a new range (a torn pair is harmless: prefetches never fault)
      f.hint = hint;
      f.begin = hint_begin_.load(std::memory_order_relaxed);
      f.next = hint_end_.load(std::memory_order_relaxed);
    }
    if (f.next <= f.begin) return false;
    for (int k = 0; k < kLinesPerLook && f.next > f.begin; ++k) {
      f.next -= 64;
      _mm_prefetch(reinterpret_cast<const char*>(f.next), _MM_HINT_T1);
    }
    return true;
  }

 public:
  void hint(const uint8_t* begin, const uint8_t* end) {
    hint_begin_.store(begin, std::memory_order_relaxed);
    hint_end_.store(end, std::memory_order_relaxed);
    hint_seq_.fetch_add(1, std::memory_order_release);
  }

 private:
  static constexpr int kLinesPerLook = 8;
  std::mutex call_;
  // region generation << 32 | the first unclaimed chunk << 16 | the end of the unclaimed ones
  std::atomic<uint64_t> ticket_{0};
  std::atomic<uint32_t> signal_{0};  // bumped per region; workers sleep on it
  std::atomic<const uint8_t*> hint_begin_{nullptr}, hint_end_{nullptr};  // `prefetch_hint`'s
  std::atomic<uint64_t> hint_seq_{0};  // bumped per hint
  std::atomic<int> sleepers_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<Clock::rep> passive_until_{0};  // workers sleep at once before this time
  const RangeFn* fn_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 0;
  std::atomic<int64_t> active_{0};  // workers the region allows (ids below it)
  std::exception_ptr error_;
  std::mutex error_mutex_;
  int64_t workers_ = 0;  // guarded by call_
  const int64_t spin_us_ = spin_us_from_env();
};

Pool* make_pool();

Pool* the_pool = make_pool();  // never destroyed: its detached workers outlive exit's cleanup

// Run once, as the library loads.
Pool* make_pool() {
  // A forked child has none of the workers (nor perhaps a lock another thread held): it
  // starts a pool of its own (the parent's is left as it is, leaked).
  pthread_atfork(nullptr, nullptr, [] { the_pool = new Pool(); });
  return new Pool();
}

Pool& pool() { return *the_pool; }

}  // namespace

void parallel_for_balanced(int64_t begin, int64_t end, int64_t grain, int64_t split,
                           const RangeFn& fn) {
  if (begin >= end) return;
  const int64_t n = end - begin, g = std::max<int64_t>(grain, 1);
  const int64_t threads = std::max<int64_t>(at::get_num_threads(), 1);
  const int64_t tasks =
      std::min({threads * std::max<int64_t>(split, 1), (n + g - 1) / g, kMaxChunks});
  if (threads <= 1 || tasks <= 1 || in_region || at::in_parallel_region()) {
    fn(begin, end);
    return;
  }
  const int64_t chunk = (n + tasks - 1) / tasks;
  if (!pool().run(begin, end, chunk, (n + chunk - 1) / chunk, threads, fn)) fn(begin, end);
}

void parallel_for(int64_t begin, int64_t end, int64_t grain, const RangeFn& fn) {
  parallel_for_balanced(begin, end, grain, 1, fn);
}

namespace {

// float32 -> bfloat16 bits, as c10::BFloat16's constructor: round to nearest even, NaN -> 0x7FC0.
inline uint16_t to_bf16_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (f != f) return 0x7FC0;
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// The same on 16 lanes at a time (the scalar loop took ~1 ns a value: 4 us for a 4,096-wide
// decode row, more than the rest of a small linear's glue).
__attribute__((target("avx512f,avx512bw,avx512vl"))) void narrow_avx512(const float* src,
                                                                      uint16_t* dst, int64_t n) {
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF);
  const __m256i nan = _mm256_set1_epi16(0x7FC0);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(src + i);
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, bias), odd), 16);
    const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __m256i packed = _mm512_cvtepi32_epi16(rounded);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_mask_blend_epi16(is_nan, packed, nan));
  }
  for (; i < n; ++i) dst[i] = to_bf16_bits(src[i]);
}

}  // namespace

void to_bf16(const float* src, uint16_t* dst, int64_t n) {
  static const bool wide = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f") &&
                                                      __builtin_cpu_supports("avx512bw") &&
                                                      __builtin_cpu_supports("avx512vl"));
  if (wide) return narrow_avx512(src, dst, n);
  for (int64_t i = 0; i < n; ++i) dst[i] = to_bf16_bits(src[i]);
}

at::Tensor convert(const at::Tensor& t, at::ScalarType dtype) {
  const at::ScalarType from = t.scalar_type();
  if (from == dtype) return t;
  const bool widen = from == at::kBFloat16 && dtype == at::kFloat;
  const bool narrow = from == at::kFloat && dtype == at::kBFloat16;
  if (!(widen || narrow) || !t.is_contiguous() || t.device().type() != at::kCPU) {
    return t.to(dtype);
  }
  at::Tensor out = at::empty(t.sizes(), t.options().dtype(dtype));
  constexpr int64_t kGrain = int64_t{1} << 14;
  if (widen) {
    const auto* src = reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
    auto* dst = reinterpret_cast<uint32_t*>(out.data_ptr<float>());
    parallel_for(0, t.numel(), kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) dst[i] = static_cast<uint32_t>(src[i]) << 16;
    });
  } else {
    const float* src = t.data_ptr<float>();
    auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    parallel_for(0, t.numel(), kGrain, [&](int64_t begin, int64_t end) {
      to_bf16(src + begin, dst + begin, end - begin);
    });
  }
  return out;
}

void prefetch_hint(const void* data, int64_t bytes) {
  const auto* begin = static_cast<const uint8_t*>(data);
  const int64_t n = std::min(bytes, kPrefetchHintBytes);
  if (n > 0) pool().hint(begin + (bytes - n), begin + bytes);
}

int64_t pool_passive_switches() { return passive_switches.load(std::memory_order_relaxed); }

}  // namespace arborlm_cpu

TORCH_LIBRARY_FRAGMENT(arborlm, m) {
  m.def("pool_passive_switches() -> int");
  m.def("convert(Tensor x, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(arborlm, CatchAll, m) {
  m.impl("pool_passive_switches", &arborlm_cpu::pool_passive_switches);
}

TORCH_LIBRARY_IMPL(arborlm, CPU, m) { m.impl("convert", &arborlm_cpu::convert); }
