// The `tessera` command line: fit | validate | test | predict | plugins.
#include <unistd.h>

#include <chrono>
#include <ctime>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "checkpoint_tool.hpp"
#include "config.hpp"
#include "launcher.hpp"
#include "run_log.hpp"
#include "tessera/core/plugin_loader.hpp"
#include "tessera/sdk/error.hpp"
#include "trainer.hpp"

namespace {

using namespace tessera;

constexpr const char* kUsage = R"(usage:
  tessera fit|validate|test|predict --config FILE.toml [--set section.key=value ...] [--ckpt-path last|PATH]
  tessera plugins [--config FILE.toml]
  tessera checkpoint inspect|verify|export PATH [--to FILE.safetensors|FILE.ckpt]
  tessera --help | --version

  fit        train (resume with --ckpt-path last or a .ckpt path)
  validate   run the validation loop (weights from --ckpt-path)
  test       run the test loop (weights from --ckpt-path)
  predict    run predict_step and print its output (e.g. text generated from [data] prompt)
  plugins    list every plugin found: kind, name, version, ABI, path (and refused files)

  --set section.key=value overrides the config; values are TOML (numbers, true/false,
  "strings", [lists]); a bare word is a string. Example:
    tessera fit --config configs/gpt-fortunes.toml --set trainer.max_steps=50 --set launch.devices=2
)";

struct Arguments {
  std::string command, config, ckpt_path;
  std::vector<std::string> overrides;
};

Arguments parse(int argc, char** argv) {
  Arguments args;
  std::vector<std::string> words(argv + 1, argv + argc);
  const std::vector<std::string> commands = {"fit", "validate", "test", "predict", "plugins"};
  for (std::size_t i = 0; i < words.size(); ++i) {
    const std::string& w = words[i];
    auto value = [&](const std::string& flag) -> std::string {
      auto eq = w.find('=');
      if (eq != std::string::npos) return w.substr(eq + 1);
      TESSERA_CHECK(i + 1 < words.size(), flag, " needs a value");
      return words[++i];
    };
    if (w == "--config" || w.rfind("--config=", 0) == 0) args.config = value("--config");
    else if (w == "--set" || w.rfind("--set=", 0) == 0) args.overrides.push_back(value("--set"));
    else if (w == "--ckpt-path" || w.rfind("--ckpt-path=", 0) == 0) args.ckpt_path = value("--ckpt-path");
    else if (args.command.empty() && w.rfind("-", 0) != 0) {
      TESSERA_CHECK(std::find(commands.begin(), commands.end(), w) != commands.end(), "unknown command '", w, "'",
                    sdk::did_you_mean(w, commands), "; valid: ", sdk::join(commands));
      args.command = w;
    } else {
      TESSERA_FAIL("unexpected argument '", w, "'",
                   sdk::did_you_mean(w, {"--config", "--set", "--ckpt-path", "--help", "--version"}));
    }
  }
  TESSERA_CHECK(!args.command.empty(), "no command given");
  TESSERA_CHECK(args.command == "plugins" || !args.config.empty(), args.command, " needs --config FILE.toml");
  return args;
}

int list_plugins(const std::vector<std::string>& config_dirs) {
  core::PluginLoader loader(core::PluginLoader::search_path(config_dirs));
  std::printf("%-14s %-20s %-9s %-5s %s\n", "KIND", "NAME", "VERSION", "ABI", "PATH");
  for (const auto& p : loader.plugins())
    std::printf("%-14s %-20s %-9s %u.%-3u %s\n", sdk::to_string(p.kind), p.name.c_str(), p.version.c_str(),
                p.abi_major, p.abi_minor, p.path.c_str());
  for (const auto& r : loader.rejected()) std::printf("refused %s: %s\n", r.path.c_str(), r.reason.c_str());
  return 0;
}

