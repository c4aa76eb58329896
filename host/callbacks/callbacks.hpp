#pragma once
// The [callbacks.NAME] tables made into callbacks: Lightning's built-ins (model_checkpoint,
// early_stopping, lr_monitor, weight_averaging, ema_weight_averaging) implemented in the host, anything else a `callback` plugin.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "config/config.hpp"
#include "plugin_loader.hpp"
#include "tessera/sdk/callback.hpp"

namespace tessera::host {

using NamedCallback = std::pair<std::string, std::shared_ptr<sdk::Callback>>;

/// The callbacks implemented in the host, by their `plugin` names.
inline const std::vector<std::string> kBuiltInCallbacks = {"model_checkpoint", "early_stopping", "lr_monitor",
                                                           "weight_averaging", "ema_weight_averaging"};

/// A capability of callbacks that keep their own copy of the model's weights (weight
/// averaging): such a callback restores a checkpoint's trained weights itself (the trainer leaves
/// them to it), and the memory plan counts its copy. The trainer and the plan look it up on the
/// callbacks instead of matching their names.
class KeepsWeightCopy {
 public:
  virtual ~KeepsWeightCopy() = default;
  /// Whether the network's buffers are copied besides the parameters (use_buffers).
  virtual bool copies_buffers() const = 0;
};

/// Every configured callback, checkpointing ones last (Lightning's order), with a default
/// model_checkpoint from [trainer] checkpoint_every_n_steps / save_last when none is
/// configured. Every key is checked here, before any work.
std::vector<NamedCallback> make_callbacks(const Config& config, core::PluginLoader& loader);

std::shared_ptr<sdk::Callback> make_model_checkpoint(const sdk::Options& options);
std::shared_ptr<sdk::Callback> make_early_stopping(const sdk::Options& options);
std::shared_ptr<sdk::Callback> make_lr_monitor(const sdk::Options& options);
/// weight_averaging (equal weights) or, with `ema`, ema_weight_averaging (weight_averaging.hpp).
std::shared_ptr<sdk::Callback> make_weight_averaging(const sdk::Options& options, bool ema);

/// The monitored-metric comparison of ModelCheckpoint and EarlyStopping: "min" or "max".
bool is_better(double candidate, double reference, const std::string& mode, double min_delta = 0.0);

}  // namespace tessera::host
