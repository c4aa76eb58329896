// The one place Tessera calls c10d. Compiles against LibTorch 1.13 (ProcessGroupGloo is a
// ProcessGroup) and 2.x (it is a Backend with the same collective methods).
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <future>
#include <optional>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>

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

#include "shared_memory_channel.hpp"
#include "store_text.hpp"
#include "tessera/core/cluster.hpp"
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

constexpr double kPublishIntervalS = 0.2;
/// A broken connection is seen at once, its rank's failure record a moment later.
constexpr double kRecordGraceS = 0.5;
/// A rank whose ledger has not been republished for this long stopped responding.
constexpr double kStaleS = 2.0;
/// How long reading the store for a report may take before the report goes without it.
constexpr double kStoreReadS = 5.0;

/// Where this process's rendezvous store is (set by make_communicator), for the ledger
/// publisher, hang reports and failure records.
struct StoreAddress {
  std::string host;
  std::int64_t port = 0;
  std::string prefix;  ///< "/worker/attempt_N" under an agent store
  std::int64_t rank = 0;
  std::int64_t world = 1;
  bool rank0_hosts = false;
};

struct Shared {
  std::mutex mutex;
  std::optional<StoreAddress> store;
  CommSettings settings;
  std::optional<Diagnosis> last_failure;
  std::function<void(const std::string&)> fatal_reporter;
  std::atomic<bool> poisoned{false};  ///< a collective timed out: its Gloo thread may still be inside it
  std::string world_transport;        ///< what carries the world group's collectives (for the log)
  std::vector<std::string> group_transports;  ///< split groups whose path differs from the world's
  /// Where every Gloo group of this process binds (the world group and its splits alike): a
  /// named interface, else the local address that reaches the master.
  std::string gloo_interface;
  std::string gloo_address = "127.0.0.1";
};

Shared& shared() {
  static Shared* s = new Shared;  // never destroyed: detached report threads may outlive main
  return *s;
}

CommSettings current_settings() {
  std::lock_guard<std::mutex> lock(shared().mutex);
  return shared().settings;
}

std::optional<StoreAddress> store_address() {
  std::lock_guard<std::mutex> lock(shared().mutex);
  return shared().store;
}

// LibTorch 2.4 made libuv the store server's default backend, but builds without libuv
// (Debian's) then refuse to host a store. As torch.distributed: USE_LIBUV=0 asks for the
// classic backend; without it, libuv where this LibTorch has it, else the classic one.
// (LibTorch before 2.2 has no choice: the first overload does not exist there.)
template <typename Options>
auto use_libuv(Options& options, bool on, int) -> decltype(options.useLibUV = on, bool()) {
  options.useLibUV = on;
  return true;
}
template <typename Options>
bool use_libuv(Options&, bool, long) { return false; }

c10::intrusive_ptr<c10d::TCPStore> tcp_store(const std::string& host, c10d::TCPStoreOptions options) {
  const char* env = std::getenv("USE_LIBUV");
  if (env && std::string(env) == "0") use_libuv(options, false, 0);
  try {
    return c10::make_intrusive<c10d::TCPStore>(host, options);
  } catch (const std::exception& e) {
    if (std::string(e.what()).find("without libuv") == std::string::npos || !use_libuv(options, false, 0)) throw;
    return c10::make_intrusive<c10d::TCPStore>(host, options);
  }
}

c10::intrusive_ptr<c10d::Store> open_client(const StoreAddress& a, double timeout_s) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(a.port);
  options.isServer = false;
  options.waitWorkers = false;  // not a rank: the server must not count it
  options.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000));
  c10::intrusive_ptr<c10d::Store> tcp = tcp_store(a.host, options);
  if (a.prefix.empty()) return tcp;
  return c10::make_intrusive<c10d::PrefixStore>(a.prefix, tcp);
}

std::string ledger_key(std::int64_t rank) { return "tessera/ledger/" + std::to_string(rank); }
const std::string kFailureCount = "tessera/failures";
std::string failure_key(std::int64_t rank) { return "tessera/failure/" + std::to_string(rank); }

using detail::to_bytes;
using detail::to_string;

