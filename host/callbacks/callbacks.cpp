#include "callbacks/callbacks.hpp"

#include <algorithm>

#include "tessera/sdk/error.hpp"

namespace tessera::host {

bool is_better(double candidate, double reference, const std::string& mode, double min_delta) {
  return mode == "min" ? candidate < reference - min_delta : candidate > reference + min_delta;
}

std::vector<NamedCallback> make_callbacks(const Config& config, core::PluginLoader& loader) {
  std::vector<NamedCallback> callbacks, checkpointing;
  bool have_checkpoint = false;
  std::string averaging;  // the one weight-averaging callback: two would swap each other's weights
  for (const auto& [name, options] : config.callbacks) {
    std::string plugin = options.get_string(
        {"plugin", "a built-in callback (" + sdk::join(kBuiltInCallbacks) + ") or a callback plugin; default NAME"},
        name);
    std::shared_ptr<sdk::Callback> callback;
    if (plugin == "model_checkpoint") callback = make_model_checkpoint(options);
    else if (plugin == "early_stopping") callback = make_early_stopping(options);
    else if (plugin == "lr_monitor") callback = make_lr_monitor(options);
    else if (plugin == "weight_averaging" || plugin == "ema_weight_averaging") {
      TESSERA_CHECK(averaging.empty(), config.path(), ": [callbacks.", averaging, "] and [callbacks.", name,
                    "] both average the weights: keep one");
      averaging = name;
      callback = make_weight_averaging(options, plugin == "ema_weight_averaging");
    }
    else {
      try {
        callback = loader.create_as<sdk::Callback>(sdk::PluginKind::callback, plugin, options);
      } catch (const sdk::Error& e) {
        if (std::string(e.what()).find("no callback plugin named") == std::string::npos) throw;
        TESSERA_FAIL(config.path(), ": [callbacks.", name, "]: '", plugin, "' is neither a built-in callback",
                     sdk::did_you_mean(plugin, kBuiltInCallbacks), " (", sdk::join(kBuiltInCallbacks),
                     ") nor a callback plugin: ", e.what());
      }
    }
    options.check_all_used({"plugin"});
    if (plugin == "model_checkpoint") {
      TESSERA_CHECK(config.trainer.enable_checkpointing, config.path(), ": [callbacks.", name,
                    "] is a model_checkpoint, but [trainer] enable_checkpointing = false: remove one of them");
      have_checkpoint = true;
      checkpointing.emplace_back(name, callback);
    } else {
      callbacks.emplace_back(name, callback);
    }
  }
  // Checked above, but neither a debugging run nor enable_checkpointing = false saves anything.
  if (config.trainer.fast_dev_run > 0 || !config.trainer.enable_checkpointing) return callbacks;
  if (!have_checkpoint) {  // Lightning's default checkpoint callback, from the [trainer] keys
    toml::table table;
    table.insert("every_n_train_steps", config.trainer.checkpoint_every_n_steps);
    table.insert("save_top_k", -1);
    table.insert("save_last", config.trainer.save_last);
    if (config.trainer.checkpoint_every_n_steps == 0) table.insert("every_n_epochs", 0);
    // Its keys' defaults are the callback's, not [trainer]'s: kept out of `tessera config`.
    sdk::Options::KeyObserver observer = sdk::Options::observe_keys(nullptr);
    checkpointing.emplace_back("model_checkpoint",
                               make_model_checkpoint(sdk::make_options("trainer", config.path(), std::move(table))));
    sdk::Options::observe_keys(std::move(observer));
  }
  callbacks.insert(callbacks.end(), checkpointing.begin(), checkpointing.end());
  return callbacks;
}

}  // namespace tessera::host
