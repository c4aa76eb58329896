#include "compose/plugin_keys.hpp"

#include <algorithm>
#include <map>
#include <set>

#include "tessera/sdk/callback.hpp"
#include "tessera/sdk/checkpoint_io.hpp"
#include "tessera/sdk/data.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/module.hpp"
#include "tessera/sdk/precision.hpp"
#include "tessera/sdk/strategy.hpp"

namespace tessera::host {

namespace {

/// The object a plugin created implements the interface of its kind (the host casts to it).
void check_interface(core::PluginLoader& loader, sdk::PluginKind kind, const std::string& section,
                     const std::string& name, sdk::PluginObject& object) {
  const char* interface = nullptr;
  bool right = true;
  switch (kind) {
    case sdk::PluginKind::strategy: right = dynamic_cast<sdk::Strategy*>(&object), interface = "Strategy"; break;
    case sdk::PluginKind::precision: right = dynamic_cast<sdk::Precision*>(&object), interface = "Precision"; break;
    case sdk::PluginKind::checkpoint_io:
      right = dynamic_cast<sdk::CheckpointIO*>(&object), interface = "CheckpointIO";
      break;
    case sdk::PluginKind::model: right = dynamic_cast<sdk::Module*>(&object), interface = "Module"; break;
    case sdk::PluginKind::data: right = dynamic_cast<sdk::DataModule*>(&object), interface = "DataModule"; break;
    case sdk::PluginKind::callback: right = dynamic_cast<sdk::Callback*>(&object), interface = "Callback"; break;
  }
  if (right) return;
  std::string path = "?";
  for (const core::PluginInfo& info : loader.plugins())
    if (info.kind == kind && info.name == name) path = info.path.string();
  TESSERA_FAIL("[", section, "] plugin = \"", name, "\" (", path, ") created an object that is not a tessera::sdk::",
               interface, ": its factory returns the wrong class for a ", sdk::to_string(kind),
               " plugin (fix the plugin's TESSERA_PLUGIN entry, or choose another [", section, "] plugin)");
}

/// The keys of `options` that no getter read. sdk::Options keeps its read set to itself; a key
/// is unread when check_all_used fails with every other key declared known.
std::vector<std::string> unread_keys(const sdk::Options& options) {
  const std::vector<std::string> all = options.keys();
  std::vector<std::string> unread;
  for (const std::string& key : all) {
    if (key == "plugin") continue;
    std::vector<std::string> others = {"plugin"};
    for (const std::string& other : all)
      if (other != key) others.push_back(other);
    try {
      options.check_all_used(others);
    } catch (const sdk::Error&) {
      unread.push_back(key);
    }
  }
  return unread;
}

/// Which of `keys` plugin `name` reads, found by creating it from the whole section and from
/// each key alone (a factory reads its keys through the getters: one that throws on a value has
/// still read the keys before it, and the key-alone tries reach those after it).
std::set<std::string> keys_read_by(core::PluginLoader& loader, sdk::PluginKind kind, const std::string& name,
                                   const sdk::Options& options, const std::vector<std::string>& keys) {
  const toml::table& whole = sdk::toml_table(options);
  std::vector<toml::table> tries = {whole};
  for (const std::string& key : keys) {
    toml::table alone;
    alone.insert(key, *whole.get(key));
    tries.push_back(std::move(alone));
  }
  std::set<std::string> read;
  for (const toml::table& table : tries) {
    const sdk::Options probe = sdk::make_options(options.section(), options.source(), table);
    try {
      loader.create(kind, name, probe);  // dropped at once
    } catch (const std::exception&) {
    }
    const std::vector<std::string> unread = unread_keys(probe);
    for (const auto& [key, node] : table)
      if (std::find(keys.begin(), keys.end(), std::string(key.str())) != keys.end() &&
          std::find(unread.begin(), unread.end(), std::string(key.str())) == unread.end())
        read.insert(std::string(key.str()));
  }
  return read;
}

}  // namespace

std::shared_ptr<sdk::PluginObject> create_plugin(core::PluginLoader& loader, sdk::PluginKind kind,
                                                 const std::string& section, const Config& config) {
  const sdk::Options& options = config.plugins.at(section);
  const std::string& name = config.plugin_names.at(section);
  std::shared_ptr<sdk::PluginObject> object = loader.create(kind, name, options);
  check_interface(loader, kind, section, name, *object);
  const std::vector<std::string> unread = unread_keys(options);
  if (unread.empty()) return object;

  // Keys of other plugins of this kind, e.g. fsdp's in [strategy] with plugin = "ddp".
  std::map<std::string, std::vector<std::string>> owners;  // key -> plugins that read it
  std::map<std::string, std::size_t> coverage;             // plugin -> how many of the keys it reads
  for (const core::PluginInfo& info : loader.plugins()) {
    if (info.kind != kind || info.name == name || coverage.count(info.name)) continue;
    coverage[info.name] = 0;
    for (const std::string& key : keys_read_by(loader, kind, info.name, options, unread)) {
      owners[key].push_back(info.name);
      ++coverage[info.name];
    }
  }
  if (!owners.empty()) {
    std::string listed, back, unsets;
    std::size_t best = 0;
    for (const std::string& key : unread) {
      if (!owners.count(key)) continue;
      std::string where = options.locate(key);
      where = where.substr(0, where.find(": ["));
      listed += "\n  " + key + " (" + where + "): a key of " + sdk::join(owners[key]);
      unsets += " --unset " + section + "." + key;
    }
    for (const auto& [plugin, count] : coverage)
      if (count > best) best = count, back = plugin;
    std::string others;
    for (const std::string& key : unread)
      if (!owners.count(key)) others += (others.empty() ? "" : ", ") + key;
    const std::string chosen = options.has("plugin") ? options.locate("plugin") + " = \"" + name + "\""
                                                     : options.source() + ": [" + section + "] plugin is not set, so \"" +
                                                           name + "\" (the default) runs";
    TESSERA_FAIL(chosen, ", but [", section, "] also holds keys of other ",
                 sdk::to_string(kind), " plugins, which ", name, " does not read:", listed, "\n  Remove them from [",
                 section, "] to use ", name, ", or go back to the plugin they were written for: [", section,
                 "] plugin = \"", back, "\"",
                 others.empty() ? std::string() : " (" + others + ": not a key of any " +
                                                      std::string(sdk::to_string(kind)) + " plugin found)",
                 "\n  On the command line:", unsets, " --set ", section, ".plugin=", name, " (or --unset ", section,
                 " --set ", section, ".plugin=", name, " for a fresh [", section, "])");
  }
  options.check_all_used({"plugin"});
  return object;
}

}  // namespace tessera::host
