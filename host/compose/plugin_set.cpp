#include "compose/plugin_set.hpp"

#include "compose/plugin_keys.hpp"

namespace tessera::host {

namespace {

template <typename Interface>  // create_plugin has checked the object's interface, naming the plugin
std::shared_ptr<Interface> create(core::PluginLoader& loader, const std::string& section, const Config& config) {
  return std::dynamic_pointer_cast<Interface>(create_plugin(loader, kPluginKinds.at(section), section, config));
}

}  // namespace

PluginSet compose_plugins(core::PluginLoader& loader, const Config& config) {
  PluginSet set;
  set.strategy = create<sdk::Strategy>(loader, "strategy", config);
  set.precision = create<sdk::Precision>(loader, "precision", config);
  set.checkpoint_io = create<sdk::CheckpointIO>(loader, "checkpoint_io", config);
  set.model = create<sdk::Module>(loader, "model", config);
  set.data = create<sdk::DataModule>(loader, "data", config);
  set.strategy->connect(set.precision, set.checkpoint_io);
  return set;
}

std::shared_ptr<sdk::Module> compose_model(core::PluginLoader& loader, const Config& config) {
  return create<sdk::Module>(loader, "model", config);
}

}  // namespace tessera::host
