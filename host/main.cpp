// The `tessera` command line: fit | validate | test | predict | lr-find | plan | config | plugins | checkpoint | tokenizer
// | data | report.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "cli/checkpoint_tool.hpp"
#include "cli/config_reference.hpp"
#include "cli/data_tool.hpp"
#include "compose/plugin_set.hpp"
#include "cli/tokenizer_tool.hpp"
#include "cli/trained_data.hpp"
#include "config/config.hpp"
#include "launch/launcher.hpp"
#include "loggers/run_directory.hpp"
#include "loggers/run_log.hpp"
#include "plan/plan_job.hpp"
#include "report/report.hpp"
#include "tessera/core/checkpoint_folder.hpp"
#include "tessera/core/comm.hpp"
#include "plugin_loader.hpp"
#include "tessera/sdk/data.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/strategy_checks.hpp"
#include "train/allocator.hpp"
#include "train/trainer.hpp"
#include "train/worker_threads.hpp"

namespace {

using namespace tessera;

constexpr const char* kUsage = R"(usage:
  tessera fit|validate|test|predict --config FILE.toml [--set section.key=value | --unset section.key ...]
                                    [--ckpt-path last|best|auto|PATH]
  tessera predict --config FILE.toml --messages CONVERSATION.json   (a chat reply, [data] prompt_messages)
  tessera lr-find --config FILE.toml [--set section.key=value | --unset section.key ...]
  tessera plan --config FILE.toml [--set section.key=value | --unset section.key ...] [--json]
  tessera config --config FILE.toml [--set section.key=value | --unset section.key ...]
  tessera config --reference [--config FILE.toml]
  tessera plugins [--config FILE.toml]
  tessera checkpoint inspect|verify|export PATH [--to FILE.safetensors|FILE.ckpt]
  tessera tokenizer train|encode|decode|info|bench|chat ...   (tessera tokenizer --help)
  tessera data prepare --tokenizer T --input FILES|DIRS|GLOBS --output DIR [...]   (data prepare --help)
  tessera report RUN_DIR [--out FILE.html]   one HTML page of a run's curves, memory and config
  tessera --help | --version

