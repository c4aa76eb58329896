#pragma once
// Creating a configured plugin and checking that it read every key of its section.
#include <memory>
#include <string>

#include "config/config.hpp"
#include "plugin_loader.hpp"

namespace tessera::host {

/// Creates the plugin of `section` ("strategy", ...) named in the config and checks that it
/// read every key of the section but `plugin`. Keys it did not read that other plugins of the
/// same kind do read (fsdp's keys left in [strategy] after --set strategy.plugin=ddp) are
/// named with those plugins and what to do; any other key is "not a known key, did you mean".
std::shared_ptr<sdk::PluginObject> create_plugin(core::PluginLoader& loader, sdk::PluginKind kind,
                                                 const std::string& section, const Config& config);

}  // namespace tessera::host
