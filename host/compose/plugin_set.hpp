#pragma once
// The plugins a config names, composed in one place: fit and the other trainer commands, the
// checks before any rank starts, `tessera plan` and `checkpoint export --format hf` all take
// them from here.
#include <memory>

#include "config/config.hpp"
#include "plugin_loader.hpp"
#include "tessera/sdk/checkpoint_io.hpp"
#include "tessera/sdk/data.hpp"
#include "tessera/sdk/module.hpp"
#include "tessera/sdk/precision.hpp"
#include "tessera/sdk/strategy.hpp"

namespace tessera::host {

/// A config's five plugins, each created from its section and checked to have read every key
/// of it (create_plugin), the strategy connected to its precision and checkpoint IO.
struct PluginSet {
  std::shared_ptr<sdk::Strategy> strategy;
  std::shared_ptr<sdk::Precision> precision;
  std::shared_ptr<sdk::CheckpointIO> checkpoint_io;
  std::shared_ptr<sdk::Module> model;
  std::shared_ptr<sdk::DataModule> data;
};

/// Creates the five in the order of kPluginSections. Throws sdk::Error naming the section for a
/// key its plugin does not read, an unknown plugin, or an object of another interface.
PluginSet compose_plugins(core::PluginLoader& loader, const Config& config);

/// The [model] plugin alone.
std::shared_ptr<sdk::Module> compose_model(core::PluginLoader& loader, const Config& config);

}  // namespace tessera::host
