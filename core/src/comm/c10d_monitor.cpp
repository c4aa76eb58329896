// The collective watchdog and the ledger heartbeat (c10d_shared.hpp).
#include "c10d_shared.hpp"
#include "store_text.hpp"
#include "tessera/core/comm.hpp"

namespace tessera::core::c10d_detail {

using detail::to_bytes;

Monitor::Monitor(std::int64_t rank, double backstop_s, std::optional<StoreAddress> store)
    : rank_(rank), backstop_s_(backstop_s), store_(std::move(store)), thread_([this] { watch(); }) {}

Monitor::~Monitor() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

std::uint64_t Monitor::add(const WorkPtr& work, const std::string& tag, std::int64_t seq, double timeout_s) {
  std::lock_guard<std::mutex> lock(mutex_);
  prune_finished_on_device();
  entries_[next_] = Entry{work, tag, seq, timeout_s, Clock::now()};
  return next_++;
}

void Monitor::remove(std::uint64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  entries_.erase(id);
}

void Monitor::prune() {
  std::lock_guard<std::mutex> lock(mutex_);
  prune_finished_on_device();
}

void Monitor::waited_on_device(std::uint64_t id, WorkPtr watched) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  if (!watched) return void(entries_.erase(it));
  it->second.work = std::move(watched);
  it->second.on_device = true;
}

void Monitor::prune_finished_on_device() {
  for (auto it = entries_.begin(); it != entries_.end();)
    it = it->second.on_device && it->second.work->isCompleted() ? entries_.erase(it) : std::next(it);
}

void Monitor::publish() {
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

void Monitor::watch() {
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

}  // namespace tessera::core::c10d_detail
