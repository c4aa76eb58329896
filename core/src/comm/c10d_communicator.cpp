// The one place Tessera calls c10d. Compiles against LibTorch 1.13 (ProcessGroupGloo is a
// ProcessGroup) and 2.x (it is a Backend with the same collective methods).
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <optional>

#include "tessera/sdk/build_config.hpp"  // TESSERA_WITH_CUDA, before the #if below

#include <ATen/ATen.h>
#include <torch/version.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#if TESSERA_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "c10d_shared.hpp"
#include "gloo_collectives.hpp"
#include "hierarchical_collectives.hpp"
#include "host_staged_communicator.hpp"
#include "host_layout.hpp"
#include "shared_memory_channel.hpp"
#include "store_text.hpp"
#include "cluster/cluster.hpp"
#include "tessera/core/comm.hpp"
#include "trace/trace.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::core {

using namespace c10d_detail;
using detail::to_bytes;
using detail::to_c10d;
using detail::wire_view;

namespace {

/// Gloo's own timeout throws from wait() with the collective's name; the watchdog only
/// backs it up this much later. NCCL gets this much more, so that the watchdog is first.
constexpr double kGlooBackstopS = 10.0;
constexpr double kNcclExtraTimeoutS = 30.0;

/// A channel that a communicator abandons after a timeout (its worker may still sit in the
/// collective, and the destructor would join it): kept until the process exits, never destroyed,
/// and reachable from here, so that LeakSanitizer's check at exit does not count it.
void abandon(std::unique_ptr<detail::CollectiveChannel> channel) {
  static std::mutex mutex;
  static auto* kept = new std::vector<detail::CollectiveChannel*>;
  const std::lock_guard<std::mutex> lock(mutex);
  kept->push_back(channel.release());
}

std::int64_t bytes_of(const at::Tensor& t) { return t.numel() * static_cast<std::int64_t>(t.element_size()); }

/// What the Monitor may keep of a collective that the stream waits for: c10d's NCCL work copied
/// without its tensors (the copy NCCL's own watchdog keeps), so that watching it until the device
/// finishes does not keep a unit's buffers alive while the host runs ahead. Null otherwise.
WorkPtr watchable(const WorkPtr& work) {
#if TESSERA_WITH_CUDA
  if (auto* nccl = dynamic_cast<c10d::ProcessGroupNCCL::WorkNCCL*>(work.get()))
    return c10::make_intrusive<c10d::ProcessGroupNCCL::WorkNCCL>(*nccl);
#endif
  (void)work;
  return WorkPtr();
}

/// A c10d Work plus the local step that completes the collective (copy-out, sum, divide).
/// wait() waits up to the collective's timeout, then reports where every rank is.
class C10dHandle final : public CommHandle {
 public:
  /// `stream_ordered` (NCCL): wait() makes the current CUDA stream wait for the collective and
  /// returns, as PyTorch's FSDP does; the host runs ahead, and the Monitor watches the
  /// collective until the device finishes it. Otherwise wait() blocks up to the timeout.
  C10dHandle(WorkPtr work, std::function<void()> finish, std::string tag, std::int64_t global_rank,
             double collective_timeout_s, std::shared_ptr<Monitor> monitor, bool stream_ordered)
      : work_(std::move(work)), finish_(std::move(finish)), tag_(std::move(tag)), rank_(global_rank),
        start_(Clock::now()), monitor_(std::move(monitor)), stream_ordered_(stream_ordered) {
    checkpoint_ = is_checkpoint_phase(ledger_phase());
    if (checkpoint_) {
      std::lock_guard<std::mutex> lock(shared().mutex);
      timeout_s_ = shared().settings.checkpoint_s;
    } else {
      timeout_s_ = collective_timeout_s;
    }
    if (work_) {
      seq_ = detail::ledger_issue(tag_);
      if (monitor_) id_ = monitor_->add(work_, tag_, seq_, timeout_s_);
    }
  }
  ~C10dHandle() override {
    if (monitor_ && work_ && !(done_ && stream_ordered_)) monitor_->remove(id_);
  }