  fit        train (resume with --ckpt-path last or a .ckpt path; start from another run's weights
             with [trainer] init_from)
  validate   run the validation loop (weights from --ckpt-path, or [trainer] init_from)
  test       run the test loop (weights from --ckpt-path, or [trainer] init_from)
  predict    run predict_step and print its output (e.g. text generated from [data] prompt)
  lr-find    the learning-rate range test: train while the lr rises over [lr_find] min_lr..max_lr,
             write lr_find.csv and suggest a learning rate (saves nothing)
  plan       print each rank's memory budget, the bytes it sends per step and the largest batch
             that fits, without training
             (fit prints a warning before any work when the plan exceeds the machine's memory)
  config     print the configuration as tessera reads it: every key of the host and of the selected
             plugins, the defaults commented out, each with its doc; with --reference every key of
             the host and of every plugin found, as Markdown (docs/configuration-reference.md)
  plugins    list every plugin found: kind, name, version, ABI, path (and refused files)

  --set section.key=value overrides the config; values are TOML (numbers, true/false,
  "strings", [lists]); a bare word is a string. Example:
    tessera fit --config configs/gpt-fortunes.toml --set trainer.max_steps=50 --set launch.devices=2
  --unset section.key removes a key of the config, --unset section a whole section; --set and
  --unset apply in the order given. Switching a shipped config's strategy, e.g.:
    tessera fit --config configs/llama-tokens.toml --unset strategy --set strategy.plugin=ddp
)";

struct Arguments {
  std::string command, config, ckpt_path;
  std::vector<std::string> overrides;
  bool json = false;
  bool messages = false;  // --messages given
  bool reference = false;  ///< tessera config --reference
};

Arguments parse(int argc, char** argv) {
  Arguments args;
  std::vector<std::string> words(argv + 1, argv + argc);
  const std::vector<std::string> commands = {"fit", "validate", "test", "predict", "lr-find", "plan", "config", "plugins"};
  for (std::size_t i = 0; i < words.size(); ++i) {
    const std::string& w = words[i];
    auto value = [&](const std::string& flag) -> std::string {
      auto eq = w.find('=');
      if (eq != std::string::npos) return w.substr(eq + 1);
      TESSERA_CHECK(i + 1 < words.size(), flag, " needs a value");
      return words[++i];
    };
    if (w == "--config" || w.rfind("--config=", 0) == 0) args.config = value("--config");
    else if (w == "--set" || w.rfind("--set=", 0) == 0) {
      std::string assignment = value("--set");
      TESSERA_CHECK(!host::is_unset(assignment), "--set ", assignment, ": expected section.key=value");
      args.overrides.push_back(std::move(assignment));
    } else if (w == "--unset" || w.rfind("--unset=", 0) == 0) {
      const std::string name = value("--unset");
      TESSERA_CHECK(!name.empty() && name.find('=') == std::string::npos, "--unset ", name,
                    ": expected section.key (or a whole section), without a value, e.g. --unset ",
                    "strategy.activation_checkpointing or --unset strategy");
      args.overrides.push_back(host::kUnsetPrefix + name);
    }
    else if (w == "--ckpt-path" || w.rfind("--ckpt-path=", 0) == 0) args.ckpt_path = value("--ckpt-path");
    else if (w == "--messages" || w.rfind("--messages=", 0) == 0) {
      // The conversation predict answers: [data] prompt_messages, set from the command line.
      args.messages = true;
      args.overrides.push_back("data.prompt_messages=" + nlohmann::json(value("--messages")).dump());
    } else if (w == "--json") args.json = true;
    else if (w == "--reference") args.reference = true;
    else if (args.command.empty() && w.rfind("-", 0) != 0) {
      TESSERA_CHECK(std::find(commands.begin(), commands.end(), w) != commands.end(), "unknown command '", w, "'",
                    sdk::did_you_mean(w, commands), "; valid: ", sdk::join(commands));
      args.command = w;
    } else {
      TESSERA_FAIL(
          "unexpected argument '", w, "'",
          sdk::did_you_mean(w, {"--config", "--set", "--unset", "--ckpt-path", "--messages", "--json", "--reference",
                                  "--help", "--version"}));
    }
  }
  TESSERA_CHECK(!args.command.empty(), "no command given");
  TESSERA_CHECK(!args.reference || args.command == "config", "--reference applies to `tessera config` only");
  TESSERA_CHECK(args.command == "plugins" || args.reference || !args.config.empty(), args.command,
                " needs --config FILE.toml");
  TESSERA_CHECK(!args.json || args.command == "plan", "--json applies to `tessera plan` only");
  TESSERA_CHECK(!args.messages || args.command == "predict", "--messages applies to `tessera predict` only");
  const bool reads_checkpoint = args.command == "fit" || args.command == "validate" || args.command == "test" ||
                                args.command == "predict";
  TESSERA_CHECK(args.ckpt_path.empty() || reads_checkpoint, "--ckpt-path does not apply to `tessera ", args.command, "`",
                args.command == "lr-find" ? ": to test learning rates from a checkpoint's weights, set [trainer] init_from"
                                          : "");
  return args;
}

/// For a configuration error that names a [section] without naming the --set that changed it
/// (a check across keys, e.g. n_embd % n_head, blames the file's key): the overrides of that section.
std::string overrides_note(const std::string& message, const std::vector<std::string>& overrides) {
  std::string note;
  if (message.find("--set ") != std::string::npos || message.find(host::kUnsetPrefix) != std::string::npos) return "";
  for (const std::string& assignment : overrides) {
    const bool unset = host::is_unset(assignment);
    const std::string name = unset ? assignment.substr(std::string(host::kUnsetPrefix).size()) : assignment;
    const std::string section = name.substr(0, name.find_first_of(".="));
    if (message.find("[" + section + "]") == std::string::npos && message.find("[" + section + ".") == std::string::npos)
      continue;
    note += (note.empty() ? "" : ", ") + (unset ? assignment : "--set " + assignment);
  }
  return note.empty() ? "" : "\n  (the config as changed by " + note + ")";
}

int list_plugins(const std::vector<std::string>& config_dirs) {
  core::PluginLoader loader(core::PluginLoader::search_path(config_dirs));
  std::printf("%-14s %-20s %-9s %-5s %s\n", "KIND", "NAME", "VERSION", "ABI", "PATH");
  for (const auto& p : loader.plugins())
    std::printf("%-14s %-20s %-9s %u.%-3u %s\n", sdk::to_string(p.kind), p.name.c_str(), p.version.c_str(),
                p.abi_major, p.abi_minor, p.path.c_str());
  for (const auto& r : loader.rejected()) std::printf("refused %s: %s\n", r.path.c_str(), r.reason.c_str());
  for (const auto& r : loader.skipped_dirs())
    std::printf("skipped directory %s: %s\n", r.path.c_str(), r.reason.c_str());
  return 0;
}

/// A Hugging Face model's context ([model] max_position_embeddings, from its config.json or the
/// TOML) against the data's sequence length: positions past it were never trained (and rotary
/// scaling is computed for it), so a longer block_size is refused before any work.
void check_positions(const host::Config& config, const sdk::Checkpoint& model_hparams, std::int64_t length,
                     const std::string& source) {
  if (!model_hparams.contains("hf_config_json") || !model_hparams.at("hf_config_json").isString()) return;
  nlohmann::json hf;
  try {
    hf = nlohmann::json::parse(model_hparams.at("hf_config_json").toStringRef());
  } catch (const std::exception&) {
    return;  // the model's own checks speak for its config.json
  }
  if (!hf.is_object() || !hf.contains("max_position_embeddings") || !hf.at("max_position_embeddings").is_number_integer())
    return;
  const std::int64_t context = hf.at("max_position_embeddings").get<std::int64_t>();
  if (length <= context) return;
  const sdk::Options& model = config.plugins.at("model");
  const std::string key =
      model.has("max_position_embeddings")
          ? model.locate("max_position_embeddings") + " = " + std::to_string(context)
      : model.has("config") ? "\"" + model.get_string("config", "") + "\": max_position_embeddings = " +
                                  std::to_string(context) + " (the config.json of " + model.locate("config") + ")"
                            : "[model] max_position_embeddings = " + std::to_string(context) + " (the model's default)";
  TESSERA_FAIL(source, " = ", length, " is longer than the model's context, ", key,
               ": positions past it were never trained. Set [data] block_size to at most ", context,
               " (or, for a model meant for longer sequences, [model] max_position_embeddings to at least ", length, ")");
}

/// Creates (and drops) every configured plugin, so configuration errors stop the launcher
/// before it starts any rank. `predicts`: the job runs predict (the predict command, or fit with
/// predict_after_fit), so what the data needs for it (a prompt, a tokenizer) is checked too.
void check_plugins(const host::Config& config, const std::string& predicts = "") {
  core::PluginLoader loader(core::PluginLoader::search_path(config.plugin_dirs));
  // What the strategy can check about its precision and checkpoint IO (e.g. sharded state dicts
  // need an IO that writes shards) it checks when they are connected, as composing them does.
  const host::PluginSet plugins = host::compose_plugins(loader, config);
  // The world size the strategy will get (fsdp2's mesh sizes, single_device's one process).
  if (auto* checks = dynamic_cast<sdk::StrategyChecks*>(plugins.strategy.get())) {
    const sdk::ClusterInfo cluster = host::planned_cluster(config.launch);
    checks->check_world_size(cluster.world_size, cluster.environment);
  }
  // The data's sequence length against the model's context, when the config states it; each rank
  // checks again on its first batch (check_data_against_model), whatever the data plugin's default.
  const sdk::Options& data = config.plugins.at("data");
  if (data.value("block_size").is<std::int64_t>()) {
    const std::int64_t length = data.get_int("block_size", 0);
    host::Trainer::check_sequence_length(config, plugins.model->hyper_parameters(), length,
                                         data.locate("block_size") + " = " + std::to_string(length));
    check_positions(config, plugins.model->hyper_parameters(), length, data.locate("block_size"));
  }
  // predict, and fit's predict_after_fit once training is done: what the data needs for it (a
  // prompt, a tokenizer) is checked now, before any rank starts (not after hours of training).
  if (!predicts.empty()) {
    try {
      plugins.data->setup("predict");
    } catch (const sdk::Error& e) {
      TESSERA_FAIL(predicts, ", but the data cannot predict: ", e.what());
    }
  }
  host::make_callbacks(config, loader);
}

/// fit, before any work: refuses the job (with the plan's table and the largest batch that
/// fits) when the memory plan of this machine's ranks exceeds what the kernel says is
/// available, or a CUDA job's device rows exceed its GPUs' memory; [trainer] skip_memory_check
/// = true makes it a warning (the user may know better). Under torchrun, Slurm or MPI only each
/// node's local rank 0 plans.
void check_memory(const host::Config& config) {
  if (host::planned_cluster(config.launch).local_rank != 0) return;
  // A CUDA job's activations are device memory, and tracing a GPU-sized model's forward on the
  // CPU would delay its start: its host rows are whole without them, its device rows are a
  // lower bound (`tessera plan` traces them). A CPU job is planned on a GPU machine too.
  const bool cuda = host::trains_on_cuda(config);
  host::PlannedJob job;
  try {
    job = host::plan_job(config, /*trace_activations=*/!cuda);
  } catch (const host::JobSetupError&) {
    throw;  // every rank would fail the same way: say it once, before any starts
  } catch (const std::exception& e) {
    std::cerr << "tessera: note: no memory plan (" << e.what() << ")\n";
    return;
  }
  const double available = host::memory_available_bytes();
  std::vector<std::string> problems;
  for (const std::string& warning :
       {host::memory_warning(job.plan, available, job.local_ranks),
        cuda ? host::device_memory_warning(job.plan, host::cuda_memory_bytes(config, job.local_ranks), false) : ""})
    if (!warning.empty()) problems.push_back(warning);
  if (problems.empty()) return;
  if (config.trainer.skip_memory_check) {
    for (const std::string& warning : problems) std::cerr << "tessera: " << warning << "\n";
    return;
  }
  // Refused before any rank starts: a rank that outgrows the machine is ended by the kernel's
  // OOM killer, after minutes, with no word from tessera.
  std::string reasons;
  for (const std::string& warning : problems)
    reasons += (reasons.empty() ? "" : "\n") + warning.substr(warning.rfind("warning: ", 0) == 0 ? 9 : 0);
  TESSERA_FAIL(reasons, "\nfit refuses a job that does not fit the machine before any rank starts; the plan (as ",
               "`tessera plan` prints it):\n", host::format_plan(job.plan, job.world_size, job.local_ranks),
               "to start it anyway, set [trainer] skip_memory_check = true");
}

/// Local ranks beyond what the host can run: each rank is a process with at least one thread,
/// and ranks that share a core train in turn; more than kRanksPerCore per core is a typo (devices
/// = 1024), refused before a thousand processes start.
void check_local_ranks(const host::Config& config) {
  constexpr std::int64_t kRanksPerCore = 4;
  if (host::planned_cluster(config.launch).environment != "local") return;
  const std::int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  const std::string key = config.launch.devices_key.empty() ? "[launch] devices" : config.launch.devices_key;
  TESSERA_CHECK(config.launch.devices <= kRanksPerCore * cores, key, " = ", config.launch.devices,
                " local ranks, but this host has ", cores, " core(s): at most ", kRanksPerCore * cores, " (",
                kRanksPerCore, " per core) start here; set devices to at most that, or spread the job over more ",
                "nodes ([launch] nodes)");
}

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    if (c == '"' || c == '\\') out += '\\', out += static_cast<char>(c);
    else if (c == '\n') out += "\\n";
    else if (c < 0x20) {
      char buffer[8];
      std::snprintf(buffer, sizeof(buffer), "\\u%04x", c);
      out += buffer;
    } else out += static_cast<char>(c);
  }
  return out + "\"";
}

