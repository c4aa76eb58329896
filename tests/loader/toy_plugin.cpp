// One source, compiled into several deliberately good and broken plugins (see CMakeLists.txt):
// TOY_MODE selects what is wrong with the resulting library.
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <unistd.h>

#include "tessera/sdk/error.hpp"
#include "tessera/sdk/plugin.hpp"

#define TOY_GOOD 0
#define TOY_NO_ENTRY 1
#define TOY_WRONG_ABI 2
#define TOY_WRONG_FINGERPRINT 3
#define TOY_THROWING_FACTORY 4
#define TOY_NULL_CREATE 5
#define TOY_OLD_DESCRIPTOR 6
#define TOY_SHORT_DESCRIPTOR 7
#define TOY_ABORTING_CONSTRUCTOR 8
#define TOY_HANGING_CONSTRUCTOR 9
#define TOY_INT_FACTORY 10
#define TOY_UNDEFINED_SYMBOL 11
#define TOY_UNKNOWN_KIND 12

#if TOY_MODE == TOY_UNDEFINED_SYMBOL
extern "C" void tessera_toy_defined_nowhere();
#endif

namespace {

/// The object the toy plugin creates: remembers its option and counts live instances.
class Toy final : public tessera::sdk::PluginObject {
 public:
  explicit Toy(const tessera::sdk::Options& options) : greeting_(options.get_string("greeting", "hello")) {
#if TOY_MODE == TOY_THROWING_FACTORY
    TESSERA_FAIL("toy factory refuses: [model] greeting = \"", greeting_, "\"");
#elif TOY_MODE == TOY_INT_FACTORY
    throw 42;  // not a std::exception: the host must still name the plugin, never std::terminate
#elif TOY_MODE == TOY_UNDEFINED_SYMBOL
    tessera_toy_defined_nowhere();  // linked as a MODULE, resolved (and missed) only by dlopen
#endif
  }
  const std::string& greeting() const { return greeting_; }

 private:
  std::string greeting_;
};

#if TOY_MODE == TOY_ABORTING_CONSTRUCTOR
// Runs when the library is loaded, before any descriptor is read.
const int toy_abort_on_load = [] {
  std::fprintf(stderr, "toy: aborting in a static constructor\n");
  std::abort();
  return 0;
}();
#elif TOY_MODE == TOY_HANGING_CONSTRUCTOR
const int toy_hang_on_load = [] {
  for (;;) ::pause();
  return 0;
}();
#endif

}  // namespace

#if TOY_MODE == TOY_NO_ENTRY
extern "C" __attribute__((visibility("default"))) int toy_not_a_plugin() { return 42; }
#elif TOY_MODE == TOY_WRONG_ABI || TOY_MODE == TOY_WRONG_FINGERPRINT || TOY_MODE == TOY_NULL_CREATE || \
    TOY_MODE == TOY_UNKNOWN_KIND
// Written by hand: TESSERA_PLUGIN cannot produce these mistakes.
namespace {
const tessera::sdk::PluginEntry toy_entries[] = {
#if TOY_MODE == TOY_NULL_CREATE
    {TOY_NAME, "broken", nullptr, nullptr},
#else
    tessera::sdk::plugin_entry<Toy>(TOY_NAME, "broken"),
#endif
};
const tessera::sdk::PluginDescriptor toy_descriptor = {
#if TOY_MODE == TOY_WRONG_ABI
    tessera::sdk::kAbiMajor + 1,
#else
    tessera::sdk::kAbiMajor,
#endif
    0,
    sizeof(tessera::sdk::PluginDescriptor),
#if TOY_MODE == TOY_UNKNOWN_KIND
    static_cast<tessera::sdk::PluginKind>(99),  // a kind from a newer SDK, or garbage
#else
    tessera::sdk::PluginKind::model,
#endif
    "0.0.1",
#if TOY_MODE == TOY_WRONG_FINGERPRINT
    tessera::sdk::BuildFingerprint{__VERSION__, TESSERA_CXX11_ABI, "0.1.0", TESSERA_WITH_CUDA},
#else
    TESSERA_BUILD_FINGERPRINT,
#endif
    toy_entries,
    1,
    TESSERA_VERSION};
const tessera::sdk::PluginDescriptor* toy_get_descriptor() { return &toy_descriptor; }
}  // namespace
BOOST_DLL_ALIAS(toy_get_descriptor, tessera_plugin)
#elif TOY_MODE == TOY_OLD_DESCRIPTOR || TOY_MODE == TOY_SHORT_DESCRIPTOR
// A descriptor as an older header of this ABI major wrote it: the base fields only, followed
// in memory by a decoy where the appended sdk_version would be. The host must not read it.
namespace {
struct OldDescriptor {
  std::uint32_t abi_major;
  std::uint32_t abi_minor;
  std::uint32_t struct_size;
  tessera::sdk::PluginKind kind;
  const char* version;
  tessera::sdk::BuildFingerprint fingerprint;
  const tessera::sdk::PluginEntry* entries;
  std::uint32_t num_entries;
};
static_assert(sizeof(OldDescriptor) == offsetof(tessera::sdk::PluginDescriptor, sdk_version));
struct OldDescriptorThenDecoy {
  OldDescriptor descriptor;
  const char* decoy;
};
const tessera::sdk::PluginEntry toy_entries[] = {tessera::sdk::plugin_entry<Toy>(TOY_NAME, "an older descriptor")};
const OldDescriptorThenDecoy toy_descriptor = {
    {tessera::sdk::kAbiMajor, 0,
#if TOY_MODE == TOY_SHORT_DESCRIPTOR
     static_cast<std::uint32_t>(offsetof(OldDescriptor, num_entries)),  // cut before num_entries
#else
     static_cast<std::uint32_t>(sizeof(OldDescriptor)),
#endif
     tessera::sdk::PluginKind::model, "0.0.1", TESSERA_BUILD_FINGERPRINT, toy_entries, 1},
    "decoy: read past struct_size"};
const tessera::sdk::PluginDescriptor* toy_get_descriptor() {
  return reinterpret_cast<const tessera::sdk::PluginDescriptor*>(&toy_descriptor.descriptor);
}
}  // namespace
BOOST_DLL_ALIAS(toy_get_descriptor, tessera_plugin)
#else
TESSERA_PLUGIN(model, "0.0.1", tessera::sdk::plugin_entry<Toy>(TOY_NAME, "a toy model plugin for the loader tests"),
               tessera::sdk::plugin_entry<Toy>(TOY_NAME "_alias", "a second entry of the same library"));
#endif