/// Creates (and drops) every configured plugin, so configuration errors stop the launcher
/// before it starts any rank.
void check_plugins(const host::Config& config) {
  core::PluginLoader loader(core::PluginLoader::search_path(config.plugin_dirs));
  const sdk::PluginKind kinds[] = {sdk::PluginKind::strategy, sdk::PluginKind::precision,
                                   sdk::PluginKind::checkpoint_io, sdk::PluginKind::model, sdk::PluginKind::data};
  for (std::size_t i = 0; i < host::kPluginSections.size(); ++i) {
    const std::string& section = host::kPluginSections[i];
    const sdk::Options& options = config.plugins.at(section);
    loader.create(kinds[i], config.plugin_names.at(section), options);
    options.check_all_used({"plugin"});
  }
  host::make_callbacks(config, loader);
}

/// torchrun reports the root cause from this file (TORCHELASTIC_ERROR_FILE).
void write_torchelastic_error(const std::string& message) {
  const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
  if (path == nullptr) return;
  std::string escaped;
  for (char c : message) {
    if (c == '"' || c == '\\') escaped += '\\';
    if (c == '\n') escaped += "\\n";
    else escaped += c;
  }
  std::ofstream(path) << "{\"message\": {\"message\": \"" << escaped << "\", \"extraInfo\": {\"py_callstack\": \"\", "
                      << "\"timestamp\": \"" << std::time(nullptr) << "\"}}}\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "checkpoint") return host::checkpoint_tool(argc - 1, argv + 1);
  Arguments args;
  try {
    for (int i = 1; i < argc; ++i) {
      std::string w = argv[i];
      if (w == "--help" || w == "-h") return std::cout << kUsage, 0;
      if (w == "--version") return std::cout << "tessera " << TESSERA_VERSION << " (SDK ABI " << sdk::kAbiMajor << "."
                                             << sdk::kAbiMinor << ", " << core::describe(core::host_fingerprint())
                                             << ")\n", 0;
    }
    args = parse(argc, argv);
  } catch (const sdk::Error& e) {
    std::cerr << "tessera: " << e.what() << "\n\n" << kUsage;
    return 2;
  }

  std::unique_ptr<host::RunLog> log;
  try {
    if (args.command == "plugins") {
      std::vector<std::string> dirs;
      if (!args.config.empty()) dirs = host::Config::load(args.config, args.overrides).plugin_dirs;
      return list_plugins(dirs);
    }
    host::Config config = host::Config::load(args.config, args.overrides);
    const std::string root = config.trainer.default_root_dir;
    sdk::ClusterInfo cluster;
    if (std::getenv("TESSERA_LAUNCHED") == nullptr && config.launch.devices * config.launch.nodes > 1) {
      check_plugins(config);
      host::Trainer::resolve_checkpoint(config, args.ckpt_path);  // a missing checkpoint stops us before any rank
    }
    if (auto code = host::launch_or_join(config.launch, root + "/logs", argc, argv, cluster)) return *code;
    host::configure_threads(config.launch, cluster);
    log = std::make_unique<host::RunLog>(root, cluster.global_rank, config.trainer.enable_progress_bar);
    host::Trainer trainer(std::move(config), cluster, *log);
    if (args.command == "fit") trainer.fit(args.ckpt_path);
    else if (args.command == "validate") trainer.validate(args.ckpt_path);
    else if (args.command == "test") trainer.test(args.ckpt_path);
    else trainer.predict(args.ckpt_path);
    return trainer.exit_code();
  } catch (const std::exception& e) {
    // LibTorch's errors carry a C++ stack trace that says nothing to a user: the message only.
    auto* torch_error = dynamic_cast<const c10::Error*>(&e);
    std::string message = torch_error ? torch_error->what_without_backtrace() : e.what();
    // Under tessera's own launcher stderr already lands in this rank's log file.
    if (log && std::getenv("TESSERA_LAUNCHED") == nullptr) log->to_file("error: " + message);
    std::cerr << "tessera: error: " << message << "\n";
    write_torchelastic_error(message);
    return 1;
  }
}
