#pragma once
/// One thread that runs a group's collectives in issue order (every rank issues them in the
/// same order, as c10d requires), so that they overlap the caller's compute as Gloo's do. Each
/// submitted closure is a c10d::Work that completes when it has run. Once one throws, the
/// ranks' steps no longer line up: every later closure fails with the same error.
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include <torch/csrc/distributed/c10d/Work.hpp>

namespace tessera::core::detail {

class SerialWorkQueue {
 public:
  SerialWorkQueue();
  ~SerialWorkQueue();  ///< close()
  SerialWorkQueue(const SerialWorkQueue&) = delete;
  SerialWorkQueue& operator=(const SerialWorkQueue&) = delete;

  /// After close(), the Work fails at once.
  c10::intrusive_ptr<c10d::Work> submit(std::function<void()> run);
  /// Stops the thread once the closure it runs returns; those still queued fail. Idempotent.
  void close();
  /// True from close() on: a closure that waits for its peers gives up.
  bool closing() const { return stop_; }

 private:
  class QueuedWork;
  void serve();

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::pair<std::function<void()>, c10::intrusive_ptr<QueuedWork>>> queue_;
  std::string broken_;  ///< why the queue stopped running closures (the worker's own)
  std::atomic<bool> stop_{false};
  std::thread worker_;
};

}  // namespace tessera::core::detail
