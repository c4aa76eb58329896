#include "shared_memory_channel.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "host_layout.hpp"
#include "serial_work_queue.hpp"
#include "store_text.hpp"
#include "cluster/cluster.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::core::detail {

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kMagic = 0x31617265737365'74;  // "tessera1"
constexpr int kSpins = 1000;                             // before sleeping on the futex
constexpr auto kSleep = std::chrono::milliseconds(50);   // futex wait, then check stop/peers
constexpr double kLivenessIntervalS = 0.1;

/// One rank's progress: the last round it wrote its slot for, and the last it finished reading.
struct alignas(64) Counter {
  std::atomic<std::uint32_t> value{0};
};
struct RankCounters {
  Counter written;
  Counter read;
};
struct alignas(64) Header {
  std::uint64_t magic;
  std::int64_t world;
  std::int64_t slot_bytes;
};

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

std::size_t layout_counters() { return round_up(sizeof(Header), 4096); }
std::size_t layout_slots(std::int64_t world) {
  return round_up(layout_counters() + sizeof(RankCounters) * static_cast<std::size_t>(world), 4096);
}
std::size_t layout_bytes(std::int64_t world) {
  return layout_slots(world) + static_cast<std::size_t>(world * SharedMemoryChannel::kBuffers) *
                                   static_cast<std::size_t>(SharedMemoryChannel::kSlotBytes);
}

/// False once `pid` is gone or a zombie (its launcher has not reaped it yet).
bool alive(pid_t pid) {
  const char state = core::process_state(pid);
  return state != 0 && state != 'Z' && state != 'X';
}