/// Runs `fn` on its own thread and gives up after `seconds` (a store whose host is stopped
/// never answers); nullopt when it did not finish or threw.
template <typename T>
std::optional<T> bounded(std::function<T()> fn, double seconds) {
  auto promise = std::make_shared<std::promise<T>>();
  std::future<T> future = promise->get_future();
  std::thread([promise, fn = std::move(fn)] {
    try {
      promise->set_value(fn());
    } catch (...) {
      promise->set_exception(std::current_exception());
    }
  }).detach();
  if (future.wait_for(std::chrono::duration<double>(seconds)) != std::future_status::ready) return std::nullopt;
  try {
    return future.get();
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

std::map<std::int64_t, FailureRecord> read_failures(c10d::Store& store, std::int64_t world) {
  std::map<std::int64_t, FailureRecord> failures;
  for (std::int64_t r = 0; r < world; ++r)
    if (store.check({failure_key(r)})) failures[r] = FailureRecord::parse(to_string(store.get(failure_key(r))));
  return failures;
}

bool is_loopback(const std::string& address) { return address.rfind("127.", 0) == 0 || address == "::1"; }

/// False once `pid` is gone or a zombie (its launcher has not reaped it yet).
bool process_alive(std::int64_t pid) {
  const char state = process_state(pid);
  return state != 0 && state != 'Z' && state != 'X';
}

/// The ranks of this host (by ledger) whose process is gone.
std::vector<std::int64_t> exited_ranks(const std::vector<std::optional<LedgerEntry>>& ledgers, std::int64_t me) {
  std::vector<std::int64_t> gone;
  const std::string here = host_name();
  for (std::size_t r = 0; r < ledgers.size(); ++r)
    if (static_cast<std::int64_t>(r) != me && ledgers[r] && ledgers[r]->host == here && ledgers[r]->pid > 0 &&
        !process_alive(ledgers[r]->pid))
      gone.push_back(static_cast<std::int64_t>(r));
  return gone;
}

struct StoreView {
  std::vector<std::optional<LedgerEntry>> ledgers;
  std::map<std::int64_t, FailureRecord> failures;
};

/// Reads every rank's ledger and the failure records, then names the root cause; reads once
/// more after kStaleS when nobody stands out yet (a rank that just died still looks alive).
Diagnosis diagnose_now(std::int64_t me, bool timed_out) {
  std::optional<StoreAddress> address = store_address();
  if (!timed_out) std::this_thread::sleep_for(std::chrono::duration<double>(kRecordGraceS));
  Diagnosis d;
  if (!address) {
    d.text = "no rendezvous store to read the other ranks' ledgers from";
    return d;
  }
  for (int attempt = 0; attempt < 2; ++attempt) {
    StoreAddress a = *address;
    std::optional<StoreView> view = bounded<StoreView>([a] {
      auto store = open_client(a, 2.0);
      StoreView v;
      v.ledgers.resize(static_cast<std::size_t>(a.world));
      for (std::int64_t r = 0; r < a.world; ++r)
        if (store->check({ledger_key(r)})) v.ledgers[r] = LedgerEntry::parse(to_string(store->get(ledger_key(r))));
      v.failures = read_failures(*store, a.world);
      return v;
    }, kStoreReadS);
    if (!view) {
      d.text = "the rendezvous store at " + a.host + ":" + std::to_string(a.port) + " does not answer";
      if (a.rank0_hosts && me != 0) {
        d.root = 0;
        d.text += " (rank 0 hosts it: rank 0 stopped responding or is gone)";
      }
      return d;
    }
    LedgerEntry mine = ledger_snapshot();
    mine.published_ms = wall_ms();
    view->ledgers[static_cast<std::size_t>(me)] = mine;
    d = diagnose(me, view->ledgers, view->failures, wall_ms(), kStaleS, exited_ranks(view->ledgers, me));
    // A broken connection is a peer that died: one on another host still looks alive (or stuck
    // outside collectives) until its heartbeat goes stale, so only a firm cause is taken at once.
    const bool firm = d.cause == "reported" || d.cause == "exited" || d.cause == "lost";
    if (d.root >= 0 && (timed_out || firm || attempt == 1)) return d;
    if (attempt == 0) std::this_thread::sleep_for(std::chrono::duration<double>(kStaleS + kPublishIntervalS));
  }
  return d;
}

/// Ends this rank the way the collective watchdog does: the message on stderr, the host's
/// reporter (torchrun's error file and the failure record), exit code `code`. For a rank
/// whose Gloo thread is still inside a connect or collective that will never finish.
[[noreturn]] void end_rank(const std::string& message, int code) {
  std::fprintf(stderr, "tessera: error: %s\n", message.c_str());
  std::fflush(stderr);
  std::function<void(const std::string&)> reporter;
  {
    std::lock_guard<std::mutex> guard(shared().mutex);
    reporter = shared().fatal_reporter;
  }
  if (reporter) reporter(message);
  else report_failure(message);
  std::_Exit(code);
}

std::string joined_key(const std::string& group, std::int64_t rank) {
  return "tessera/joined/" + group + "/" + std::to_string(rank);
}

/// Creates a process group with `make` (Gloo connects every pair of ranks; the shared-memory
/// channel maps its segment) on its own thread, bounded by [launch] rendezvous_timeout_s.
/// Each member marks its arrival in the store; when the time is up, or as soon as another
/// rank records a failure, this rank ends, naming the group, the phase and the ranks (with
/// their hosts) it waited for. `members` are the group's global ranks.
template <typename T>
T create_group(std::function<T()> make, const std::string& group, const std::vector<std::int64_t>& members,
               std::int64_t me) {
  const double timeout_s = current_settings().rendezvous_s;
  std::optional<StoreAddress> address = store_address();
  if (!address) return make();
  c10::intrusive_ptr<c10d::Store> client;
  try {
    client = open_client(*address, 5.0);
    client->set(joined_key(group, me), to_bytes("1"));
  } catch (const std::exception&) {
    client.reset();  // the store is gone: Gloo's own connect reports it
  }
  auto promise = std::make_shared<std::promise<T>>();
  std::future<T> future = promise->get_future();
  std::thread([promise, make = std::move(make)] {
    try {
      promise->set_value(make());
    } catch (...) {
      promise->set_exception(std::current_exception());
    }
  }).detach();
  const std::string what = "creating process group " + group + " (" + ranks_text(members) + ")";
  const Clock::time_point start = Clock::now();
  while (future.wait_for(std::chrono::milliseconds(250)) != std::future_status::ready) {
    if (!client) {
      if (std::chrono::duration<double>(Clock::now() - start).count() < timeout_s) continue;
      shared().poisoned = true;
      end_rank("rank " + std::to_string(me) + ": " + what + " did not finish within [launch] rendezvous_timeout_s = " +
                   std::to_string(static_cast<std::int64_t>(timeout_s)) + " s, and the rendezvous store does not answer",
               1);
    }
    const bool expired = std::chrono::duration<double>(Clock::now() - start).count() >= timeout_s;
    // One key counts the failure records (report_failure), so that waiting costs one read.
    std::optional<std::int64_t> failed = bounded<std::int64_t>([client] { return client->add(kFailureCount, 0); }, kStoreReadS);
    if (!expired && (!failed || *failed == 0)) continue;
    StoreAddress a = *address;
    std::optional<StoreView> view = bounded<StoreView>([client, a] {
      StoreView v;
      v.ledgers.resize(static_cast<std::size_t>(a.world));
      for (std::int64_t r = 0; r < a.world; ++r)
        if (client->check({ledger_key(r)})) v.ledgers[r] = LedgerEntry::parse(to_string(client->get(ledger_key(r))));
      v.failures = read_failures(*client, a.world);
      return v;
    }, kStoreReadS);
    if (!view) continue;
    view->failures.erase(me);
    if (view->failures.empty() && !expired) continue;
    Diagnosis d;
    std::string text;
    if (!view->failures.empty()) {  // another rank already failed: no reason to wait out the timeout
      const FailureRecord* first = nullptr;
      for (const auto& [r, f] : view->failures)
        if (first == nullptr || f.time_ms < first->time_ms) first = &f;
      d.root = first->rank;
      text = rank_name(first->rank, view->ledgers) + " failed: " + first->message.substr(0, first->message.find('\n'));
    } else {
      std::vector<std::string> missing;
      const std::int64_t now = wall_ms();
      for (std::int64_t r : members) {
        if (r == me) continue;
        bool joined = false;
        try {
          joined = client->check({joined_key(group, r)});
        } catch (const std::exception&) {
        }
        if (joined) continue;
        if (d.root < 0) d.root = r;
        const auto& l = view->ledgers[static_cast<std::size_t>(r)];
        std::string state = !l ? " never reached the rendezvous store"
                            : now - l->published_ms > kStaleS * 1000 ? " stopped responding before it joined"
                                                                     : " is alive but has not joined (phase " + l->phase + ")";
        missing.push_back(rank_name(r, view->ledgers) + state);
      }
      text = "waited for ";
      for (std::size_t i = 0; i < missing.size(); ++i) text += (i ? "; " : "") + missing[i];
      if (missing.empty()) text = "every rank joined, but the connections between them did not form (a firewall, or "
                                  "an address another host cannot reach: see [launch] interface)";
    }
    d.text = text;
    {
      std::lock_guard<std::mutex> lock(shared().mutex);
      shared().last_failure = d;
    }
    shared().poisoned = true;
    end_rank("rank " + std::to_string(me) + ": " + what + (expired ? " timed out after " : " stopped after ") +
                 std::to_string(static_cast<std::int64_t>(std::chrono::duration<double>(Clock::now() - start).count())) +
                 " s ([launch] rendezvous_timeout_s = " + std::to_string(static_cast<std::int64_t>(timeout_s)) +
                 "): " + text,
             1);
  }
  try {
    return future.get();
  } catch (const std::exception& e) {
    std::string reason = e.what();
    TESSERA_FAIL("rank ", me, ": ", what, " failed: ", reason.substr(0, reason.find('\n')));
  }
}

/// Every collective in flight in this process (world group and its splits), and the ledger
/// publisher: a thread republishes this rank's ledger every kPublishIntervalS (the heartbeat)
/// and reports a collective still incomplete past its timeout plus a backstop, then ends the
/// rank: for a backend whose own timeout never fires (NCCL's watchdog is given a longer one)
/// or a collective whose wait() is never reached.
class Monitor {
 public:
  Monitor(std::int64_t rank, double backstop_s, std::optional<StoreAddress> store)
      : rank_(rank), backstop_s_(backstop_s), store_(std::move(store)), thread_([this] { watch(); }) {}
  ~Monitor() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  std::uint64_t add(const WorkPtr& work, const std::string& tag, std::int64_t seq, double timeout_s) {
    std::lock_guard<std::mutex> lock(mutex_);
    prune_finished_on_device();
    entries_[next_] = Entry{work, tag, seq, timeout_s, Clock::now()};
    return next_++;
  }
  void remove(std::uint64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.erase(id);
  }
  /// Drops the collectives the device has finished: all of them once it is synchronised.
  void prune() {
    std::lock_guard<std::mutex> lock(mutex_);
    prune_finished_on_device();
  }
  /// The rank's stream waits for `id` but its host went on: from now on `watched` (the work
  /// without its tensors, see watchable()) stands for it until the device finishes it; pruned at
  /// every add and tick. Without one, the backend's own timeout watches it.
  void waited_on_device(std::uint64_t id, WorkPtr watched) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(id);
    if (it == entries_.end()) return;
    if (!watched) return void(entries_.erase(it));
    it->second.work = std::move(watched);
    it->second.on_device = true;
  }

 private:
  struct Entry {
    WorkPtr work;
    std::string tag;
    std::int64_t seq;
    double timeout_s;
    Clock::time_point start;
    bool on_device = false;  ///< waited for by the stream, not by the host
  };

  void prune_finished_on_device() {
    for (auto it = entries_.begin(); it != entries_.end();)
      it = it->second.on_device && it->second.work->isCompleted() ? entries_.erase(it) : std::next(it);
  }

  void publish() {
    if (!store_ || broken_) return;
    try {
      if (!client_) client_ = open_client(*store_, 5.0);
      LedgerEntry entry = ledger_snapshot();
      entry.published_ms = wall_ms();
      client_->set(ledger_key(rank_), to_bytes(entry.serialize()));
    } catch (const std::exception&) {
      broken_ = true;  // the store is gone (its host ended): nobody could read the ledger anyway
    }
  }

  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      lock.unlock();
      publish();
      lock.lock();
      wake_.wait_for(lock, std::chrono::duration<double>(kPublishIntervalS), [this] { return stop_; });
      prune_finished_on_device();
      for (const auto& [id, entry] : entries_) {
        double waited = std::chrono::duration<double>(Clock::now() - entry.start).count();
        if (waited < entry.timeout_s + backstop_s_ || entry.work->isCompleted()) continue;
        Entry stuck = entry;
        lock.unlock();
        Diagnosis d = diagnose_now(rank_, /*timed_out=*/true);
        {
          std::lock_guard<std::mutex> guard(shared().mutex);
          shared().last_failure = d;
        }
        std::string message = "rank " + std::to_string(rank_) + ": " + stuck.tag + " incomplete after " +
                              std::to_string(static_cast<std::int64_t>(waited)) + " s (collective #" +
                              std::to_string(stuck.seq) + ", timeout " +
                              std::to_string(static_cast<std::int64_t>(stuck.timeout_s)) +
                              (stuck.on_device ? " s; the device never finished it" : " s; this rank never waited for it") +
                              "). Hang report: " + d.text;
        end_rank(message, 124);
      }
    }
  }

  std::int64_t rank_;
  double backstop_s_;
  std::optional<StoreAddress> store_;
  c10::intrusive_ptr<c10d::Store> client_;
  bool broken_ = false;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::uint64_t next_ = 0;
  std::map<std::uint64_t, Entry> entries_;
  std::thread thread_;
};

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