  void wait() override {
    if (done_) return;
    if (work_) {
      detail::ledger_wait(seq_, tag_);
      const Clock::time_point waiting = Clock::now();
      try {
        // A timeout makes c10d's NCCL work (LibTorch 2.x) block the host until the device
        // finished the collective: every unit's gather would wait for all the work queued before it.
        if (stream_ordered_) work_->wait();
        else work_->wait(std::chrono::milliseconds(std::max<std::int64_t>(1, static_cast<std::int64_t>(timeout_s_ * 1000))));
      } catch (const std::exception& e) {
        fail(e.what());
      }
      detail::ledger_done();
      trace::record(tag_, "collective-wait", waiting, Clock::now());  // the caller blocked: exposed communication
    }
    done_ = true;
    if (monitor_ && work_) stream_ordered_ ? monitor_->waited_on_device(id_, watchable(work_)) : monitor_->remove(id_);
    if (finish_) {
      const Clock::time_point local = Clock::now();
      finish_();
      trace::record(tag_, "collective-local", local, Clock::now());  // the caller's own half (sum, copy-out)
    }
    trace::record(tag_, "collective", start_, Clock::now(), /*overlapping=*/true);  // issue to completion
  }

 private:
  [[noreturn]] void fail(const std::string& what) {
    double waited = std::chrono::duration<double>(Clock::now() - start_).count();
    std::string reason = what.substr(0, what.find('\n'));
    bool timed_out = reason.find("imed out") != std::string::npos || waited >= timeout_s_ - 0.1;
    if (timed_out) shared().poisoned = true;
    Diagnosis d = diagnose_now(rank_, timed_out);
    {
      std::lock_guard<std::mutex> lock(shared().mutex);
      shared().last_failure = d;
    }
    TESSERA_FAIL("rank ", rank_, ": ", tag_, (timed_out ? " timed out" : " failed"), " after ",
                 static_cast<std::int64_t>(waited), " s (collective #", seq_, "; [launch] ",
                 (checkpoint_ ? "checkpoint_timeout_s" : "collective_timeout_s"), " = ", timeout_s_,
                 "). Hang report: ", d.text, ". c10d: ", reason);
  }

  WorkPtr work_;
  std::function<void()> finish_;
  std::string tag_;
  std::int64_t rank_;
  double timeout_s_ = 0;
  bool checkpoint_ = false;
  Clock::time_point start_;
  std::shared_ptr<Monitor> monitor_;
  std::uint64_t id_ = 0;
  std::int64_t seq_ = 0;
  bool stream_ordered_;
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

template <typename Backend>
class C10dCommunicator final : public Communicator {
 public:
  C10dCommunicator(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<Backend> backend, std::int64_t rank,
                   std::int64_t size, std::int64_t global_rank, double timeout_s, double backend_timeout_s,
                   bool is_gloo, std::string name, std::shared_ptr<Monitor> monitor, bool shared_memory)
      : store_(std::move(store)), backend_(std::move(backend)), rank_(rank), size_(size), global_rank_(global_rank),
        timeout_s_(timeout_s), backend_timeout_s_(backend_timeout_s), is_gloo_(is_gloo), name_(std::move(name)),
        monitor_(std::move(monitor)) {
    if (is_gloo_ && shared_memory && size_ > 1) channel_ = open_channel();
  }
  ~C10dCommunicator() override {
    // After a timeout the backend's worker thread, or the two-level channel's, may still sit
    // in the collective, and their destructors would join them: leave them to the process's exit.
    if (shared().poisoned) {
      (void)backend_.release();
      abandon(std::move(channel_));
    } else {
      shut_down();
    }
  }

  std::int64_t rank() const override { return rank_; }
  std::int64_t size() const override { return size_; }
  const CommStats& stats() const override { return stats_; }
  /// The group's ranks in the world group (the world group itself: 0..size-1).
  void set_members(std::vector<std::int64_t> members) { members_ = std::move(members); }
  /// Ends the backend at a normal exit (NCCL: below; Gloo's destructor does all it needs).
  void shut_down() {}
  std::string transport() const {
    if (!is_gloo_) return "NCCL";
    if (!channel_) return gloo_path();
    return channel_->describe() + " (Gloo for broadcasts and barriers)";
  }

