// One source, compiled into several deliberately good and broken plugins (see CMakeLists.txt):
// TOY_MODE selects what is wrong with the resulting library.
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/plugin.hpp"

#define TOY_GOOD 0
#define TOY_NO_ENTRY 1
#define TOY_WRONG_ABI 2
#define TOY_WRONG_FINGERPRINT 3
#define TOY_THROWING_FACTORY 4
#define TOY_NULL_CREATE 5

namespace {

/// The object the toy plugin creates: remembers its option and counts live instances.
class Toy final : public tessera::sdk::PluginObject {
 public:
  explicit Toy(const tessera::sdk::Options& options) : greeting_(options.get_string("greeting", "hello")) {
#if TOY_MODE == TOY_THROWING_FACTORY
    TESSERA_FAIL("toy factory refuses: [model] greeting = \"", greeting_, "\"");
#endif
  }
  const std::string& greeting() const { return greeting_; }

 private:
  std::string greeting_;
};

}  // namespace

#if TOY_MODE == TOY_NO_ENTRY
extern "C" __attribute__((visibility("default"))) int toy_not_a_plugin() { return 42; }
#elif TOY_MODE == TOY_WRONG_ABI || TOY_MODE == TOY_WRONG_FINGERPRINT || TOY_MODE == TOY_NULL_CREATE
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
    tessera::sdk::PluginKind::model,
    "0.0.1",
#if TOY_MODE == TOY_WRONG_FINGERPRINT
    tessera::sdk::BuildFingerprint{__VERSION__, TESSERA_CXX11_ABI, "0.1.0", TESSERA_WITH_CUDA},
#else
    TESSERA_BUILD_FINGERPRINT,
#endif
    toy_entries,
    1};
const tessera::sdk::PluginDescriptor* toy_get_descriptor() { return &toy_descriptor; }
}  // namespace
BOOST_DLL_ALIAS(toy_get_descriptor, tessera_plugin)
#else
TESSERA_PLUGIN(model, "0.0.1", tessera::sdk::plugin_entry<Toy>(TOY_NAME, "a toy model plugin for the loader tests"),
               tessera::sdk::plugin_entry<Toy>(TOY_NAME "_alias", "a second entry of the same library"));
#endif