/// Gather, all-to-all and broadcast move 16-bit tensors as bytes, the one type every Gloo build
/// moves: 1.13's has no bf16, Debian sid's 2.14 no 16-bit type at all ("Invalid scalar type").
/// The bits are never interpreted on the way; reductions convert to fp32 instead. A 0-dim
/// tensor goes as one element (a dtype view must widen its last dimension).
at::Tensor wire_view(const at::Tensor& t) {
  if (t.element_size() != 2) return t;
  return (t.dim() == 0 ? t.view({1}) : t).view(at::kByte);
}

/// Receive buffers of Gloo's reduce_scatter (all_to_all + sum), reused across calls: FSDP
/// reduces the same unit sizes every step, and a fresh buffer of tens of MB is page-faulted
/// in on every call (a 64 MB reduce-scatter ran at 0.75x the all-gather's bandwidth).
class ReceiveBufferPool {
 public:
  at::Tensor take(const at::Tensor& like) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& idle = idle_[{like.numel(), like.scalar_type()}];
    if (idle.empty()) return at::empty_like(like);
    at::Tensor t = std::move(idle.back());
    idle.pop_back();
    return t;
  }
  void give(at::Tensor t) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& idle = idle_[{t.numel(), t.scalar_type()}];
    if (idle.size() < kIdlePerSize) idle.push_back(std::move(t));
  }

 private:
  static constexpr std::size_t kIdlePerSize = 2;  // FSDP keeps two reductions in flight
  std::mutex mutex_;
  std::map<std::pair<std::int64_t, at::ScalarType>, std::vector<at::Tensor>> idle_;
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
    if (is_gloo_ && shared_memory) shm_ = detail::SharedMemoryChannel::open(*store_, rank_, size_, backend_timeout_s_);
  }
  ~C10dCommunicator() override {
    // After a timeout the backend's worker thread may still sit in the collective, and the
    // backend's destructor would join it: leave it to the process's exit.
    if (shared().poisoned) (void)backend_.release();
    else shut_down();
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
    if (!shm_) {
      std::lock_guard<std::mutex> lock(shared().mutex);
      if (!shared().gloo_interface.empty()) return "Gloo over " + shared().gloo_interface;
      return is_loopback(shared().gloo_address) ? std::string("Gloo") : "Gloo over " + shared().gloo_address;
    }
    return "shared memory among the " + std::to_string(size_) + " ranks of this host (Gloo for broadcasts and barriers)";
  }

  CommHandlePtr all_gather(at::Tensor output, const at::Tensor& input, const std::string& tag) override {
    TESSERA_CHECK(output.is_contiguous() && output.numel() == input.numel() * size_, "all_gather (", tag,
                  "): output must be contiguous with ", input.numel() * size_, " elements, has ", output.numel());
    count(stats_.all_gather_bytes, bytes_of(input) * (size_ - 1));
    if (shm_) {
      ++stats_.shared_memory_calls;
      return handle(shm_->all_gather(output, input.contiguous()), nullptr, tag);
    }
    if (!is_gloo_) {  // NCCL: one flat all-gather straight into the output
      at::Tensor flat_in = input.contiguous().view({-1});
      return handle(backend_->_allgather_base(output, flat_in), [flat_in] {}, tag);
    }
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
    if (shm_ && output.is_contiguous() && output.scalar_type() == in.scalar_type() &&
        detail::SharedMemoryChannel::reduces(in.scalar_type())) {
      ++stats_.shared_memory_calls;
      return handle(shm_->reduce_scatter(output, in, op), nullptr, tag);
    }
    // Gloo: all_to_all + local sum: each rank receives every rank's copy of its own chunk, the same
    // bytes on the wire as a ring reduce-scatter (the 1.13 Gloo backend has no reduce_scatter).
    at::Tensor received = receive_pool_->take(in);
    std::vector<std::int64_t> splits;
    at::Tensor wire_out = wire_view(received), wire_in = wire_view(in);
    WorkPtr work = backend_->alltoall_base(wire_out, wire_in, splits, splits);
    std::int64_t n = size_;
    return handle(work, [received, output, op, n, pool = receive_pool_]() mutable {
      reduce_rows(received.view({n, -1}), output, op);
      pool->give(std::move(received));
    }, tag);
  }

  CommHandlePtr all_reduce(at::Tensor tensor, sdk::ReduceOp op, const std::string& tag) override {
    count(stats_.all_reduce_bytes, bytes_of(tensor));
    if (shm_ && tensor.is_contiguous() && detail::SharedMemoryChannel::reduces(tensor.scalar_type())) {
      ++stats_.shared_memory_calls;
      return handle(shm_->all_reduce(tensor, op), nullptr, tag);
    }
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
      auto made = create_group<std::shared_ptr<C10dCommunicator<Backend>>>([this, store, group_rank, group_size, prefix] {
        return std::make_shared<C10dCommunicator<Backend>>(store, make_backend(store, group_rank, group_size),
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
  std::shared_ptr<ReceiveBufferPool> receive_pool_ = std::make_shared<ReceiveBufferPool>();
  std::unique_ptr<detail::SharedMemoryChannel> shm_;  ///< null: Gloo carries every collective
};

/// Every address `name` resolves to (IPv4 and IPv6), as text.
std::vector<std::string> resolve(const std::string& name) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  std::vector<std::string> addresses;
  if (::getaddrinfo(name.c_str(), nullptr, &hints, &found) != 0) return addresses;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = {0};
    const void* raw = a->ai_family == AF_INET ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr)
                                              : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr);
    if (::inet_ntop(a->ai_family, raw, text, sizeof(text)) != nullptr &&
        std::find(addresses.begin(), addresses.end(), text) == addresses.end())
      addresses.emplace_back(text);
  }
  ::freeaddrinfo(found);
  return addresses;
}

