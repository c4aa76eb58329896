#pragma once
/// Optional interfaces of token data (the `tokens` plugin implements both). Queried with
/// dynamic_cast, like StrategyChecks: adding them changed no existing vtable (no ABI change).
#include <cstdint>
#include <string>

#include "tessera/sdk/export.hpp"

namespace tessera::sdk {

/// A DataModule whose samples are token ids below a vocabulary size. The host checks it
/// against the model's `vocab_size` hyper-parameter on every rank after setup, before any step.
class TESSERA_SDK_API TokenVocabulary {
 public:
  virtual ~TokenVocabulary();
  /// Every id the data can hold is below this (e.g. the manifest's vocab_size).
  virtual std::int64_t vocab_size() const = 0;
  /// Where that number comes from, for messages (e.g. "/data/fineweb/manifest.json").
  virtual std::string vocab_source() const = 0;
};

/// A Dataset too large for a permutation array per epoch. The host's sampler then shuffles it
/// with a bijection computed per index (a Feistel network keyed by seed and epoch), so its
/// memory does not grow with the dataset, and reads the next batch on a background thread while
/// the step computes (get_batch is then called from that thread, one call at a time).
class TESSERA_SDK_API LargeDataset {
 public:
  virtual ~LargeDataset();
};

}  // namespace tessera::sdk
