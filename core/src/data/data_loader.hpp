#pragma once
/// Walks an sdk::Dataset in batches with PyTorch's DistributedSampler semantics: a shuffle
/// seeded by seed + epoch, padded by repeating its head (or truncated with drop_last) to a
/// multiple of the number of replicas, and rank r taking positions r, r + N, r + 2N, ...
/// Batch i of rank r holds positions r + N * (i * B + j), j < B, of the padded order, so
/// batch i of N ranks with batch size B together cover exactly positions [i*B*N, (i+1)*B*N):
/// the samples batch i of one device with batch size B * N covers (same seed and epoch),
/// the property parity tests rely on. With drop_last (the trainer's fit loop) this holds for
/// every batch; without it the padded final partial batch may differ.
///
/// A dataset that implements sdk::LargeDataset (token corpora) is shuffled instead by a
/// bijection of [0, size) computed per position (a Feistel network keyed by seed and epoch,
/// cycle-walking into range): no permutation array, so memory does not grow with the corpus,
/// and position p maps to the same sample whatever the number of replicas. Its next batch is
/// read on a background thread while the caller computes.
#include <cstdint>
#include <future>
#include <memory>
#include <vector>

#include "tessera/sdk/data.hpp"
#include "tessera/sdk/types.hpp"

namespace tessera::core {

class DataLoader {
 public:
  DataLoader(std::shared_ptr<sdk::Dataset> dataset, const sdk::DataLoaderSpec& spec);
  ~DataLoader();  ///< waits for a read-ahead in flight
  DataLoader(DataLoader&&) = default;
  DataLoader& operator=(DataLoader&&) = default;

  /// Reshuffles for `epoch` (a no-op without shuffle).
  void set_epoch(std::int64_t epoch);
  /// This rank's sample indices for the current epoch, in order (for a LargeDataset computed
  /// on this call: tests and tools only).
  const std::vector<std::int64_t>& indices() const;
  /// This rank's k-th sample index of the current epoch.
  std::int64_t index(std::int64_t k) const;
  std::int64_t num_batches() const;
  /// Batch `i` of the current epoch (random access: resuming skips without reading).
  sdk::Batch batch(std::int64_t i);

 private:
  std::int64_t per_rank() const;
  std::vector<std::int64_t> batch_indices(std::int64_t i) const;
  void drain();

  std::shared_ptr<sdk::Dataset> dataset_;
  sdk::DataLoaderSpec spec_;
  bool large_ = false;  // sdk::LargeDataset: per-position permutation and read-ahead
  std::int64_t size_ = 0, epoch_ = 0;
  std::uint64_t key_ = 0;
  mutable std::vector<std::int64_t> indices_;
  std::future<sdk::Batch> ahead_;
  std::int64_t ahead_index_ = -1;
};

/// The bijection of [0, n) a LargeDataset is shuffled with: position -> sample, a pure function
/// of (key, n, position). Exposed for tests.
std::int64_t feistel_permute(std::int64_t position, std::int64_t n, std::uint64_t key);
/// The key for (seed, epoch).
std::uint64_t feistel_key(std::int64_t seed, std::int64_t epoch);

}  // namespace tessera::core
