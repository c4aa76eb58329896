#pragma once
/// Data plugins (Lightning's LightningDataModule). A data plugin only says what the
/// samples are; which rank sees which sample is decided by the strategy's
/// process_dataloader() and the host's sampler, so N ranks see exactly the global batch
/// that one device sees.
#include <memory>
#include <string>
#include <vector>

#include "tessera/sdk/plugin.hpp"
#include "tessera/sdk/types.hpp"

namespace tessera::sdk {

/// An indexed, read-only dataset. Must be safe to call from one thread at a time.
class TESSERA_SDK_API Dataset {
 public:
  virtual ~Dataset();
  virtual std::int64_t size() const = 0;
  /// The samples at `indices` stacked into one batch (batch on dim 0).
  virtual Batch get_batch(const std::vector<std::int64_t>& indices) const = 0;
};

class TESSERA_SDK_API DataModule : public PluginObject {
 public:
  ~DataModule() override;
  /// Load or index the data for a stage ("fit", "validate", "test", "predict"). Called once
  /// per stage on every rank, before the *_dataset() accessors. Missing files are errors
  /// naming the path and the config key that chose it.
  virtual void setup(const std::string& stage) = 0;
  virtual std::shared_ptr<Dataset> train_dataset() = 0;
  virtual std::shared_ptr<Dataset> val_dataset() = 0;   ///< may be null
  virtual std::shared_ptr<Dataset> test_dataset() = 0;  ///< may be null
  /// Inputs for `tessera predict` (e.g. an encoded prompt); may be null.
  virtual std::shared_ptr<Dataset> predict_dataset() = 0;
  /// Renders a predict_step output for the user (e.g. bytes decoded to text).
  virtual std::string describe_prediction(const Batch& batch, const at::Tensor& output) const = 0;
  /// What throughput is counted in: "tokens" or "samples".
  virtual std::string item_unit() const = 0;
};

}  // namespace tessera::sdk