  CommHandlePtr all_gather(at::Tensor output, const at::Tensor& input, const std::string& tag) override {
    TESSERA_CHECK(output.is_contiguous() && output.numel() == input.numel() * size_, "all_gather (", tag,
                  "): output must be contiguous with ", input.numel() * size_, " elements, has ", output.numel());
    count(stats_.all_gather_bytes, bytes_of(input) * (size_ - 1));
    if (channel_) {
      ++stats_.shared_memory_calls;
      return handle(channel_->all_gather(output, input.contiguous()), nullptr, tag);
    }
    if (!is_gloo_) {  // NCCL: one flat all-gather straight into the output
      at::Tensor flat_in = input.contiguous().view({-1});
      return handle(backend_->_allgather_base(output, flat_in), [flat_in] {}, tag);
    }
    return handle(detail::gloo_all_gather(*backend_, output, input, size_), tag);
  }

  CommHandlePtr reduce_scatter(at::Tensor output, const at::Tensor& input, sdk::ReduceOp op,
                               const std::string& tag) override {
    TESSERA_CHECK(input.numel() == output.numel() * size_, "reduce_scatter (", tag, "): input has ", input.numel(),
                  " elements, expected ", output.numel() * size_, " (world ", size_, " x output)");
    count(stats_.reduce_scatter_bytes, bytes_of(output) * (size_ - 1));
    if (!is_gloo_) {  // NCCL's own reduce-scatter, in the tensors' dtype (bf16 summed as bf16, as PyTorch's)
      at::Tensor flat_in = input.contiguous().view({-1});
      c10d::ReduceScatterOptions options;
      options.reduceOp = to_c10d(op);
      const double n = static_cast<double>(size_);
      return handle(backend_->_reduce_scatter_base(output, flat_in, options), [flat_in, output, op, n]() mutable {
        if (op == sdk::ReduceOp::mean) output.div_(n);
      }, tag);
    }
    at::Tensor in = input.contiguous().view({-1});
    if (channel_ && output.is_contiguous() && output.scalar_type() == in.scalar_type() &&
        detail::SharedMemoryChannel::reduces(in.scalar_type())) {
      ++stats_.shared_memory_calls;
      return handle(channel_->reduce_scatter(output, in, op), nullptr, tag);
    }
    return handle(detail::gloo_reduce_scatter(*backend_, receive_pool_, output, in, op, size_), tag);
  }