/// torchrun's error file, in the layout its ChildFailedError reads; the message also goes in
/// extraInfo.py_callstack, which torchrun shows in preference to it. `exclusive`: only if no
/// file exists yet (a report written for a rank that died without one).
void write_error_file(const std::string& path, const std::string& message, std::int64_t timestamp_s,
                      bool exclusive) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | (exclusive ? O_EXCL : O_TRUNC) | O_CLOEXEC, 0644);
  if (fd < 0) return;
  std::string json = "{\"message\": {\"message\": " + json_string(message) + ", \"extraInfo\": {\"py_callstack\": " +
                     json_string(message) + ", \"timestamp\": \"" + std::to_string(timestamp_s) + "\"}}}\n";
  ssize_t written = ::write(fd, json.data(), json.size());
  (void)written;
  ::close(fd);
}

/// Records this rank's failure for the launcher and torchrun. torchrun blames the error file
/// with the smallest timestamp (whole seconds): a consequence of another rank's failure is
/// stamped strictly after it, and a root cause that died without a report (killed, or gone
/// silent) gets one written for it from the hang report.
void report_failure(const std::string& message) {
  core::FailureRecord record = core::report_failure(message);
  const char* error_file = std::getenv("TORCHELASTIC_ERROR_FILE");
  if (error_file == nullptr) return;
  std::int64_t stamp = record.time_ms / 1000;
  if (std::optional<core::Diagnosis> d = core::last_collective_failure(); d && record.consequence && d->root >= 0) {
    const std::int64_t root_s = d->root_time_ms / 1000;
    if (!d->root_reported && !d->root_error_file.empty())
      write_error_file(d->root_error_file,
                       d->root_summary + " (reported for it by rank " + std::to_string(record.rank) + ")", root_s,
                       /*exclusive=*/true);
    while (core::wall_ms() / 1000 <= root_s) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    stamp = std::max(stamp, core::wall_ms() / 1000);
  }
  write_error_file(error_file, message, stamp, /*exclusive=*/false);
}

