#pragma once
/// Walks an sdk::Dataset in batches with PyTorch's DistributedSampler semantics: a shuffle
/// seeded by seed + epoch, padded by repeating its head (or truncated with drop_last) to a
/// multiple of the number of replicas, and rank r taking positions r, r + N, r + 2N, ...
/// Batch i of rank r holds positions r + N * (i * B + j), j < B, of the padded order, so
/// batch i of N ranks with batch size B together cover exactly positions [i*B*N, (i+1)*B*N):
/// the samples batch i of one device with batch size B * N covers (same seed and epoch),
/// the property parity tests rely on. With drop_last (the trainer's fit loop) this holds for
/// every batch; without it the padded final partial batch may differ.
#include <memory>
#include <vector>

#include "tessera/sdk/data.hpp"
#include "tessera/sdk/types.hpp"

namespace tessera::core {

class DataLoader {
 public:
  DataLoader(std::shared_ptr<sdk::Dataset> dataset, const sdk::DataLoaderSpec& spec);

  /// Reshuffles for `epoch` (a no-op without shuffle).
  void set_epoch(std::int64_t epoch);
  /// This rank's sample indices for the current epoch, in order.
  const std::vector<std::int64_t>& indices() const { return indices_; }
  std::int64_t num_batches() const;
  /// Batch `i` of the current epoch (random access: resuming skips without reading).
  sdk::Batch batch(std::int64_t i) const;

 private:
  std::shared_ptr<sdk::Dataset> dataset_;
  sdk::DataLoaderSpec spec_;
  std::vector<std::int64_t> indices_;
};

}  // namespace tessera::core