  CommHandlePtr all_reduce(at::Tensor tensor, sdk::ReduceOp op, const std::string& tag) override {
    count(stats_.all_reduce_bytes, bytes_of(tensor));
    if (channel_ && tensor.is_contiguous() && detail::SharedMemoryChannel::reduces(tensor.scalar_type())) {
      ++stats_.shared_memory_calls;
      return handle(channel_->all_reduce(tensor, op), nullptr, tag);
    }
    // NCCL reduces 16-bit tensors as they are.
    return handle(detail::gloo_all_reduce(*backend_, tensor, op, size_, /*sixteen_bit_in_fp32=*/is_gloo_), tag);
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
    // A barrier holds the host, on NCCL too.
    handle(backend_->barrier(c10d::BarrierOptions()), nullptr, "barrier " + tag, /*stream_ordered=*/false)->wait();
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
      std::vector<std::int64_t> global;  // the members' ranks in the world group, for reports
      for (std::int64_t m : members) global.push_back(m < static_cast<std::int64_t>(members_.size()) ? members_[m] : m);
      std::shared_ptr<C10dCommunicator<Backend>> made;
      create_group([&made, this, store, group_rank, group_size, prefix] {
        made = std::make_shared<C10dCommunicator<Backend>>(store, make_backend(store, group_rank, group_size),
                                                           group_rank, group_size, global_rank_, timeout_s_,
                                                           backend_timeout_s_, is_gloo_, prefix, monitor_,
                                                           current_settings().shared_memory);
      }, prefix, global, global_rank_);
      made->set_members(global);
      {  // the log names each group whose path differs from the world group's
        std::string path = made->transport();
        std::lock_guard<std::mutex> lock(shared().mutex);
        if (path != shared().world_transport)
          shared().group_transports.push_back("group " + ranks_text(global) + ": " + path);
      }
      return made;
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

  /// NCCL's collectives are ordered on the CUDA stream; Gloo's and the shared-memory channel's
  /// complete on the host.
  CommHandlePtr handle(WorkPtr work, std::function<void()> finish, const std::string& tag) {
    return handle(std::move(work), std::move(finish), tag, /*stream_ordered=*/!is_gloo_);
  }
  CommHandlePtr handle(detail::GlooIssued issued, const std::string& tag) {
    return handle(std::move(issued.work), std::move(issued.finish), tag);
  }

  /// "Gloo", or "Gloo over" the interface or address every Gloo group binds.
  static std::string gloo_path() {
    std::lock_guard<std::mutex> lock(shared().mutex);
    if (!shared().gloo_interface.empty()) return "Gloo over " + shared().gloo_interface;
    return is_loopback(shared().gloo_address) ? std::string("Gloo") : "Gloo over " + shared().gloo_address;
  }

  /// Shared memory when the group's ranks are all on this host; two levels when they span hosts
  /// with two or more on each (as many on every host); else none: Gloo carries everything.
  /// Every rank reads the same layout from the store, so all take the same path.
  std::unique_ptr<detail::CollectiveChannel> open_channel() {
    const detail::HostLayout layout = detail::exchange_host_layout(*store_, rank_, size_);
    if (layout.hosts.size() == 1) return detail::SharedMemoryChannel::open(*store_, rank_, size_, layout.pids, backend_timeout_s_);
    const std::int64_t per_host = layout.ranks_per_host();
    if constexpr (std::is_same_v<Backend, c10d::ProcessGroupGloo>) {
      if (per_host < 2) return nullptr;
      auto within_store = c10::make_intrusive<c10d::PrefixStore>("host" + std::to_string(layout.host), store_);
      auto within = detail::SharedMemoryChannel::open(*within_store, layout.local, per_host, layout.local_pids(),
                                                      backend_timeout_s_);
      if (!detail::on_every_rank(*store_, "tessera/two-levels", rank_, size_, within != nullptr)) return nullptr;
      auto across_store = c10::make_intrusive<c10d::PrefixStore>("across" + std::to_string(layout.local), store_);
      auto across = make_backend(across_store, layout.host, static_cast<std::int64_t>(layout.hosts.size()));
      return std::make_unique<detail::HierarchicalCollectives>(layout, std::move(within), std::move(across),
                                                               gloo_path(), backend_timeout_s_);
    }
    return nullptr;
  }
  CommHandlePtr handle(WorkPtr work, std::function<void()> finish, const std::string& tag, bool stream_ordered) {
    return std::make_shared<C10dHandle>(std::move(work), std::move(finish), tag, global_rank_, timeout_s_, monitor_,
                                        stream_ordered);
  }

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<Backend> backend_;
  std::int64_t rank_;
  std::int64_t size_;
  std::int64_t global_rank_;
  double timeout_s_;          ///< each collective's wait (outside checkpoint phases)
  double backend_timeout_s_;  ///< the backend's own, the longest of them plus a backstop
  bool is_gloo_;
  std::string name_;
  std::int64_t split_count_ = 0;
  std::vector<std::int64_t> members_;
  std::shared_ptr<Monitor> monitor_;
  CommStats stats_;
  std::shared_ptr<detail::ReceiveBufferPool> receive_pool_ = std::make_shared<detail::ReceiveBufferPool>();
  std::unique_ptr<detail::CollectiveChannel> channel_;  ///< null: Gloo carries every collective
};

c10::intrusive_ptr<c10d::ProcessGroupGloo> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, std::int64_t rank,
                                                     std::int64_t size, double timeout_s) {
  auto options = c10d::ProcessGroupGloo::Options::create(
      std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000)));
  std::string interface, address;
  {
    std::lock_guard<std::mutex> lock(shared().mutex);
    interface = shared().gloo_interface;
    address = shared().gloo_address;
  }
  // Every group binds where the world group does: a split on loopback could not be reached
  // from another host (Gloo's pair connects to the address each rank publishes).
  if (!interface.empty()) options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(interface));
  else options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(address));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(rank), static_cast<int>(size), options);
}

