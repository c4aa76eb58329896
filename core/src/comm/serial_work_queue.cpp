#include "serial_work_queue.hpp"

#include <stdexcept>

namespace tessera::core::detail {

class SerialWorkQueue::QueuedWork final : public c10d::Work {
 public:
  void complete(std::exception_ptr error = nullptr) { finish(std::move(error)); }
};

SerialWorkQueue::SerialWorkQueue() : worker_([this] { serve(); }) {}

SerialWorkQueue::~SerialWorkQueue() { close(); }

void SerialWorkQueue::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  if (!worker_.joinable()) return;
  ready_.notify_all();
  worker_.join();
}

c10::intrusive_ptr<c10d::Work> SerialWorkQueue::submit(std::function<void()> run) {
  auto work = c10::make_intrusive<QueuedWork>();
  bool queued = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!stop_) queue_.emplace_back(std::move(run), work);
    queued = !stop_;
  }
  if (!queued) work->complete(std::make_exception_ptr(std::runtime_error("the collectives' worker was closed")));
  ready_.notify_one();
  return work;
}

void SerialWorkQueue::serve() {
  for (;;) {
    std::pair<std::function<void()>, c10::intrusive_ptr<QueuedWork>> op;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      op = std::move(queue_.front());
      queue_.pop_front();
    }
    if (stop_ && broken_.empty()) broken_ = "the collectives' worker was closed";
    if (!broken_.empty()) {
      op.second->complete(std::make_exception_ptr(std::runtime_error(broken_)));
      continue;
    }
    try {
      op.first();
      op.second->complete();
    } catch (const std::exception& e) {
      broken_ = e.what();
      op.second->complete(std::current_exception());
    }
  }
}

}  // namespace tessera::core::detail
