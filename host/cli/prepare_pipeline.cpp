#include "cli/prepare_pipeline.hpp"

#include "tessera/sdk/error.hpp"

namespace tessera::host {

TokenizerPool::TokenizerPool(DocumentEncoder encode, std::int64_t threads, std::vector<std::string> sources)
    : encode_(std::move(encode)), sources_(std::move(sources)), capacity_(static_cast<std::size_t>(4 * threads)) {
  for (std::int64_t t = 0; t < threads; ++t) threads_.emplace_back([this] { work(); });
}

TokenizerPool::~TokenizerPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  for (auto& t : threads_) t.join();
}

void TokenizerPool::submit(std::shared_ptr<Batch> batch) {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return queue_.size() < capacity_ || !error_.empty(); });
  TESSERA_CHECK(error_.empty(), error_);
  queue_.push_back(std::move(batch));
  changed_.notify_all();
}

void TokenizerPool::wait(const Batch& batch) {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return batch.done || !error_.empty(); });
  TESSERA_CHECK(error_.empty(), error_);
}

void TokenizerPool::work() {
  for (;;) {
    std::shared_ptr<Batch> batch;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      batch = std::move(queue_.front());
      queue_.pop_front();
    }
    changed_.notify_all();  // room in the queue
    try {
      for (std::size_t d = 0; d < batch->starts.size(); ++d) {
        const std::size_t end = d + 1 < batch->starts.size() ? batch->starts[d + 1] : batch->text.size();
        const std::string_view document(batch->text.data() + batch->starts[d], end - batch->starts[d]);
        bool kept = false;
        try {
          kept = encode_(document, batch->tokens, batch->mask);
        } catch (const std::exception& e) {  // the input's file and line, not only the shard's
          const auto& [file, line] = batch->origins[d];
          TESSERA_FAIL(sources_.at(file), ":", line, " (the document starting there): ", e.what());
        }
        if (kept) batch->ends.push_back(batch->tokens.size());
      }
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (error_.empty()) error_ = e.what();
      changed_.notify_all();
      continue;
    }
    bytes_ += static_cast<std::int64_t>(batch->text.size());
    std::string().swap(batch->text);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      batch->done = true;
    }
    changed_.notify_all();
  }
}

SerialWorker::SerialWorker() : thread_([this] { run(); }) {}

SerialWorker::~SerialWorker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void SerialWorker::post(std::function<void()> task) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failure_) std::rethrow_exception(failure_);
  tasks_.push_back(std::move(task));
  changed_.notify_all();
}

void SerialWorker::drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return (tasks_.empty() && !busy_) || failure_; });
  if (failure_) std::rethrow_exception(failure_);
}

void SerialWorker::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
    if (stop_) return;
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    busy_ = true;
    lock.unlock();
    std::exception_ptr failure;
    if (!failure_) {
      try {
        task();
      } catch (...) {
        failure = std::current_exception();
      }
    }
    lock.lock();
    busy_ = false;
    if (failure && !failure_) failure_ = failure;
    changed_.notify_all();
  }
}

}  // namespace tessera::host