/// The local address the kernel routes to `host` from (a UDP connect sends nothing), or "".
std::string route_to(const std::string& host, std::int64_t port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || found == nullptr) return "";
  std::string local;
  int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  if (fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) == 0) {
    sockaddr_in mine{};
    socklen_t length = sizeof(mine);
    char text[INET_ADDRSTRLEN] = {0};
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &length) == 0 &&
        ::inet_ntop(AF_INET, &mine.sin_addr, text, sizeof(text)) != nullptr)
      local = text;
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(found);
  return local;
}

/// The name of the interface that holds IPv4 `address`, or "".
std::string interface_of(const std::string& address) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string name;
  for (ifaddrs* i = list; i != nullptr && name.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {0};
    if (::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof(text)) != nullptr &&
        address == text)
      name = i->ifa_name;
  }
  ::freeifaddrs(list);
  return name;
}

/// Picks where this process's Gloo groups bind: [launch] interface, else GLOO_SOCKET_IFNAME,
/// else the local address that reaches the master. In a job across several hosts, a host
/// whose own name resolves only to loopback is refused unless an interface is named: other
/// tools of the job (torchrun's rendezvous, Gloo's default device, the reports) go by the name.
void choose_gloo_address(const sdk::ClusterInfo& cluster, const CommSettings& settings) {
  const char* env = std::getenv("GLOO_SOCKET_IFNAME");
  std::string interface = !settings.interface.empty() ? settings.interface : env != nullptr ? env : "";
  std::string address = route_to(cluster.master_addr, cluster.master_port);
  const std::string host = host_name();
  const std::string where = "node " + std::to_string(cluster.node_rank) + " (" + host + ", rank " +
                            std::to_string(cluster.global_rank) + ")";
  if (!interface.empty()) {
    ifaddrs* list = nullptr;
    bool exists = false;
    if (::getifaddrs(&list) == 0) {
      for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) exists = exists || interface == i->ifa_name;
      ::freeifaddrs(list);
    }
    TESSERA_CHECK(exists, where, ": ", (settings.interface.empty() ? "GLOO_SOCKET_IFNAME" : "[launch] interface"),
                  " = \"", interface, "\" is no network interface of this host",
                  (address.empty() || interface_of(address).empty()
                       ? std::string()
                       : " (the one that reaches the master " + cluster.master_addr + " is \"" + interface_of(address) +
                             "\")"));
  } else if (cluster.num_nodes > 1) {
    // A master on loopback means every node runs on this machine: nothing to check.
    TESSERA_CHECK(!address.empty(), where, ": the master address '", cluster.master_addr, "' does not resolve to a ",
                  "reachable IPv4 address from this host: set [launch] master_addr (or MASTER_ADDR) to node 0's ",
                  "network address, the same on every node");
    std::vector<std::string> own = resolve(host);
    bool usable = is_loopback(address);
    for (const auto& a : own) usable = usable || !is_loopback(a);
    std::string listed;
    for (const auto& a : own) listed += (listed.empty() ? "" : ", ") + a;
    const std::string fix = interface_of(address).empty()
                                ? std::string("[launch] interface = \"<the interface that reaches the other hosts>\"")
                                : "[launch] interface = \"" + interface_of(address) +
                                      "\" (the interface that reaches the master " + cluster.master_addr + ")";
    TESSERA_CHECK(usable, where, ": this host's name '", host, "' resolves ",
                  (own.empty() ? std::string("to no address") : "only to loopback (" + listed + ")"), " in a job across ",
                  cluster.num_nodes, " nodes; the other hosts could not connect to it. Map '", host,
                  "' to this host's network address in /etc/hosts (or DNS), or set ", fix, " or GLOO_SOCKET_IFNAME");
  }
  std::lock_guard<std::mutex> lock(shared().mutex);
  shared().gloo_interface = interface;
  shared().gloo_address = address.empty() ? std::string("127.0.0.1") : address;
}

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