void wake(std::atomic<std::uint32_t>& word) {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

bool reached(std::uint32_t value, std::uint32_t target) {
  return static_cast<std::int32_t>(value - target) >= 0;  // wrap-safe
}

/// dst[i] := op over sources (in rank order) of src[i], accumulating in Acc; mean divides by
/// the number of sources at the end (as the Gloo path's sum, then divide).
template <typename T, typename Acc>
void reduce_typed(const std::vector<const std::byte*>& sources, std::byte* dst_bytes, std::int64_t n,
                  sdk::ReduceOp op, std::vector<float>& scratch) {
  T* dst = reinterpret_cast<T*>(dst_bytes);
  const T* first = reinterpret_cast<const T*>(sources[0]);
  const bool sum = op == sdk::ReduceOp::sum || op == sdk::ReduceOp::mean;
  const bool max = op == sdk::ReduceOp::max;
  Acc* acc;
  if constexpr (std::is_same_v<T, Acc>) {
    acc = dst;
    if (static_cast<const void*>(first) != static_cast<void*>(dst)) std::memmove(dst, first, sizeof(T) * n);
  } else {
    scratch.resize(static_cast<std::size_t>(n));
    acc = scratch.data();
    for (std::int64_t i = 0; i < n; ++i) acc[i] = static_cast<Acc>(first[i]);
  }
  for (std::size_t s = 1; s < sources.size(); ++s) {
    const T* __restrict src = reinterpret_cast<const T*>(sources[s]);
    Acc* __restrict a = acc;
    if (sum) {
      for (std::int64_t i = 0; i < n; ++i) a[i] += static_cast<Acc>(src[i]);
    } else {
      for (std::int64_t i = 0; i < n; ++i) {
        Acc v = static_cast<Acc>(src[i]);
        if constexpr (std::is_floating_point_v<Acc>) {  // NaN wins, as at::max/min
          if (std::isnan(a[i])) continue;
          if (std::isnan(v)) {
            a[i] = v;
            continue;
          }
        }
        if (max ? v > a[i] : v < a[i]) a[i] = v;
      }
    }
  }
  if (op == sdk::ReduceOp::mean) {
    const Acc count = static_cast<Acc>(sources.size());
    for (std::int64_t i = 0; i < n; ++i) acc[i] /= count;
  }
  if constexpr (!std::is_same_v<T, Acc>)
    for (std::int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(acc[i]);
}

void reduce(at::ScalarType dtype, const std::vector<const std::byte*>& sources, std::byte* dst, std::int64_t n,
            sdk::ReduceOp op, std::vector<float>& scratch) {
  switch (dtype) {
    case at::kFloat: return reduce_typed<float, float>(sources, dst, n, op, scratch);
    case at::kDouble: return reduce_typed<double, double>(sources, dst, n, op, scratch);
    case at::kBFloat16: return reduce_typed<c10::BFloat16, float>(sources, dst, n, op, scratch);
    case at::kHalf: return reduce_typed<c10::Half, float>(sources, dst, n, op, scratch);
    case at::kInt: return reduce_typed<std::int32_t, std::int32_t>(sources, dst, n, op, scratch);
    case at::kLong: return reduce_typed<std::int64_t, std::int64_t>(sources, dst, n, op, scratch);
    default: TESSERA_FAIL("shared-memory reduction of ", dtype, " is not implemented");
  }
}

std::byte* bytes(const at::Tensor& t) { return static_cast<std::byte*>(t.data_ptr()); }

}  // namespace

struct SharedMemoryChannel::Impl {
  std::int64_t rank = 0;
  std::int64_t world = 1;
  double timeout_s = 0;
  std::vector<pid_t> pids;
  void* base = MAP_FAILED;
  std::size_t length = 0;

  // The worker thread's state.
  std::uint64_t rounds = 0;
  Clock::time_point deadline;
  Clock::time_point next_liveness_check;
  std::vector<float> scratch;
  SerialWorkQueue queue;

  ~Impl() {
    queue.close();  // before the segment goes: the worker may be inside a round
    if (base != MAP_FAILED) ::munmap(base, length);
  }

  RankCounters& counters(std::int64_t r) const {
    return reinterpret_cast<RankCounters*>(static_cast<std::byte*>(base) + layout_counters())[r];
  }
  std::byte* slot(std::int64_t r, std::uint64_t round) const {
    return static_cast<std::byte*>(base) + layout_slots(world) +
           static_cast<std::size_t>(r * kBuffers + static_cast<std::int64_t>(round % kBuffers)) *
               static_cast<std::size_t>(kSlotBytes);
  }

  /// Where rank q's piece of a chunk of `len` elements split over the group begins (rank
  /// `world`'s: the chunk's end).
  std::int64_t piece_begin(std::int64_t q, std::int64_t len) const { return len * q / world; }

  /// Waits until rank `peer`'s `word` reaches `target`: spins briefly, then sleeps on the
  /// futex; throws when the channel stops, the peer is gone, or the deadline passes.
  void await(std::atomic<std::uint32_t>& word, std::uint32_t target, std::int64_t peer) {
    for (int i = 0; i < kSpins; ++i) {
      if (reached(word.load(std::memory_order_acquire), target)) return;
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
    for (;;) {
      std::uint32_t seen = word.load(std::memory_order_acquire);
      if (reached(seen, target)) return;
      timespec sleep{0, std::chrono::duration_cast<std::chrono::nanoseconds>(kSleep).count()};
      ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT, seen, &sleep, nullptr, 0);
      if (reached(word.load(std::memory_order_acquire), target)) return;
      if (queue.closing()) throw std::runtime_error("the shared-memory channel was closed");
      const Clock::time_point now = Clock::now();
      if (now >= next_liveness_check) {
        next_liveness_check = now + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(kLivenessIntervalS));
        for (std::int64_t q = 0; q < world; ++q)
          if (q != rank && !alive(pids[q]))
            throw std::runtime_error("rank " + std::to_string(q) + " (pid " + std::to_string(pids[q]) +
                                     ") exited; its shared-memory peers cannot go on");
      }
      if (now >= deadline)
        throw std::runtime_error("timed out after " + std::to_string(static_cast<std::int64_t>(timeout_s)) +
                                 " s waiting for rank " + std::to_string(peer) + " in shared memory");
    }
  }

  /// A round: every rank writes at most kSlotBytes into its slot (`write`), then reads the
  /// others' slots of this round `k` (`read`). A slot's buffer is reused kBuffers rounds
  /// later, once every rank has finished reading it.
  void round(const std::function<void(std::byte* mine)>& write, const std::function<void(std::uint64_t k)>& read) {
    const std::uint64_t k = ++rounds;
    const auto k32 = static_cast<std::uint32_t>(k);
    if (k > static_cast<std::uint64_t>(kBuffers))
      for (std::int64_t q = 0; q < world; ++q)
        if (q != rank) await(counters(q).read.value, k32 - kBuffers, q);
    write(slot(rank, k));
    counters(rank).written.value.store(k32, std::memory_order_release);
    wake(counters(rank).written.value);
    for (std::int64_t q = 0; q < world; ++q)
      if (q != rank) await(counters(q).written.value, k32, q);
    read(k);
    counters(rank).read.value.store(k32, std::memory_order_release);
    wake(counters(rank).read.value);
  }

  /// Runs `collective` on the worker thread, bounded by the timeout from its start.
  c10::intrusive_ptr<c10d::Work> submit(std::function<void()> collective) {
    return queue.submit([this, collective = std::move(collective)] {
      deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
      collective();
    });
  }
};

