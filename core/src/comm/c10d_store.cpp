// The rendezvous store as this process uses it (c10d_shared.hpp): where it is, the ledger and
// failure records in it, the reports every rank files there, and the launcher's view of it
// (AgentStore).
#include <cstdlib>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "c10d_shared.hpp"
#include "store_text.hpp"
#include "cluster/cluster.hpp"
#include "tessera/core/ledger.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::core {

namespace c10d_detail {

using detail::to_bytes;
using detail::to_string;

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

namespace {

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

}  // namespace

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
std::string failure_key(std::int64_t rank) { return "tessera/failure/" + std::to_string(rank); }

std::map<std::int64_t, FailureRecord> read_failures(c10d::Store& store, std::int64_t world) {
  std::map<std::int64_t, FailureRecord> failures;
  for (std::int64_t r = 0; r < world; ++r)
    if (store.check({failure_key(r)})) failures[r] = FailureRecord::parse(to_string(store.get(failure_key(r))));
  return failures;
}

StoreView read_store_view(c10d::Store& store, std::int64_t world) {
  StoreView v;
  v.ledgers.resize(static_cast<std::size_t>(world));
  for (std::int64_t r = 0; r < world; ++r)
    if (store.check({ledger_key(r)})) v.ledgers[r] = LedgerEntry::parse(to_string(store.get(ledger_key(r))));
  v.failures = read_failures(store, world);
  return v;
}

bool is_loopback(const std::string& address) { return address.rfind("127.", 0) == 0 || address == "::1"; }

}  // namespace c10d_detail

using namespace c10d_detail;

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
    return read_store_view(*store, world_size).ledgers;
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
