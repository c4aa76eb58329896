// Process-group creation bounded by its timeout, the hang diagnosis every report opens with,
// and ending a rank the way the watchdog does (c10d_shared.hpp).
#include <cstdio>

#include "c10d_shared.hpp"
#include "store_text.hpp"
#include "cluster/cluster.hpp"
#include "tessera/core/ledger.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::core::c10d_detail {

using detail::to_bytes;

namespace {

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

}  // namespace

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
    std::optional<StoreView> view = bounded<StoreView>([a] { return read_store_view(*open_client(a, 2.0), a.world); },
                                                       kStoreReadS);
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

void end_rank(const std::string& message, int code) {
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

namespace {

std::string joined_key(const std::string& group, std::int64_t rank) {
  return "tessera/joined/" + group + "/" + std::to_string(rank);
}

}  // namespace

void create_group(const std::function<void()>& make, const std::string& group, const std::vector<std::int64_t>& members,
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
  auto promise = std::make_shared<std::promise<void>>();
  std::future<void> future = promise->get_future();
  std::thread([promise, make] {
    try {
      make();
      promise->set_value();
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
    std::optional<StoreView> view = bounded<StoreView>([client, a] { return read_store_view(*client, a.world); }, kStoreReadS);
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
    future.get();
  } catch (const std::exception& e) {
    std::string reason = e.what();
    TESSERA_FAIL("rank ", me, ": ", what, " failed: ", reason.substr(0, reason.find('\n')));
  }
}

}  // namespace tessera::core::c10d_detail