SharedMemoryChannel::SharedMemoryChannel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

SharedMemoryChannel::~SharedMemoryChannel() = default;

std::unique_ptr<SharedMemoryChannel> SharedMemoryChannel::open(c10d::Store& store, std::int64_t rank,
                                                               std::int64_t size, std::vector<pid_t> pids,
                                                               double timeout_s) {
  if (size < 2) return nullptr;
  auto impl = std::make_unique<Impl>();
  impl->rank = rank;
  impl->world = size;
  impl->timeout_s = timeout_s;
  impl->length = layout_bytes(size);
  impl->pids = std::move(pids);

  // Rank 0 makes the segment (space reserved up front: a full /dev/shm fails here, not
  // with SIGBUS mid-collective); the others map it; it is unlinked once all have it open.
  std::string name;
  if (rank == 0) {
    std::random_device random;
    name = "/tessera-" + std::to_string(::getpid()) + "-" + std::to_string(random());
    int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    bool made = fd >= 0 && ::posix_fallocate(fd, 0, static_cast<off_t>(impl->length)) == 0;
    if (made) impl->base = ::mmap(nullptr, impl->length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (fd >= 0) ::close(fd);
    if (impl->base != MAP_FAILED) {
      auto* header = static_cast<Header*>(impl->base);
      header->world = size;
      header->slot_bytes = kSlotBytes;
      header->magic = kMagic;
    } else {
      if (fd >= 0) ::shm_unlink(name.c_str());
      name.clear();
    }
    store.set("tessera/shm/segment", to_bytes(name));
  } else {
    name = to_string(store.get("tessera/shm/segment"));
    if (!name.empty()) {
      int fd = ::shm_open(name.c_str(), O_RDWR, 0);
      if (fd >= 0) {
        struct stat st {};
        if (::fstat(fd, &st) == 0 && static_cast<std::size_t>(st.st_size) == impl->length)
          impl->base = ::mmap(nullptr, impl->length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        ::close(fd);
      }
      if (impl->base != MAP_FAILED) {
        const auto* header = static_cast<const Header*>(impl->base);
        if (header->magic != kMagic || header->world != size || header->slot_bytes != kSlotBytes) {
          ::munmap(impl->base, impl->length);
          impl->base = MAP_FAILED;
        }
      }
    }
  }
  const bool everyone = on_every_rank(store, "tessera/shm/opened", rank, size, impl->base != MAP_FAILED);
  if (rank == 0 && !name.empty()) ::shm_unlink(name.c_str());  // nothing left in /dev/shm, even after a crash
  if (!everyone) return nullptr;
  return std::unique_ptr<SharedMemoryChannel>(new SharedMemoryChannel(std::move(impl)));
}

void SharedMemoryChannel::close() { impl_->queue.close(); }

std::string SharedMemoryChannel::describe() const {
  return "shared memory among the " + std::to_string(impl_->world) + " ranks of this host";
}

bool SharedMemoryChannel::reduces(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kBFloat16:
    case at::kHalf:
    case at::kInt:
    case at::kLong: return true;
    default: return false;
  }
}

c10::intrusive_ptr<c10d::Work> SharedMemoryChannel::all_gather(at::Tensor output, at::Tensor input) {
  Impl* self = impl_.get();
  return self->submit([self, output, input] {
    const auto n = static_cast<std::int64_t>(input.nbytes());
    std::byte* out = bytes(output);
    const std::byte* in = bytes(input);
    if (out + self->rank * n != in) std::memmove(out + self->rank * n, in, static_cast<std::size_t>(n));
    for (std::int64_t offset = 0; offset < n; offset += kSlotBytes) {
      const auto len = static_cast<std::size_t>(std::min(kSlotBytes, n - offset));
      self->round([&](std::byte* mine) { std::memcpy(mine, in + offset, len); },
                  [&](std::uint64_t k) {
                    for (std::int64_t q = 0; q < self->world; ++q)
                      if (q != self->rank) std::memcpy(out + q * n + offset, self->slot(q, k), len);
                  });
    }
  });
}

c10::intrusive_ptr<c10d::Work> SharedMemoryChannel::reduce_scatter(at::Tensor output, at::Tensor input,
                                                                    sdk::ReduceOp op) {
  Impl* self = impl_.get();
  return self->submit([self, output, input, op] {
    const std::int64_t n = output.numel(), es = static_cast<std::int64_t>(output.element_size());
    const std::int64_t per_round = std::max<std::int64_t>(1, kSlotBytes / (self->world * es));
    const std::byte* in = bytes(input);
    std::byte* out = bytes(output);
    // An output inside the input (reduced in place) is overwritten while it is still a source:
    // then this rank's own piece is read from its slot too.
    const bool in_place = out < in + input.nbytes() && in < out + output.nbytes();
    std::vector<const std::byte*> sources(static_cast<std::size_t>(self->world));
    for (std::int64_t offset = 0; offset < n; offset += per_round) {
      const std::int64_t len = std::min(per_round, n - offset);
      self->round(
          [&](std::byte* mine) {  // piece q of this rank's input goes to rank q
            for (std::int64_t q = 0; q < self->world; ++q)
              if (q != self->rank || in_place)
                std::memcpy(mine + q * len * es, in + (q * n + offset) * es, static_cast<std::size_t>(len * es));
          },
          [&](std::uint64_t k) {
            for (std::int64_t p = 0; p < self->world; ++p)
              sources[p] = p == self->rank && !in_place ? in + (self->rank * n + offset) * es
                                                        : self->slot(p, k) + self->rank * len * es;
            reduce(output.scalar_type(), sources, out + offset * es, len, op, self->scratch);
          });
    }
  });
}

c10::intrusive_ptr<c10d::Work> SharedMemoryChannel::all_reduce(at::Tensor tensor, sdk::ReduceOp op) {
  Impl* self = impl_.get();
  return self->submit([self, tensor, op] {
    const std::int64_t n = tensor.numel(), es = static_cast<std::int64_t>(tensor.element_size());
    const std::int64_t per_round = kSlotBytes / es;
    std::vector<const std::byte*> sources(static_cast<std::size_t>(self->world));
    for (std::int64_t offset = 0; offset < n; offset += per_round) {
      const std::int64_t len = std::min(per_round, n - offset);
      std::byte* chunk = bytes(tensor) + offset * es;
      // Whole: every rank reduces the whole chunk. Split: rank q reduces piece q, then the
      // pieces are gathered. Either way in rank order, so every rank gets the same bits.
      const bool split = len * es >= kSplitAllReduceBytes;
      const std::int64_t begin = split ? self->piece_begin(self->rank, len) : 0;
      const std::int64_t count = split ? self->piece_begin(self->rank + 1, len) - begin : len;
      self->round([&](std::byte* mine) { std::memcpy(mine, chunk, static_cast<std::size_t>(len * es)); },
                  [&](std::uint64_t k) {
                    for (std::int64_t p = 0; p < self->world; ++p) sources[p] = self->slot(p, k) + begin * es;
                    reduce(tensor.scalar_type(), sources, chunk + begin * es, count, op, self->scratch);
                  });
      if (!split) continue;
      self->round([&](std::byte* mine) { std::memcpy(mine, chunk + begin * es, static_cast<std::size_t>(count * es)); },
                  [&](std::uint64_t k) {
                    for (std::int64_t q = 0; q < self->world; ++q) {
                      if (q == self->rank) continue;
                      const std::int64_t at = self->piece_begin(q, len), size = self->piece_begin(q + 1, len) - at;
                      std::memcpy(chunk + at * es, self->slot(q, k), static_cast<std::size_t>(size * es));
                    }
                  });
    }
  });
}

}  // namespace tessera::core::detail
