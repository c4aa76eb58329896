#pragma once
// Lightning's WeightAveraging (an equal average of the weights after each update, SWA) and
// EMAWeightAveraging (an exponential moving average). Lightning refuses sharded models; here
// each rank averages what its optimizer steps (its shards of the parameters, full precision
// for 16-bit ones) and the module's buffers: one more copy of the rank's shard, no collective.
// Validation during fit runs on the average, the model holds it once fit ends, and a
// checkpoint's "state_dict" is the average, with the trained weights in "current_model_state"
// (Lightning's layout), so validate, test, predict, init_from and export use the average and
// fit resumes both exactly.
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

#include "callbacks/callbacks.hpp"
#include "tessera/sdk/callback.hpp"
#include "tessera/sdk/options.hpp"

namespace tessera::host {

class WeightAveraging final : public sdk::Callback, public KeepsWeightCopy {
 public:
  /// `ema`: ema_weight_averaging (`decay`), else weight_averaging (equal weights).
  WeightAveraging(const sdk::Options& options, bool ema);

  /// Updates the average (Lightning does in on_train_batch_end, before its validation).
  void on_after_optimizer_step(sdk::Trainer& trainer) override;

  void on_fit_start(sdk::Trainer& trainer) override;
  void on_train_epoch_end(sdk::Trainer& trainer) override;
  void on_validation_start(sdk::Trainer& trainer) override;
  void on_validation_end(sdk::Trainer& trainer) override;
  void on_fit_end(sdk::Trainer& trainer) override;
  void on_save_checkpoint(sdk::Trainer& trainer, sdk::Checkpoint& checkpoint) override;
  void on_load_checkpoint(sdk::Trainer& trainer, const sdk::Checkpoint& checkpoint) override;
  std::string state_key() const override;
  bool copies_buffers() const override { return use_buffers_; }
  sdk::Checkpoint state_dict() const override;
  void load_state_dict(const sdk::Checkpoint& state) override;

 private:
  /// What the average covers, in a fixed order: the optimizer's parameters (this rank's
  /// shards), then the network's buffers when use_buffers.
  std::vector<at::Tensor> targets(sdk::Trainer& trainer) const;
  void start(sdk::Trainer& trainer);  ///< the average := the weights now, none averaged yet
  void update(sdk::Trainer& trainer);
  void swap_in(sdk::Trainer& trainer);   ///< the model holds the average, its weights kept aside
  void swap_out(sdk::Trainer& trainer);  ///< the model's weights back

  bool ema_;
  double decay_;
  std::int64_t every_n_steps_, starting_at_step_, starting_at_epoch_;  ///< starting_at_epoch_ -1: never at epoch ends
  bool use_buffers_;

  std::vector<at::Tensor> average_, kept_;
  std::int64_t averaged_ = 0;            ///< updates folded into the average (AveragedModel's n_averaged)
  std::int64_t latest_update_step_ = 0;  ///< global_step of the last update
  std::int64_t latest_update_epoch_ = -1;
  bool finished_ = false;  ///< fit ended: the model holds the average
};

}  // namespace tessera::host