template <>
c10::intrusive_ptr<c10d::ProcessGroupGloo> C10dCommunicator<c10d::ProcessGroupGloo>::make_backend(
    const c10::intrusive_ptr<c10d::Store>& store, std::int64_t rank, std::int64_t size) const {
  return make_gloo(store, rank, size, backend_timeout_s_);
}

#if TESSERA_WITH_CUDA
c10::intrusive_ptr<c10d::ProcessGroupNCCL> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, std::int64_t rank,
                                                     std::int64_t size, double timeout_s) {
  // Waits are stream-ordered (C10dHandle), so the host runs ahead of the device. c10d then keeps
  // a collective's tensors until its wait (its stash) rather than marking them used on NCCL's
  // stream (record_stream), which would hold every freed unit buffer back from reuse until the
  // device caught up: as many gathered units as the host queued. A user's setting wins. From
  // LibTorch 2.8 the stash is c10d's default, and the variable only draws a deprecation warning.
#if TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 8)
  setenv("TORCH_NCCL_AVOID_RECORD_STREAMS", "1", /*overwrite=*/0);
#endif
  auto options = c10d::ProcessGroupNCCL::Options::create();
  // NCCL's own watchdog aborts without naming the collective: our waits and Monitor fire first.
  options->timeout = std::chrono::milliseconds(static_cast<std::int64_t>((timeout_s + kNcclExtraTimeoutS) * 1000));
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, static_cast<int>(rank), static_cast<int>(size), options);
}

// Without shutdown() ProcessGroupNCCL's destructor aborts its communicators, cutting off any
// collective still queued, and warns "destroy_process_group() was not called before program
// exit" (PyTorch's destroy_process_group calls shutdown()). shutdown() lets them finish. The
// device finishes this group's collectives first so that the Monitor lets go of them: it would
// otherwise ask the destroyed communicators whether they are done.
template <>
void C10dCommunicator<c10d::ProcessGroupNCCL>::shut_down() {
  try {
    c10::cuda::device_synchronize();
    monitor_->prune();
    backend_->shutdown();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera: warning: shutting down NCCL (%s): %s\n", name_.c_str(), e.what());
  }
}