/// fit, before any rank starts: what interrupted saves left anywhere under the run root (a
/// resume writes into a new run folder, so the first save's own sweep never sees the old one's),
/// only those whose writer is gone (another fit in the same root may be saving).
void remove_save_leftovers(const std::string& root) {
  const std::vector<core::Leftover> removed = core::remove_leftovers(root);
  if (removed.empty()) return;
  std::uintmax_t bytes = 0;
  std::vector<std::string> paths;
  for (const core::Leftover& leftover : removed) bytes += leftover.bytes, paths.push_back(leftover.path);
  std::cerr << "tessera: removed " << removed.size() << " leftover(s) of interrupted saves (" << bytes / 1048576.0
            << " MB) under " << root << ": " << sdk::join(paths) << "\n";
}

/// Once per job, before any rank starts: when every rank of the job starts on this host, its
/// run folder is chosen now (TESSERA_RUN_DIR) and the rank logs go to its logs/ folder
/// (TESSERA_LOG_DIR), so a requeue or a second fit in the same root never truncates or shares
/// another run's logs. Otherwise (torchrun, Slurm, mpirun, several nodes) rank 0 chooses the
/// run folder and each rank's log follows it there.
void choose_log_directory(const std::string& command, const host::Config& config) {
  ::unsetenv("TESSERA_RUN_DIR");
  ::unsetenv("TESSERA_LOG_DIR");
  const sdk::ClusterInfo planned = host::planned_cluster(config.launch);
  if (config.launch.nodes != 1 || (planned.environment != "single" && planned.environment != "local")) return;
  const std::string& root = config.trainer.default_root_dir;
  if (command == "predict") {
    ::setenv("TESSERA_LOG_DIR", host::job_log_directory(root, command).c_str(), 1);
    return;
  }
  const std::string run = host::create_job_run_directory(root, config.logger);
  ::setenv("TESSERA_RUN_DIR", run.c_str(), 1);
  ::setenv("TESSERA_LOG_DIR", (run + "/logs").c_str(), 1);
}