CommunicatorPtr make_communicator(const sdk::ClusterInfo& cluster, const c10::Device& device) {
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
  if (!device.is_cuda()) choose_gloo_address(cluster, settings);
  std::vector<std::int64_t> everyone(static_cast<std::size_t>(cluster.world_size));
  for (std::int64_t r = 0; r < cluster.world_size; ++r) everyone[static_cast<std::size_t>(r)] = r;
  auto remember = [](const auto& world) {
    std::string path = world->transport();  // takes the lock itself
    std::lock_guard<std::mutex> lock(shared().mutex);
    shared().world_transport = path;
    return world;
  };
  if (device.is_cuda()) {
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
  auto world = create_group<std::shared_ptr<Gloo>>([=] {
    return std::make_shared<Gloo>(store, make_gloo(store, cluster.global_rank, cluster.world_size, backend_timeout_s),
                                  cluster.global_rank, cluster.world_size, cluster.global_rank, timeout_s,
                                  backend_timeout_s, true, "world",
                                  std::make_shared<Monitor>(cluster.global_rank, kGlooBackstopS, address),
                                  settings.shared_memory);
  }, "world", everyone, cluster.global_rank);
  world->set_members(everyone);
  return remember(world);
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

void set_comm_settings(const CommSettings& settings) {
  std::lock_guard<std::mutex> lock(shared().mutex);
  shared().settings = settings;
}

std::optional<Diagnosis> last_collective_failure() {
  std::lock_guard<std::mutex> lock(shared().mutex);
  return shared().last_failure;
}

void set_fatal_reporter(std::function<void(const std::string& message)> reporter) {
  std::lock_guard<std::mutex> lock(shared().mutex);
  shared().fatal_reporter = std::move(reporter);
}

FailureRecord report_failure(const std::string& message) {
  FailureRecord record;
  record.rank = ledger_snapshot().rank;
  record.time_ms = wall_ms();
  record.message = message;
  if (std::optional<Diagnosis> d = last_collective_failure()) {
    record.consequence = d->root != record.rank;
    record.root = d->root;
    record.root_summary = d->root_summary.empty() ? d->text : d->root_summary;
  }
  if (std::optional<StoreAddress> a = store_address()) {
    std::string text = record.serialize();
    std::int64_t rank = record.rank;
    StoreAddress address = *a;
    bounded<bool>([address, text, rank] {
      auto store = open_client(address, 2.0);
      store->set(failure_key(rank), to_bytes(text));
      store->add(kFailureCount, 1);
      return true;
    }, kStoreReadS);
  }
  return record;
}

struct AgentStore::Impl {
  c10::intrusive_ptr<c10d::TCPStore> tcp;
  StoreAddress address;
};

AgentStore::AgentStore(const std::string& host, std::int64_t port, bool server, double timeout_s)
    : impl_(std::make_unique<Impl>()) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(port);
  options.isServer = server;
  options.waitWorkers = false;
  options.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000));
  try {
    impl_->tcp = tcp_store(host, options);
  } catch (const std::exception& e) {
    std::string reason = e.what();
    TESSERA_FAIL("cannot ", (server ? "host" : "reach"), " the rendezvous store at ", host, ":", port, " (",
                 reason.substr(0, reason.find('\n')), ")",
                 (server ? ": is the port in use? Choose another [launch] master_port." : ""));
  }
  impl_->address.host = host;
  impl_->address.port = impl_->tcp->getPort();
  impl_->address.prefix = "/worker/attempt_0";
}

