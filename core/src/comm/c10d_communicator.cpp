// The one place Tessera calls c10d. Compiles against LibTorch 1.13 (ProcessGroupGloo is a
// ProcessGroup) and 2.x (it is a Backend with the same collective methods).
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>

#include "tessera/sdk/build_config.hpp"  // TESSERA_WITH_CUDA, before the #if below

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#if TESSERA_WITH_CUDA
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "tessera/core/comm.hpp"
#include "tessera/core/trace.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::core {

namespace {

using Clock = std::chrono::steady_clock;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

/// Gloo's own timeout throws from wait() with the collective's name; the watchdog only
/// backs it up this much later. NCCL gets this much more, so that the watchdog is first.
constexpr double kGlooBackstopS = 10.0;
constexpr double kNcclExtraTimeoutS = 30.0;

c10d::ReduceOp to_c10d(sdk::ReduceOp op) {
  switch (op) {
    case sdk::ReduceOp::sum:
    case sdk::ReduceOp::mean: return c10d::ReduceOp::SUM;  // mean = sum, then divide (Gloo has no AVG)
    case sdk::ReduceOp::max: return c10d::ReduceOp::MAX;
    case sdk::ReduceOp::min: return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

std::int64_t bytes_of(const at::Tensor& t) { return t.numel() * static_cast<std::int64_t>(t.element_size()); }

/// Every collective in flight in this process (world group and its splits), by tag. A
/// thread reports one that is still incomplete `deadline_s` after it started and ends the
/// rank: the backstop for a backend whose own timeout never fires (NCCL's watchdog is given
/// a longer one, so that the report names the collective) or a wait() never reached.
class InFlight {
 public:
  InFlight(std::int64_t rank, double timeout_s, double deadline_s)
      : rank_(rank), timeout_s_(timeout_s), deadline_s_(deadline_s), thread_([this] { watch(); }) {}
  ~InFlight() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  std::uint64_t add(const WorkPtr& work, const std::string& tag) {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_[next_] = Entry{work, tag, Clock::now()};
    return next_++;
  }
  void remove(std::uint64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.erase(id);
  }

 private:
  struct Entry {
    WorkPtr work;
    std::string tag;
    Clock::time_point start;
  };

  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      wake_.wait_for(lock, std::chrono::milliseconds(500));
      for (const auto& [id, entry] : entries_) {
        double waited = std::chrono::duration<double>(Clock::now() - entry.start).count();
        if (waited < deadline_s_ || entry.work->isCompleted()) continue;
        std::fprintf(stderr,
                     "tessera: rank %lld: %s, waiting %.0f s (collective timeout %.0f s): another rank stopped or "
                     "never reached this collective; stopping rank %lld\n",
                     static_cast<long long>(rank_), entry.tag.c_str(), waited, timeout_s_,
                     static_cast<long long>(rank_));
        std::fflush(stderr);
        std::_Exit(124);
      }
    }
  }

  std::int64_t rank_;
  double timeout_s_;
  double deadline_s_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::uint64_t next_ = 0;
  std::map<std::uint64_t, Entry> entries_;
  std::thread thread_;
};

/// A c10d Work plus the local step that completes the collective (copy-out, sum, divide).
class C10dHandle final : public CommHandle {
 public:
  C10dHandle(WorkPtr work, std::function<void()> finish, std::string tag, std::int64_t rank, double timeout_s,
             std::shared_ptr<InFlight> in_flight)
      : work_(std::move(work)), finish_(std::move(finish)), tag_(std::move(tag)), rank_(rank),
        timeout_s_(timeout_s), start_(Clock::now()), in_flight_(std::move(in_flight)) {
    if (work_ && in_flight_) id_ = in_flight_->add(work_, tag_);
  }
  ~C10dHandle() override {
    if (in_flight_) in_flight_->remove(id_);
  }

  void wait() override {
    if (done_) return;
    try {
      if (work_) work_->wait();
    } catch (const std::exception& e) {
      double waited = std::chrono::duration<double>(Clock::now() - start_).count();
      std::string reason = e.what();
      bool timed_out = reason.find("imed out") != std::string::npos || waited >= timeout_s_;
      TESSERA_FAIL("rank ", rank_, ": ", tag_, (timed_out ? " timed out" : " failed"), " after ",
                   static_cast<std::int64_t>(waited), " s (collective timeout ", timeout_s_,
                   " s): another rank stopped or never reached this collective. c10d: ",
                   reason.substr(0, reason.find('\n')));
    }
    done_ = true;
    if (in_flight_) in_flight_->remove(id_);
    if (finish_) finish_();
    trace::record(tag_, "collective", start_, Clock::now(), /*overlapping=*/true);  // issue to completion
  }