int run(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "checkpoint") return host::checkpoint_tool(argc - 1, argv + 1);
  if (argc > 1 && std::string(argv[1]) == "tokenizer") return host::tokenizer_tool(argc - 1, argv + 1);
  if (argc > 1 && std::string(argv[1]) == "data") return host::data_tool(argc - 1, argv + 1);
  if (argc > 1 && std::string(argv[1]) == "report") return host::report_tool(argc - 1, argv + 1);
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

  if (args.command != "plan" && args.command != "config" && args.command != "plugins")
    host::settle_worker_threads(argv);
  std::unique_ptr<host::RunLog> log;
  bool configuring = true;  // until the configuration is checked: errors may come from a --set
  try {
    if (args.command == "plugins" || args.reference) {
      std::vector<std::string> dirs;
      if (!args.config.empty()) dirs = host::Config::load(args.config, args.overrides).plugin_dirs;
      if (args.reference) return std::cout << host::configuration_reference(dirs), 0;
      return list_plugins(dirs);
    }
    host::note_defaults();  // for `tessera config` and the run folder's config.toml
    host::Config config = host::Config::load(args.config, args.overrides);
    if (args.command == "config") {
      check_plugins(config);  // each plugin notes its keys' defaults
      std::cout << host::list_config(config);
      return 0;
    }
    const std::string root = config.trainer.default_root_dir;
    sdk::ClusterInfo cluster;
    core::set_comm_settings({static_cast<double>(config.launch.rendezvous_timeout_s),
                             static_cast<double>(config.launch.checkpoint_timeout_s),
                             config.launch.shared_memory_collectives, config.launch.interface});
    // [trainer] resume = "auto": fit goes on from the newest committed checkpoint that verifies, if any.
    if (args.command == "fit" && args.ckpt_path.empty() && config.trainer.resume == "auto") args.ckpt_path = "auto";
    if (args.command == "plan") {
      check_plugins(config);
      host::PlannedJob job = host::plan_job(config);
      std::cout << (args.json ? host::plan_json(job.plan, job.world_size, job.local_ranks)
                              : host::format_plan(job.plan, job.world_size, job.local_ranks));
      return 0;
    }
    if (std::getenv("TESSERA_LAUNCHED") == nullptr) {  // once per job, before any rank starts
      // A missing checkpoint, or one fit cannot resume from, stops us here.
      std::vector<std::string> notes;
      const std::string checkpoint =
          host::Trainer::resolve_checkpoint(config, args.ckpt_path, args.command == "fit", &notes);
      for (const std::string& note : notes) std::cerr << "tessera: " << note << "\n";
      // Ranks this process forks take the choice made here rather than verifying every checkpoint again.
      if (args.ckpt_path == "auto") args.ckpt_path = checkpoint;
      if (args.command == "fit" && !checkpoint.empty()) host::Trainer::check_resumable(checkpoint);
      host::Trainer::check_weights_given(args.command, checkpoint, host::Trainer::initial_weights(config, checkpoint));
      // Weights trained on other ids than this data's (bytes against a tokenizer's, or another
      // tokenizer): the output is meaningless, so say so before it is printed.
      if (args.command == "predict" || args.command == "validate" || args.command == "test")
        if (const std::string warning = host::trained_data_warning(config, checkpoint); !warning.empty())
          std::cerr << "tessera: warning: " << warning << "\n";
      TESSERA_CHECK(args.command != "lr-find" || config.trainer.fast_dev_run == 0, "[trainer] fast_dev_run runs ",
                    "every loop for a few batches; lr-find trains [lr_find] num_training steps: remove one of them");
      check_plugins(config, args.command == "predict" ? "tessera predict generates from the data's prompt"
                            : args.command == "fit" && config.trainer.predict_after_fit
                                ? "[trainer] predict_after_fit = true samples from the model after fit"
                                : "");
      check_local_ranks(config);
      if (args.command == "fit" || args.command == "lr-find") check_memory(config);
      if (args.command == "fit") remove_save_leftovers(root);
      choose_log_directory(args.command, config);
    }
    configuring = false;
    core::set_fatal_reporter(report_failure);
    // Rank logs go to the run folder's logs/ (chosen above); a multi-node launcher captures its
    // ranks' output in a folder of its own, and they log into the run folder once it is chosen.
    const char* log_dir = std::getenv("TESSERA_LOG_DIR");
    const std::string capture = log_dir ? log_dir : host::job_log_directory(root, "node-" + std::to_string(config.launch.node_rank));
    if (auto code = host::launch_or_join(config.launch, capture, argc, argv, cluster)) return *code;
    host::configure_threads(config.launch, cluster);
    host::keep_freed_pages(/*oversize_blocks_too=*/cluster.world_size == 1);
    log = std::make_unique<host::RunLog>(log_dir ? log_dir : "", cluster.global_rank,
                                         config.trainer.enable_progress_bar);
    host::Trainer trainer(std::move(config), cluster, *log);
    if (args.command == "fit") trainer.fit(args.ckpt_path);
    else if (args.command == "validate") trainer.validate(args.ckpt_path);
    else if (args.command == "test") trainer.test(args.ckpt_path);
    else if (args.command == "lr-find") trainer.lr_find();
    else trainer.predict(args.ckpt_path);
    return trainer.exit_code();
  } catch (const std::exception& e) {
    // LibTorch's errors carry a C++ stack trace that says nothing to a user: the message only.
    auto* torch_error = dynamic_cast<const c10::Error*>(&e);
    std::string message = torch_error ? torch_error->what_without_backtrace() : e.what();
    if (configuring) message += overrides_note(message, args.overrides);
    // Under tessera's own launcher stderr already lands in this rank's log file.
    if (log && std::getenv("TESSERA_LAUNCHED") == nullptr) log->to_file("error: " + message);
    std::cerr << "tessera: error: " << message << "\n";
    report_failure(message);
    return 1;
  } catch (...) {  // only plugin code throws what is not a std::exception: never std::terminate
    const std::string message = "plugin code threw " + core::describe_current_exception() +
                                "; plugins report errors as tessera::sdk::Error (TESSERA_CHECK)";
    std::cerr << "tessera: error: " << message << "\n";
    report_failure(message);
    return 1;
  }
}

/// Whether exit must run the process's exit handlers: LeakSanitizer checks for leaks in one, and
/// jemalloc prints the statistics MALLOC_CONF's stats_print asks for in another.
bool exit_handlers_wanted() {
#if defined(__SANITIZE_ADDRESS__)
  return true;
#else
  const char* malloc_conf = std::getenv("MALLOC_CONF");
  return malloc_conf != nullptr && std::strstr(malloc_conf, "stats_print") != nullptr;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  const int code = run(argc, argv);
  // Whatever tessera writes is closed when run() returns (the trainer, run log and loggers are
  // its locals). What exit would do after that is LibTorch unregistering its ~2,000 operators one
  // by one and the plugins' statics: ~12% of a short command's CPU (callgrind), paid by every
  // command and every rank. Skipped, once the streams are flushed.
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  if (!exit_handlers_wanted()) std::_Exit(code);
  return code;
}