AgentStore::~AgentStore() = default;

std::int64_t AgentStore::port() const { return impl_->address.port; }

std::vector<std::optional<LedgerEntry>> AgentStore::ledgers(std::int64_t world_size) {
  StoreAddress a = impl_->address;
  auto found = bounded<std::vector<std::optional<LedgerEntry>>>([a, world_size] {
    auto store = open_client(a, 2.0);
    std::vector<std::optional<LedgerEntry>> ledgers(static_cast<std::size_t>(world_size));
    for (std::int64_t r = 0; r < world_size; ++r)
      if (store->check({ledger_key(r)})) ledgers[r] = LedgerEntry::parse(to_string(store->get(ledger_key(r))));
    return ledgers;
  }, kStoreReadS);
  return found ? *found : std::vector<std::optional<LedgerEntry>>(static_cast<std::size_t>(world_size));
}

std::map<std::int64_t, FailureRecord> AgentStore::failures(std::int64_t world_size) {
  StoreAddress a = impl_->address;
  a.world = world_size;
  auto found = bounded<std::map<std::int64_t, FailureRecord>>(
      [a] { return read_failures(*open_client(a, 2.0), a.world); }, kStoreReadS);
  return found ? *found : std::map<std::int64_t, FailureRecord>{};
}

}  // namespace tessera::core