 private:
  WorkPtr work_;
  std::function<void()> finish_;
  std::string tag_;
  std::int64_t rank_;
  double timeout_s_;
  Clock::time_point start_;
  std::shared_ptr<InFlight> in_flight_;
  std::uint64_t id_ = 0;
  bool done_ = false;
};

/// Done already (one rank, or nothing to move).
class ReadyHandle final : public CommHandle {
 public:
  explicit ReadyHandle(std::function<void()> finish = {}) : finish_(std::move(finish)) {}
  void wait() override {
    if (finish_) std::exchange(finish_, nullptr)();
  }

 private:
  std::function<void()> finish_;
};

/// Gloo in 1.13 moves no bf16 (nor int16): gathers and all-to-alls move its bits as fp16,
/// a 16-bit type it does move; the bits are never interpreted on the way.
at::Tensor wire_view(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 ? t.view(at::kHalf) : t; }

template <typename Backend>
class C10dCommunicator final : public Communicator {
 public:
  C10dCommunicator(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<Backend> backend, std::int64_t rank,
                   std::int64_t size, double timeout_s, bool is_gloo, std::string name,
                   std::shared_ptr<InFlight> in_flight)
      : store_(std::move(store)), backend_(std::move(backend)), rank_(rank), size_(size), timeout_s_(timeout_s),
        is_gloo_(is_gloo), name_(std::move(name)), in_flight_(std::move(in_flight)) {}

  std::int64_t rank() const override { return rank_; }
  std::int64_t size() const override { return size_; }
  const CommStats& stats() const override { return stats_; }

  CommHandlePtr all_gather(at::Tensor output, const at::Tensor& input, const std::string& tag) override {
    TESSERA_CHECK(output.is_contiguous() && output.numel() == input.numel() * size_, "all_gather (", tag,
                  "): output must be contiguous with ", input.numel() * size_, " elements, has ", output.numel());
    count(stats_.all_gather_bytes, bytes_of(input) * (size_ - 1));
    at::Tensor in = wire_view(input.contiguous()).view({-1});
    at::Tensor out = wire_view(output).view({-1});
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (std::int64_t r = 0; r < size_; ++r) outputs[0].push_back(out.narrow(0, r * in.numel(), in.numel()));
    std::vector<at::Tensor> inputs{in};
    return handle(backend_->allgather(outputs, inputs), nullptr, tag);
  }

  CommHandlePtr reduce_scatter(at::Tensor output, const at::Tensor& input, sdk::ReduceOp op,
                               const std::string& tag) override {
    TESSERA_CHECK(input.numel() == output.numel() * size_, "reduce_scatter (", tag, "): input has ", input.numel(),
                  " elements, expected ", output.numel() * size_, " (world ", size_, " x output)");
    count(stats_.reduce_scatter_bytes, bytes_of(output) * (size_ - 1));
    // all_to_all + local sum: each rank receives every rank's copy of its own chunk, the same
    // bytes on the wire as a ring reduce-scatter (the 1.13 Gloo backend has no reduce_scatter).
    at::Tensor in = input.contiguous().view({-1});
    at::Tensor received = at::empty_like(in);
    std::vector<std::int64_t> splits;
    at::Tensor wire_out = wire_view(received), wire_in = wire_view(in);
    WorkPtr work = backend_->alltoall_base(wire_out, wire_in, splits, splits);
    std::int64_t n = size_;
    return handle(work, [received, output, op, n]() mutable { reduce_rows(received.view({n, -1}), output, op); }, tag);
  }

  CommHandlePtr all_reduce(at::Tensor tensor, sdk::ReduceOp op, const std::string& tag) override {
    count(stats_.all_reduce_bytes, bytes_of(tensor));
    bool low_precision = is_gloo_ && (tensor.scalar_type() == at::kBFloat16 || tensor.scalar_type() == at::kHalf);
    at::Tensor wire = low_precision || !tensor.is_contiguous() ? tensor.to(at::kFloat).contiguous() : tensor;
    std::vector<at::Tensor> tensors{wire};
    c10d::AllreduceOptions options;
    options.reduceOp = to_c10d(op);
    WorkPtr work = backend_->allreduce(tensors, options);
    std::int64_t n = size_;
    return handle(work, [tensor, wire, op, n]() mutable {
      if (op == sdk::ReduceOp::mean) wire.div_(static_cast<double>(n));
      if (!wire.is_same(tensor)) tensor.copy_(wire);
    }, tag);
  }

