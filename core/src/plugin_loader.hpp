#pragma once
/// Finds plugins by kind and name in the plugin directories (each library scanned in a child
/// process first, so that one whose loading crashes or hangs cannot take the host down), checks
/// each descriptor before calling any plugin code, catches any exception from a plugin's
/// factory at the boundary (naming the plugin), and creates objects whose libraries stay loaded for as long
/// as any object made by them lives (a shared_ptr to the library rides in the deleter).
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "tessera/sdk/error.hpp"
#include "tessera/sdk/options.hpp"
#include "tessera/sdk/plugin.hpp"

namespace tessera::core {

/// One named entry of one plugin library.
struct PluginInfo {
  std::filesystem::path path;
  sdk::PluginKind kind;
  std::string name;
  std::string description;
  std::string version;
  std::uint32_t abi_major = 0;
  std::uint32_t abi_minor = 0;
  std::string sdk_version;  ///< Tessera SDK version it was built against; "" for a descriptor without it
};

/// A library in a plugin directory that could not be used, and why.
struct RejectedPlugin {
  std::filesystem::path path;
  std::string reason;
};

class PluginLoader {
 public:
  /// Directories searched in order: `config_dirs` (the config's plugin_dirs), then
  /// $TESSERA_PLUGIN_PATH (colon-separated), then the build/install default.
  static std::vector<std::filesystem::path> search_path(const std::vector<std::string>& config_dirs);

  /// `never_unload` (the default, as in production) loads with RTLD_NODELETE: LibTorch
  /// keeps static registries that must outlive every plugin. Tests turn it off to observe
  /// unloading.
  explicit PluginLoader(std::vector<std::filesystem::path> dirs, bool never_unload = true);
  ~PluginLoader();

  /// Every usable plugin entry found, in search order.
  const std::vector<PluginInfo>& plugins();
  /// Libraries that were found but refused (no descriptor, ABI or fingerprint mismatch, ...).
  const std::vector<RejectedPlugin>& rejected();
  /// Search directories that were skipped, and why (missing, not a directory, unreadable).
  const std::vector<RejectedPlugin>& skipped_dirs();

  /// Creates plugin `name` of `kind` from `options`; throws sdk::Error with a paragraph
  /// naming what was looked for, where, and what was found instead.
  std::shared_ptr<sdk::PluginObject> create(sdk::PluginKind kind, const std::string& name, const sdk::Options& options);

  template <typename T>
  std::shared_ptr<T> create_as(sdk::PluginKind kind, const std::string& name, const sdk::Options& options) {
    std::shared_ptr<sdk::PluginObject> object = create(kind, name, options);
    auto typed = std::dynamic_pointer_cast<T>(object);
    TESSERA_CHECK(typed != nullptr, "plugin '", name, "' did not create a ", sdk::to_string(kind), " object");
    return typed;
  }

  /// Loads one file and checks it, throwing the reason it is not a usable plugin.
  /// Exposed for `tessera plugins` and the loader tests.
  std::vector<PluginInfo> inspect(const std::filesystem::path& file);
  /// As inspect, in a child process (what the scan of the plugin directories does): a library
  /// whose loading crashes or hangs (TESSERA_PLUGIN_SCAN_TIMEOUT_S, default 30 s) is refused
  /// naming it, and the host never loads it.
  /// A verdict is kept for the process and the ranks it starts (TESSERA_PLUGIN_SCAN), for as
  /// long as the file is unchanged (device, inode, size, modification time).
  std::vector<PluginInfo> probe(const std::filesystem::path& file);
  static double scan_timeout_s();

 private:
  struct Library;
  void scan();
  std::shared_ptr<Library> load(const std::filesystem::path& file);
  /// probe()'s child process: its JSON report, {"entries": [...]} or {"error": why}; throws for
  /// a crash or a hang.
  std::string probe_in_child(const std::filesystem::path& file);

  std::vector<std::filesystem::path> dirs_;
  bool never_unload_;
  bool scanned_ = false;
  std::vector<PluginInfo> plugins_;
  std::vector<RejectedPlugin> rejected_;
  std::vector<RejectedPlugin> skipped_dirs_;
  std::vector<std::shared_ptr<Library>> libraries_;  // kept until the loader dies; objects hold their own ref
};

/// The exception being handled (call inside a catch block), as a message: what() for a
/// std::exception (without LibTorch's backtrace), else its type ("an exception of type 'int'").
std::string describe_current_exception();

/// The host's build fingerprint (what every plugin must match).
sdk::BuildFingerprint host_fingerprint();
/// "compiler 12.2.0, C++11 ABI 1, LibTorch 1.13.0, CUDA off, TOML++ 3.3.0".
std::string describe(const sdk::BuildFingerprint& fingerprint);

}  // namespace tessera::core