template <>
c10::intrusive_ptr<c10d::ProcessGroupNCCL> C10dCommunicator<c10d::ProcessGroupNCCL>::make_backend(
    const c10::intrusive_ptr<c10d::Store>& store, std::int64_t rank, std::int64_t size) const {
  return make_nccl(store, rank, size, backend_timeout_s_);
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

CommunicatorPtr make_communicator(const sdk::ClusterInfo& cluster, const c10::Device& device, bool cuda_over_gloo) {
  // A write to a peer that is gone must fail (EPIPE, which Gloo reports as the collective's
  // error), not kill this rank with SIGPIPE before it can say which collective broke: Python,
  // under which PyTorch's c10d runs, ignores SIGPIPE alike. A handler the program set stays.
  struct sigaction pipe {};
  if (::sigaction(SIGPIPE, nullptr, &pipe) == 0 && pipe.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
  TESSERA_CHECK(cluster.master_port > 0 && cluster.master_port < 65536, "MASTER_PORT ", cluster.master_port,
                " is not a valid port");
  const double timeout_s = static_cast<double>(cluster.collective_timeout_s);
  const CommSettings settings = current_settings();
  // The backend's own timeout only backs ours up: each wait() has the collective's timeout.
  const double backend_timeout_s = std::max(timeout_s, settings.checkpoint_s) + kGlooBackstopS;
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  const bool agent_store = agent != nullptr && std::string(agent) == "True";
  StoreAddress address;
  address.host = cluster.master_addr;
  address.port = cluster.master_port;
  address.rank = cluster.global_rank;
  address.world = cluster.world_size;
  address.rank0_hosts = !agent_store;
  if (agent_store) {  // as torch.distributed's _create_c10d_store
    const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
    address.prefix = "/worker/attempt_" + std::string(attempt ? attempt : "0");
  }
  detail::ledger_set_rank(cluster.global_rank, cluster.node_rank);

  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(cluster.master_port);
  options.isServer = !agent_store && cluster.global_rank == 0;
  options.numWorkers = static_cast<std::size_t>(cluster.world_size);
  options.waitWorkers = true;
  options.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(settings.rendezvous_s * 1000));
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = tcp_store(cluster.master_addr, options);
  } catch (const std::exception& e) {
    std::string reason = e.what();
    std::string advice;
    if (agent_store)
      advice = ": the launcher hosts this store (TORCHELASTIC_USE_AGENT_STORE=True); is it still running?";
    else if (cluster.global_rank != 0)
      advice = ": is rank 0 running and reachable?";
    else if (cluster.environment == "local" || cluster.environment == "single")
      advice = ": is the port already in use? Choose another [launch] master_port.";
    else
      advice = ": is the port already in use? MASTER_PORT comes from the " + cluster.environment +
               " environment: choose another there.";
    TESSERA_FAIL("rank ", cluster.global_rank, ": rendezvous at ", cluster.master_addr, ":", cluster.master_port,
                 " failed within [launch] rendezvous_timeout_s = ", settings.rendezvous_s, " s (",
                 reason.substr(0, reason.find('\n')), ")", advice);
  }
  if (agent_store) store = c10::make_intrusive<c10d::PrefixStore>(address.prefix, store);
  {
    std::lock_guard<std::mutex> lock(shared().mutex);
    shared().store = address;
  }
  {  // the first heartbeat, before any group exists: a rank that never gets further is named with its host
    LedgerEntry entry = ledger_snapshot();
    entry.published_ms = wall_ms();
    store->set(ledger_key(cluster.global_rank), to_bytes(entry.serialize()));
  }
  const bool nccl = device.is_cuda() && !cuda_over_gloo;
  if (!nccl) choose_gloo_address(cluster, settings);
  std::vector<std::int64_t> everyone(static_cast<std::size_t>(cluster.world_size));
  for (std::int64_t r = 0; r < cluster.world_size; ++r) everyone[static_cast<std::size_t>(r)] = r;
  auto remember = [](const auto& world) {
    std::string path = world->transport();  // takes the lock itself
    std::lock_guard<std::mutex> lock(shared().mutex);
    shared().world_transport = path;
    return world;
  };
  if (nccl) {
#if TESSERA_WITH_CUDA
    return remember(std::make_shared<C10dCommunicator<c10d::ProcessGroupNCCL>>(
        store, make_nccl(store, cluster.global_rank, cluster.world_size, backend_timeout_s), cluster.global_rank,
        cluster.world_size, cluster.global_rank, timeout_s, backend_timeout_s, false, "world",
        std::make_shared<Monitor>(cluster.global_rank, 0.0, address), false));
#else
    TESSERA_FAIL("CUDA tensors need NCCL, but this tessera was built without CUDA");
#endif
  }
  using Gloo = C10dCommunicator<c10d::ProcessGroupGloo>;
  std::shared_ptr<Gloo> world;
  create_group([&] {
    world = std::make_shared<Gloo>(store, make_gloo(store, cluster.global_rank, cluster.world_size, backend_timeout_s),
                                  cluster.global_rank, cluster.world_size, cluster.global_rank, timeout_s,
                                  backend_timeout_s, true, "world",
                                  std::make_shared<Monitor>(cluster.global_rank, kGlooBackstopS, address),
                                  settings.shared_memory);
  }, "world", everyone, cluster.global_rank);
  world->set_members(everyone);
  remember(world);
  if (!device.is_cuda()) return world;
  {
    std::lock_guard<std::mutex> lock(shared().mutex);
    shared().world_transport += ", CUDA tensors staged through host memory";
  }
  return detail::stage_through_host(world);
}

std::string world_transport() {
  std::lock_guard<std::mutex> lock(shared().mutex);
  std::string text = shared().world_transport;
  for (const auto& group : shared().group_transports) text += "; " + group;
  return text;
}

bool shared_memory_collectives(const sdk::ClusterInfo& cluster) {
  return current_settings().shared_memory && cluster.world_size > 1 && cluster.local_world_size == cluster.world_size;
}

double shared_memory_segment_bytes(std::int64_t ranks) {
  return ranks < 2 ? 0.0
                   : static_cast<double>(ranks * detail::SharedMemoryChannel::kBuffers *
                                         detail::SharedMemoryChannel::kSlotBytes);
}

}  // namespace tessera::core
