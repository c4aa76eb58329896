#pragma once
// The stages of `tessera data prepare` that run beside the reader: tokenizing threads fed
// batches of documents, and one thread writing shards in order (data_tool.cpp drives them).
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "tessera/toolkit/tokenizer.hpp"

namespace tessera::host {

/// Documents tokenized together by one thread: their tokens end to end (text: each followed by
/// EOS), with a chat corpus's loss mask beside them.
struct Batch {
  std::string text;                  ///< the documents end to end
  std::vector<std::size_t> starts;   ///< where each document starts in `text`
  std::vector<std::pair<std::size_t, std::int64_t>> origins;  ///< each document's input file and first line
  std::vector<toolkit::TokenId> tokens;
  std::vector<std::uint64_t> ends;  ///< where each document's tokens end in `tokens`
  std::vector<std::uint8_t> mask;   ///< one byte per token (chat: 1 for a label), else empty
  bool done = false;
};

/// One document's tokens (and mask, for a masked corpus) appended to `tokens` (`mask`); returns
/// false for a document left out (it adds nothing). Called from several threads at once.
using DocumentEncoder =
    std::function<bool(std::string_view document, std::vector<toolkit::TokenId>& tokens, std::vector<std::uint8_t>& mask)>;

/// Tokenizing threads fed batches while the reader goes on reading: the reading, tokenizing and
/// writing of a corpus overlap. At most a few batches wait per thread, so memory stays bounded
/// however large the corpus.
class TokenizerPool {
 public:
  /// `sources`: the input files, which a tokenizing error names (with the document's line).
  TokenizerPool(DocumentEncoder encode, std::int64_t threads, std::vector<std::string> sources);
  ~TokenizerPool();
  TokenizerPool(const TokenizerPool&) = delete;
  TokenizerPool& operator=(const TokenizerPool&) = delete;

  /// Queues a batch, waiting while the queue is full.
  void submit(std::shared_ptr<Batch> batch);
  /// Waits until `batch` is tokenized; throws the first tokenizing error of any batch.
  void wait(const Batch& batch);
  /// Text tokenized so far, for the progress line.
  std::int64_t bytes() const { return bytes_.load(); }

 private:
  void work();

  const DocumentEncoder encode_;
  const std::vector<std::string> sources_;
  const std::size_t capacity_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::shared_ptr<Batch>> queue_;
  bool stop_ = false;
  std::string error_;
  std::atomic<std::int64_t> bytes_{0};
  std::vector<std::thread> threads_;
};

/// One thread running tasks in the order they were posted: the shards' writer, so writing
/// overlaps reading and tokenizing. After a task fails the rest are skipped and the failure is
/// thrown to the poster.
class SerialWorker {
 public:
  SerialWorker();
  ~SerialWorker();
  SerialWorker(const SerialWorker&) = delete;
  SerialWorker& operator=(const SerialWorker&) = delete;

  /// Queues `task`; throws the failure of an earlier one.
  void post(std::function<void()> task);
  /// Waits until every posted task has run; throws the first failure.
  void drain();

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false, busy_ = false;
  std::exception_ptr failure_;
  std::thread thread_;
};

}  // namespace tessera::host
