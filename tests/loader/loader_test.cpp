#include <dlfcn.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "plugin_loader.hpp"
#include "errors.hpp"
#include "multiprocess.hpp"
#include "tessera/sdk/toml_options.hpp"

namespace {

using tessera::core::PluginLoader;
using tessera::sdk::Options;
using tessera::sdk::PluginKind;
namespace fs = std::filesystem;

fs::path toy_dir(const std::string& mode) { return fs::path(TOY_DIR) / mode; }
fs::path toy_file(const std::string& mode) { return toy_dir(mode) / ("libtoy_" + mode + ".so"); }

using tessera::testing::error_of;

bool is_loaded(const fs::path& file) {
  void* handle = dlopen(file.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (handle == nullptr) return false;
  dlclose(handle);  // RTLD_NOLOAD still takes a reference
  return true;
}

Options toml_options(const std::string& text) {
  return tessera::sdk::make_options("model", "test.toml", toml::parse(text));
}

TEST(PluginLoader, ListsEveryEntryOfAGoodPlugin) {
  PluginLoader loader({toy_dir("good")});
  const auto& plugins = loader.plugins();
  ASSERT_EQ(plugins.size(), 2u);
  EXPECT_EQ(plugins[0].name, "toy_good");
  EXPECT_EQ(plugins[1].name, "toy_good_alias");
  EXPECT_EQ(plugins[0].kind, PluginKind::model);
  EXPECT_EQ(plugins[0].version, "0.0.1");
  EXPECT_EQ(plugins[0].abi_major, tessera::sdk::kAbiMajor);
  EXPECT_EQ(plugins[0].path, toy_file("good"));
  EXPECT_EQ(plugins[0].sdk_version, TESSERA_VERSION);
  EXPECT_TRUE(loader.rejected().empty());
}

/// A plugin built against an older header of the same ABI major has a shorter descriptor:
/// it loads, and the appended fields take their defaults (never read past struct_size).
TEST(PluginLoader, OlderDescriptorOfTheSameMajorLoads) {
  PluginLoader loader({toy_dir("old_descriptor")});
  const auto& plugins = loader.plugins();
  ASSERT_EQ(plugins.size(), 1u) << (loader.rejected().empty() ? "" : loader.rejected()[0].reason);
  EXPECT_EQ(plugins[0].name, "toy_old_descriptor");
  EXPECT_EQ(plugins[0].sdk_version, "") << "the loader read an appended field the descriptor does not have";
  auto object = loader.create(PluginKind::model, "toy_old_descriptor", Options());
  EXPECT_NE(object, nullptr);
}

TEST(PluginLoader, DescriptorShorterThanItsMajorIsRefused) {
  PluginLoader loader({});
  std::string message = error_of([&] { loader.inspect(toy_file("short_descriptor")); });
  EXPECT_NE(message.find("but every SDK ABI " + std::to_string(tessera::sdk::kAbiMajor) + " descriptor has at least " +
                         std::to_string(tessera::sdk::kDescriptorBaseSize)),
            std::string::npos)
      << message;
}

TEST(PluginLoader, CreatesWithOptionsAndRejectsUnknownKeys) {
  PluginLoader loader({toy_dir("good")});
  Options options = toml_options("plugin = 'toy_good'\ngreeting = 'hi'\ngreting = 'typo'\n");
  auto object = loader.create(PluginKind::model, "toy_good", options);
  ASSERT_NE(object, nullptr);
  std::string message = error_of([&] { options.check_all_used({"plugin"}); });
  EXPECT_NE(message.find("test.toml:3: [model] greting is not a known key"), std::string::npos) << message;
  EXPECT_NE(message.find("did you mean 'greeting'"), std::string::npos) << message;
}

TEST(PluginLoader, KeepsTheLibraryUntilTheLastObjectDies) {
  // A private copy: other tests in this process load the original with RTLD_NODELETE.
  fs::path dir = fs::temp_directory_path() / ("tessera_loader_test_" + std::to_string(getpid()));
  fs::create_directories(dir);
  fs::path copy = dir / "libtoy_good.so";
  fs::copy_file(toy_file("good"), copy, fs::copy_options::overwrite_existing);
  std::shared_ptr<tessera::sdk::PluginObject> object;
  {
    PluginLoader loader({dir}, /*never_unload=*/false);
    object = loader.create(PluginKind::model, "toy_good", Options());
  }
  // The loader is gone; the object's deleter still holds the library.
  EXPECT_TRUE(is_loaded(copy));
  object.reset();
  EXPECT_FALSE(is_loaded(copy));
  tessera::testing::remove_dir(dir);
}

TEST(PluginLoader, NeverUnloadsInProductionMode) {
  {
    PluginLoader loader({toy_dir("good")});
    loader.create(PluginKind::model, "toy_good", Options()).reset();
  }
  EXPECT_TRUE(is_loaded(toy_file("good")));
}

TEST(PluginLoader, MissingPluginSuggestsAndListsAlternatives) {
  PluginLoader loader({toy_dir("good")});
  std::string message = error_of([&] { loader.create(PluginKind::model, "toy_god", Options()); });
  EXPECT_NE(message.find("no model plugin named 'toy_god' (did you mean 'toy_good'?)"), std::string::npos) << message;
  EXPECT_NE(message.find(toy_dir("good").string()), std::string::npos) << message;
  EXPECT_NE(message.find("Available model plugins: toy_good, toy_good_alias"), std::string::npos) << message;
}

TEST(PluginLoader, WrongKindNamesBothKinds) {
  PluginLoader loader({toy_dir("good")});
  std::string message = error_of([&] { loader.create(PluginKind::strategy, "toy_good", Options()); });
  EXPECT_NE(message.find("is a model plugin, but a strategy plugin was expected"), std::string::npos) << message;
  EXPECT_NE(message.find(toy_file("good").string()), std::string::npos) << message;
}

TEST(PluginLoader, LibraryWithoutEntryPointIsRefusedBeforeLoading) {
  PluginLoader loader({}, /*never_unload=*/false);
  std::string message = error_of([&] { loader.inspect(toy_file("no_entry")); });
  EXPECT_NE(message.find(toy_file("no_entry").string() + " is not a Tessera plugin"), std::string::npos) << message;
  EXPECT_NE(message.find("TESSERA_PLUGIN"), std::string::npos) << message;
  EXPECT_FALSE(is_loaded(toy_file("no_entry")));
}

TEST(PluginLoader, AbiMismatchNamesBothVersions) {
  PluginLoader loader({});
  std::string message = error_of([&] { loader.inspect(toy_file("wrong_abi")); });
  std::string expected = "was built for SDK ABI " + std::to_string(tessera::sdk::kAbiMajor + 1) +
                         ".0, this tessera speaks " + std::to_string(tessera::sdk::kAbiMajor);
  EXPECT_NE(message.find(expected), std::string::npos) << message;
  EXPECT_NE(message.find(toy_file("wrong_abi").string()), std::string::npos) << message;
  EXPECT_NE(message.find("find_package(TesseraSDK " + std::to_string(tessera::sdk::kAbiMajor) + ")"), std::string::npos)
      << message;
}

TEST(PluginLoader, FingerprintMismatchNamesBothBuilds) {
  PluginLoader loader({});
  std::string message = error_of([&] { loader.inspect(toy_file("wrong_fingerprint")); });
  EXPECT_NE(message.find("LibTorch 0.1.0"), std::string::npos) << message;
  EXPECT_NE(message.find(std::string("LibTorch ") + TORCH_VERSION), std::string::npos) << message;
  EXPECT_NE(message.find(std::string("(against Tessera SDK ") + TESSERA_VERSION + ")"), std::string::npos) << message;
}

TEST(PluginLoader, NullFunctionsAreRefused) {
  PluginLoader loader({});
  std::string message = error_of([&] { loader.inspect(toy_file("null_create")); });
  EXPECT_NE(message.find("null name, create or destroy"), std::string::npos) << message;
}

TEST(PluginLoader, FactoryErrorsReachTheHostAsSdkErrors) {
  PluginLoader loader({toy_dir("throwing_factory")});
  Options options = toml_options("greeting = 'boom'\n");
  std::string message = error_of([&] { loader.create(PluginKind::model, "toy_throwing_factory", options); });
  EXPECT_NE(message.find("toy factory refuses: [model] greeting = \"boom\""), std::string::npos) << message;
}

TEST(PluginLoader, BrokenLibrariesAreReportedNextToGoodOnes) {
  PluginLoader loader({toy_dir("good"), toy_dir("no_entry"), toy_dir("wrong_abi"), toy_dir("wrong_fingerprint")});
  EXPECT_EQ(loader.plugins().size(), 2u);
  ASSERT_EQ(loader.rejected().size(), 3u);
  std::string message = error_of([&] { loader.create(PluginKind::model, "toy_wrong_abi", Options()); });
  EXPECT_NE(message.find("refused " + toy_file("wrong_abi").string()), std::string::npos) << message;
}

// Every library in the plugin path is scanned in a child process: one whose static constructor
// aborts, or hangs, is named and skipped; the good one beside it still works, and the host
// (this test process) lives on. Neither is ever loaded here.
TEST(PluginLoader, ACrashingOrHangingLibraryIsNamedAndSkipped) {
  setenv("TESSERA_PLUGIN_SCAN_TIMEOUT_S", "3", 1);
  PluginLoader loader({toy_dir("aborting_constructor"), toy_dir("hanging_constructor"), toy_dir("good")});
  const auto& plugins = loader.plugins();
  unsetenv("TESSERA_PLUGIN_SCAN_TIMEOUT_S");
  ASSERT_EQ(plugins.size(), 2u);
  EXPECT_EQ(plugins[0].name, "toy_good");
  ASSERT_EQ(loader.rejected().size(), 2u);
  EXPECT_EQ(loader.rejected()[0].path, toy_file("aborting_constructor"));
  EXPECT_NE(loader.rejected()[0].reason.find("crashed while being loaded (killed by signal 6 (Aborted)"),
            std::string::npos) << loader.rejected()[0].reason;
  EXPECT_NE(loader.rejected()[0].reason.find("it printed: toy: aborting in a static constructor"), std::string::npos)
      << loader.rejected()[0].reason;
  EXPECT_EQ(loader.rejected()[1].path, toy_file("hanging_constructor"));
  EXPECT_NE(loader.rejected()[1].reason.find("did not finish loading within 3 s"), std::string::npos)
      << loader.rejected()[1].reason;
  EXPECT_FALSE(is_loaded(toy_file("aborting_constructor")));
  EXPECT_FALSE(is_loaded(toy_file("hanging_constructor")));
  EXPECT_NE(loader.create(PluginKind::model, "toy_good", Options()), nullptr);
  std::string message = error_of([&] { loader.create(PluginKind::model, "toy_aborting_constructor", Options()); });
  EXPECT_NE(message.find("refused " + toy_file("aborting_constructor").string() + ": "), std::string::npos) << message;
}

// A factory that throws what is not a std::exception: caught at the boundary, named.
TEST(PluginLoader, AFactoryThrowingAnIntIsReportedWithThePluginsName) {
  PluginLoader loader({toy_dir("int_factory")});
  std::string message = error_of([&] { loader.create(PluginKind::model, "toy_int_factory", Options()); });
  EXPECT_NE(message.find("model plugin 'toy_int_factory' (" + toy_file("int_factory").string() +
                         ") failed while creating its object: an exception of type 'int'"),
            std::string::npos)
      << message;
}

// What the dynamic linker says (not Boost.DLL's "Bad file descriptor"), and a kind this tessera
// does not know (not "is a unknown plugin").
TEST(PluginLoader, AnUndefinedSymbolAndAnUnknownKindAreNamed) {
  PluginLoader loader({});
  std::string message = error_of([&] { loader.inspect(toy_file("undefined_symbol")); });
  EXPECT_NE(message.find("cannot load plugin " + toy_file("undefined_symbol").string() + ": "), std::string::npos)
      << message;
  EXPECT_NE(message.find("undefined symbol: tessera_toy_defined_nowhere"), std::string::npos) << message;
  EXPECT_NE(message.find("rebuild it against this tessera's SDK"), std::string::npos) << message;
  message = error_of([&] { loader.inspect(toy_file("unknown_kind")); });
  EXPECT_NE(message.find("declares kind 99, which this tessera does not know"), std::string::npos) << message;
}

TEST(PluginLoader, SearchPathOrderIsConfigThenEnvironmentThenDefault) {
  setenv("TESSERA_PLUGIN_PATH", "/env/a:/env/b", 1);
  auto dirs = PluginLoader::search_path({"/config"});
  unsetenv("TESSERA_PLUGIN_PATH");
  ASSERT_GE(dirs.size(), 4u);
  EXPECT_EQ(dirs[0], "/config");
  EXPECT_EQ(dirs[1], "/env/a");
  EXPECT_EQ(dirs[2], "/env/b");
}

}  // namespace