  CommHandlePtr broadcast(at::Tensor tensor, std::int64_t src, const std::string& tag) override {
    if (rank_ == src) count(stats_.broadcast_bytes, bytes_of(tensor));
    at::Tensor wire = tensor.is_contiguous() ? wire_view(tensor) : wire_view(tensor.contiguous());
    std::vector<at::Tensor> tensors{wire};
    c10d::BroadcastOptions options;
    options.rootRank = src;
    WorkPtr work = backend_->broadcast(tensors, options);
    return handle(work, [tensor, wire]() mutable {
      if (wire.data_ptr() != tensor.data_ptr()) tensor.copy_(wire.view(tensor.scalar_type()).view(tensor.sizes()));
    }, tag);
  }

  CommHandlePtr all_to_all(at::Tensor output, const at::Tensor& input, const std::string& tag) override {
    count(stats_.all_to_all_bytes, bytes_of(input) / size_ * (size_ - 1));
    at::Tensor in = wire_view(input.contiguous());
    std::vector<std::int64_t> splits;
    at::Tensor out = wire_view(output);
    return handle(backend_->alltoall_base(out, in, splits, splits), nullptr, tag);
  }

  void barrier(const std::string& tag) override {
    ++stats_.calls;
    handle(backend_->barrier(c10d::BarrierOptions()), nullptr, "barrier " + tag)->wait();
  }

  std::shared_ptr<Communicator> split(const std::vector<std::vector<std::int64_t>>& groups) override {
    std::int64_t index = split_count_++;
    for (std::size_t g = 0; g < groups.size(); ++g) {
      const auto& members = groups[g];
      auto it = std::find(members.begin(), members.end(), rank_);
      if (it == members.end()) continue;
      std::string prefix = name_ + "/split" + std::to_string(index) + "/" + std::to_string(g);
      auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, store_);
      std::int64_t group_rank = it - members.begin();
      std::int64_t group_size = static_cast<std::int64_t>(members.size());
      return std::make_shared<C10dCommunicator<Backend>>(store, make_backend(store, group_rank, group_size),
                                                         group_rank, group_size, timeout_s_, is_gloo_, prefix,
                                                         in_flight_);
    }
    TESSERA_FAIL("split(): rank ", rank_, " is in none of the ", groups.size(), " groups");
  }

  /// Creates this backend type on `store` (used for the world group and for splits).
  c10::intrusive_ptr<Backend> make_backend(const c10::intrusive_ptr<c10d::Store>& store, std::int64_t rank,
                                           std::int64_t size) const;

 private:
  void count(std::int64_t& bytes, std::int64_t n) {
    bytes += n;
    ++stats_.calls;
  }

  CommHandlePtr handle(WorkPtr work, std::function<void()> finish, const std::string& tag) {
    return std::make_shared<C10dHandle>(std::move(work), std::move(finish), tag, rank_, timeout_s_, in_flight_);
  }

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<Backend> backend_;
  std::int64_t rank_;
  std::int64_t size_;
  double timeout_s_;
  bool is_gloo_;
  std::string name_;
  std::int64_t split_count_ = 0;
  std::shared_ptr<InFlight> in_flight_;
  CommStats stats_;
};

c10::intrusive_ptr<c10d::ProcessGroupGloo> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, std::int64_t rank,
                                                     std::int64_t size, double timeout_s, const std::string& host) {
  auto options = c10d::ProcessGroupGloo::Options::create(
      std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000)));
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"))
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  else if (host == "127.0.0.1" || host == "localhost")
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  else
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(rank), static_cast<int>(size), options);
}

template <>
c10::intrusive_ptr<c10d::ProcessGroupGloo> C10dCommunicator<c10d::ProcessGroupGloo>::make_backend(
    const c10::intrusive_ptr<c10d::Store>& store, std::int64_t rank, std::int64_t size) const {
  return make_gloo(store, rank, size, timeout_s_, "127.0.0.1");
}

#if TESSERA_WITH_CUDA
c10::intrusive_ptr<c10d::ProcessGroupNCCL> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, std::int64_t rank,
                                                     std::int64_t size, double timeout_s) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  // NCCL's own watchdog aborts without naming the collective: ours (InFlight) fires first.
  options->timeout = std::chrono::milliseconds(static_cast<std::int64_t>((timeout_s + kNcclExtraTimeoutS) * 1000));
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, static_cast<int>(rank), static_cast<int>(size), options);
}

template <>
c10::intrusive_ptr<c10d::ProcessGroupNCCL> C10dCommunicator<c10d::ProcessGroupNCCL>::make_backend(
    const c10::intrusive_ptr<c10d::Store>& store, std::int64_t rank, std::int64_t size) const {
  return make_nccl(store, rank, size, timeout_s_);
}
#endif

