#pragma once
// What the files of the c10d communicator share; private to core:
//   c10d_communicator.cpp  the process groups and their collectives, and the factory
//   c10d_store.cpp         the rendezvous store: this process's address, failure records, the agent's view
//   c10d_rendezvous.cpp    group creation bounded by its timeout, the hang diagnosis, ending a rank
//   c10d_monitor.cpp       the collective watchdog and the ledger heartbeat
//   gloo_address.cpp       where every Gloo group binds
// Beside them: gloo_collectives.hpp (Gloo's gathers and reductions, shared with the two-level
// collectives) and collective_channel.hpp (the shared-memory and two-level paths).
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "tessera/core/comm.hpp"

namespace tessera::sdk {
struct ClusterInfo;
}

namespace tessera::core::c10d_detail {

using Clock = std::chrono::steady_clock;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

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

/// This process's one instance (never destroyed: detached report threads may outlive main).
Shared& shared();
CommSettings current_settings();
std::optional<StoreAddress> store_address();

/// A TCPStore client or server; falls back from libuv to the classic backend where this
/// LibTorch has no libuv.
c10::intrusive_ptr<c10d::TCPStore> tcp_store(const std::string& host, c10d::TCPStoreOptions options);
/// A client of the store at `a` (under its prefix): not a rank, so the server does not count it.
c10::intrusive_ptr<c10d::Store> open_client(const StoreAddress& a, double timeout_s);

std::string ledger_key(std::int64_t rank);
inline const std::string kFailureCount = "tessera/failures";
std::string failure_key(std::int64_t rank);

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

/// Every rank's ledger and failure record, as the store holds them.
struct StoreView {
  std::vector<std::optional<LedgerEntry>> ledgers;
  std::map<std::int64_t, FailureRecord> failures;
};
StoreView read_store_view(c10d::Store& store, std::int64_t world);
std::map<std::int64_t, FailureRecord> read_failures(c10d::Store& store, std::int64_t world);

bool is_loopback(const std::string& address);

/// Reads every rank's ledger and the failure records, then names the root cause; reads once
/// more after kStaleS when nobody stands out yet (a rank that just died still looks alive).
Diagnosis diagnose_now(std::int64_t me, bool timed_out);

/// Ends this rank the way the collective watchdog does: the message on stderr, the host's
/// reporter (torchrun's error file and the failure record), exit code `code`. For a rank
/// whose Gloo thread is still inside a connect or collective that will never finish.
[[noreturn]] void end_rank(const std::string& message, int code);

/// Creates a process group by running `make` (Gloo connects every pair of ranks; the
/// shared-memory channel maps its segment) on its own thread, bounded by [launch]
/// rendezvous_timeout_s. Each member marks its arrival in the store; when the time is up, or as
/// soon as another rank records a failure, this rank ends, naming the group, the phase and the
/// ranks (with their hosts) it waited for. `members` are the group's global ranks. When it
/// returns, `make` has finished (what it captured by reference is safe to read).
void create_group(const std::function<void()>& make, const std::string& group, const std::vector<std::int64_t>& members,
                  std::int64_t me);

/// Picks where this process's Gloo groups bind: [launch] interface, else GLOO_SOCKET_IFNAME,
/// else the local address that reaches the master. In a job across several hosts, a host
/// whose own name resolves only to loopback is refused unless an interface is named: other
/// tools of the job (torchrun's rendezvous, Gloo's default device, the reports) go by the name.
void choose_gloo_address(const sdk::ClusterInfo& cluster, const CommSettings& settings);

/// Every collective in flight in this process (world group and its splits), and the ledger
/// publisher: a thread republishes this rank's ledger every kPublishIntervalS (the heartbeat)
/// and reports a collective still incomplete past its timeout plus a backstop, then ends the
/// rank: for a backend whose own timeout never fires (NCCL's watchdog is given a longer one)
/// or a collective whose wait() is never reached.
class Monitor {
 public:
  Monitor(std::int64_t rank, double backstop_s, std::optional<StoreAddress> store);
  ~Monitor();

  std::uint64_t add(const WorkPtr& work, const std::string& tag, std::int64_t seq, double timeout_s);
  void remove(std::uint64_t id);
  /// Drops the collectives the device has finished: all of them once it is synchronised.
  void prune();
  /// The rank's stream waits for `id` but its host went on: from now on `watched` (the work
  /// without its tensors, see watchable()) stands for it until the device finishes it; pruned at
  /// every add and tick. Without one, the backend's own timeout watches it.
  void waited_on_device(std::uint64_t id, WorkPtr watched);

 private:
  struct Entry {
    WorkPtr work;
    std::string tag;
    std::int64_t seq;
    double timeout_s;
    Clock::time_point start;
    bool on_device = false;  ///< waited for by the stream, not by the host
  };

  void prune_finished_on_device();
  void publish();
  void watch();

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

}  // namespace tessera::core::c10d_detail
