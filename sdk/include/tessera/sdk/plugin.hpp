#pragma once
/// The plugin entry point. A plugin .so exports exactly one symbol, the Boost.DLL alias
/// `tessera_plugin`, a function returning a PluginDescriptor. The host checks the
/// descriptor (ABI, size, kind, build fingerprint, non-null functions) before it calls
/// any other plugin code. Write it with TESSERA_PLUGIN, never by hand:
///
///   TESSERA_PLUGIN(strategy, "1.0.0",
///       tessera::sdk::plugin_entry<MyStrategy>("my_strategy", "what it does"));
///
/// Objects a plugin creates are destroyed by the same plugin (PluginEntry::destroy); the
/// host keeps the library loaded for as long as any of them lives.
#include <cstddef>
#include <cstdint>
#include <iterator>

#include <boost/dll/alias.hpp>
#include <torch/version.h>

#include "tessera/sdk/build_config.hpp"
#include "tessera/sdk/export.hpp"
#include "tessera/sdk/options.hpp"

namespace tessera::sdk {

/// The ABI is the SDK library's exported names, the vtables of its interfaces and the layout of
/// the strategy API's classes in tessera/core (StrategyBase, Communicator, DeviceMesh,
/// PrecisionBase): removing or changing any of them bumps the major, adding one bumps the minor.
/// The installed CMake package's version is this ABI: find_package(TesseraSDK 9).
/// What each ABI changed: sdk/CHANGELOG.md.
inline constexpr std::uint32_t kAbiMajor = 9;
inline constexpr std::uint32_t kAbiMinor = 0;

enum class PluginKind : std::uint32_t { strategy = 1, precision, checkpoint_io, model, data, callback };
TESSERA_SDK_API const char* to_string(PluginKind kind);

/// Base of every object a plugin hands to the host.
class TESSERA_SDK_API PluginObject {
 public:
  virtual ~PluginObject();
};

/// One named configuration a plugin offers (a .so may offer several, like Lightning's
/// "fsdp" and "fsdp_cpu_offload").
struct PluginEntry {
  const char* name;
  const char* description;
  PluginObject* (*create)(const Options& options);  ///< throws sdk::Error on bad options
  void (*destroy)(PluginObject* object);
};

/// What the plugin was compiled with; must equal the host's, field by field. It names every
/// third-party library whose types cross the boundary: the standard library (compiler, C++11
/// ABI) and LibTorch (tensors, modules, optimizers).
struct BuildFingerprint {
  const char* compiler;       ///< __VERSION__
  std::int32_t cxx11_abi;     ///< _GLIBCXX_USE_CXX11_ABI
  const char* torch_version;  ///< TORCH_VERSION
  std::int32_t cuda;          ///< built with CUDA paths
};

/// abi_major, abi_minor and struct_size come first in every ABI, so that any host can read
/// them. Fields after num_entries are appended ones: a plugin built against an older header
/// of the same major lacks them (its struct_size says so), and the host then uses their
/// defaults. Append new fields at the end (and bump kAbiMinor); never reorder or remove.
struct PluginDescriptor {
  std::uint32_t abi_major;
  std::uint32_t abi_minor;
  std::uint32_t struct_size;  ///< sizeof(PluginDescriptor) in the plugin
  PluginKind kind;
  const char* version;        ///< the plugin's own version
  BuildFingerprint fingerprint;
  const PluginEntry* entries;
  std::uint32_t num_entries;
  // Appended fields (read only when struct_size covers them):
  const char* sdk_version;    ///< TESSERA_VERSION of the SDK headers it was built with (default "")
};

/// The fields every descriptor of this ABI major has (those up to num_entries).
inline constexpr std::uint32_t kDescriptorBaseSize = offsetof(PluginDescriptor, num_entries) + sizeof(std::uint32_t);

#if defined(_GLIBCXX_USE_CXX11_ABI)
#define TESSERA_CXX11_ABI _GLIBCXX_USE_CXX11_ABI
#else
#define TESSERA_CXX11_ABI -1
#endif

/// The fingerprint of the translation unit that expands it.
#define TESSERA_BUILD_FINGERPRINT \
  ::tessera::sdk::BuildFingerprint { __VERSION__, TESSERA_CXX11_ABI, TORCH_VERSION, TESSERA_WITH_CUDA }

/// An entry whose factory is `new T(options)`.
template <typename T>
PluginEntry plugin_entry(const char* name, const char* description) {
  return PluginEntry{name, description,
                     [](const Options& options) -> PluginObject* { return new T(options); },
                     [](PluginObject* object) { delete object; }};
}

}  // namespace tessera::sdk

#define TESSERA_PLUGIN(KIND, VERSION, ...)                                                          \
  namespace {                                                                                       \
  const ::tessera::sdk::PluginEntry tessera_plugin_entries_[] = {__VA_ARGS__};                      \
  const ::tessera::sdk::PluginDescriptor tessera_plugin_descriptor_ = {                             \
      ::tessera::sdk::kAbiMajor,                                                                    \
      ::tessera::sdk::kAbiMinor,                                                                    \
      sizeof(::tessera::sdk::PluginDescriptor),                                                     \
      ::tessera::sdk::PluginKind::KIND,                                                             \
      VERSION,                                                                                      \
      TESSERA_BUILD_FINGERPRINT,                                                                    \
      tessera_plugin_entries_,                                                                      \
      static_cast<std::uint32_t>(std::size(tessera_plugin_entries_)),                               \
      TESSERA_VERSION};                                                                             \
  const ::tessera::sdk::PluginDescriptor* tessera_plugin_get_descriptor_() {                        \
    return &tessera_plugin_descriptor_;                                                             \
  }                                                                                                 \
  }                                                                                                 \
  BOOST_DLL_ALIAS(tessera_plugin_get_descriptor_, tessera_plugin)