/// One rank: every collective is the identity (reductions over one rank).
class LocalCommunicator final : public Communicator {
 public:
  std::int64_t rank() const override { return 0; }
  std::int64_t size() const override { return 1; }
  const CommStats& stats() const override { return stats_; }
  CommHandlePtr all_gather(at::Tensor output, const at::Tensor& input, const std::string&) override {
    output.view({-1}).copy_(input.reshape({-1}));
    return std::make_shared<ReadyHandle>();
  }
  CommHandlePtr reduce_scatter(at::Tensor output, const at::Tensor& input, sdk::ReduceOp, const std::string&) override {
    output.view({-1}).copy_(input.reshape({-1}));
    return std::make_shared<ReadyHandle>();
  }
  CommHandlePtr all_reduce(at::Tensor, sdk::ReduceOp, const std::string&) override {
    return std::make_shared<ReadyHandle>();
  }
  CommHandlePtr broadcast(at::Tensor, std::int64_t, const std::string&) override {
    return std::make_shared<ReadyHandle>();
  }
  CommHandlePtr all_to_all(at::Tensor output, const at::Tensor& input, const std::string&) override {
    output.copy_(input);
    return std::make_shared<ReadyHandle>();
  }
  void barrier(const std::string&) override {}
  std::shared_ptr<Communicator> split(const std::vector<std::vector<std::int64_t>>&) override {
    return std::make_shared<LocalCommunicator>();
  }

 private:
  CommStats stats_;
};

}  // namespace

void reduce_rows(const at::Tensor& rows, at::Tensor output, sdk::ReduceOp op) {
  const double n = static_cast<double>(rows.size(0));
  if (rows.scalar_type() == at::kFloat && output.is_contiguous() &&
      (op == sdk::ReduceOp::sum || op == sdk::ReduceOp::mean)) {  // sum straight into the output
    at::Tensor out = output.view({-1});
    at::sum_out(out, rows, {0});
    if (op == sdk::ReduceOp::mean) out.div_(n);
    return;
  }
  at::Tensor chunks = rows.to(at::kFloat);
  at::Tensor reduced = op == sdk::ReduceOp::max   ? std::get<0>(chunks.max(0))
                       : op == sdk::ReduceOp::min ? std::get<0>(chunks.min(0))
                                                  : chunks.sum(0);
  if (op == sdk::ReduceOp::mean) reduced.div_(n);
  output.view({-1}).copy_(reduced);
}

CommunicatorPtr make_local_communicator() { return std::make_shared<LocalCommunicator>(); }

CommunicatorPtr make_communicator(const sdk::ClusterInfo& cluster, const c10::Device& device) {
  TESSERA_CHECK(cluster.master_port > 0 && cluster.master_port < 65536, "MASTER_PORT ", cluster.master_port,
                " is not a valid port");
  double timeout_s = static_cast<double>(cluster.collective_timeout_s);
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(cluster.master_port);
  options.isServer = cluster.global_rank == 0;
  options.numWorkers = static_cast<std::size_t>(cluster.world_size);
  options.waitWorkers = true;
  options.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000));
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(cluster.master_addr, options);
  } catch (const std::exception& e) {
    std::string reason = e.what();
    TESSERA_FAIL("rank ", cluster.global_rank, ": rendezvous at ", cluster.master_addr, ":", cluster.master_port,
                 " failed (", reason.substr(0, reason.find('\n')), ")",
                 cluster.global_rank == 0 ? ": is the port already in use? Choose another [launch] master_port."
                                          : ": is rank 0 running and reachable?");
  }
  if (device.is_cuda()) {
#if TESSERA_WITH_CUDA
    return std::make_shared<C10dCommunicator<c10d::ProcessGroupNCCL>>(
        store, make_nccl(store, cluster.global_rank, cluster.world_size, timeout_s), cluster.global_rank,
        cluster.world_size, timeout_s, false, "world",
        std::make_shared<InFlight>(cluster.global_rank, timeout_s, timeout_s));
#else
    TESSERA_FAIL("CUDA tensors need NCCL, but this tessera was built without CUDA");
#endif
  }
  return std::make_shared<C10dCommunicator<c10d::ProcessGroupGloo>>(
      store, make_gloo(store, cluster.global_rank, cluster.world_size, timeout_s, cluster.master_addr),
      cluster.global_rank, cluster.world_size, timeout_s, true, "world",
      std::make_shared<InFlight>(cluster.global_rank, timeout_s, timeout_s + kGlooBackstopS));
}

}  // namespace tessera::core
