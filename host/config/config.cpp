#include "config/config.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <optional>
#include <sstream>

#include "tessera/sdk/error.hpp"

namespace tessera::host {

namespace {

constexpr std::int64_t kMaxTimeoutS = 7 * 24 * 3600;
/// Optimizer values become floats in LibTorch: larger ones overflow after setup.
constexpr double kMaxFloat = 3.4e38;

/// A path-like string: no NUL (a C++ string keeps it, the OS cuts the path there), and not empty
/// unless `optional`, where the default "" means unset (`tessera config` lists it so).
std::string read_path(const sdk::Options& options, const sdk::Key& key, const std::string& fallback,
                      bool optional = false) {
  std::string value = options.get_string(key, fallback);
  TESSERA_CHECK(optional || !value.empty(), options.locate(key.name),
                " is empty: give a path (relative paths are taken from "
                "the working directory), e.g. \"",
                fallback, "\"");
  TESSERA_CHECK(value.find('\0') == std::string::npos, options.locate(key.name),
                " contains a NUL character, which no path can hold");
  return value;
}

const std::map<std::string, std::string> kDefaultPlugins = {
    {"strategy", "single_device"}, {"precision", "precision"}, {"checkpoint_io", "torch"}, {"model", "gpt"},
    {"data", "text"}};

BatchLimit read_limit(const sdk::Options& options, const sdk::Key& key, BatchLimit fallback) {
  const sdk::Value value = options.value(key.name);
  options.mark_used(key.name);
  if (fallback.fraction) options.note_key(key, fallback.value);
  else options.note_key(key, static_cast<std::int64_t>(fallback.value));
  if (value.absent()) return fallback;
  // Checked here, not through get_int / get_double, which would note the key again.
  if (value.is<std::int64_t>()) {
    const std::int64_t count = value.as<std::int64_t>();
    TESSERA_CHECK(count >= 0, options.locate(key.name), " = ", count, " is out of range [0, ",
                  std::numeric_limits<std::int64_t>::max(), "]");
    return {false, static_cast<double>(count)};
  }
  if (value.is<double>()) {
    const double fraction = value.as<double>();
    TESSERA_CHECK(fraction >= 0.0 && fraction <= 1.0, options.locate(key.name), " = ", fraction,
                  " is out of range [0, 1]");
    return {true, fraction};
  }
  TESSERA_FAIL(options.locate(key.name), " must be an integer (a number of batches, 0 skips the loop) or a float in ",
               "[0.0, 1.0] (a fraction of the batches), found ", value.type_name());
}

/// val_check_interval: an integer is a number of steps over the whole run (0: at each epoch's
/// end), a float a fraction of each epoch; check_val_every_n_epoch picks the epochs.
void read_validation_schedule(const sdk::Options& t, TrainerSettings& tr) {
  const sdk::Key key{"val_check_interval",
                     "validate every N steps over the whole run (an integer) or every fraction of an "
                     "epoch (a float in (0, 1]); default each epoch's end"};
  if (t.value("val_check_interval").is<double>()) {
    tr.val_check_fraction = t.get_double(key, 1.0, 0.0, 1.0);
    TESSERA_CHECK(tr.val_check_fraction > 0.0, t.locate("val_check_interval"), " = 0.0 is no fraction of an epoch: ",
                  "give a fraction in (0.0, 1.0] (0.25: four validations per epoch) or a number of steps");
  } else {
    tr.val_check_interval = t.get_int(key, 0, 0);
  }
  // Read only where it applies, so that tessera config lists it only there.
  if (tr.val_check_interval == 0)
    tr.check_val_every_n_epoch = t.get_int(
        {"check_val_every_n_epoch", "validate at the end of every Nth epoch (not with an integer val_check_interval)"},
        1, 1);
  TESSERA_CHECK(tr.val_check_interval == 0 || !t.has("check_val_every_n_epoch"), t.locate("val_check_interval"), " = ",
                tr.val_check_interval, " counts steps over the whole run, across epochs, so ",
                t.locate("check_val_every_n_epoch"), " cannot apply: remove one of them, or give val_check_interval ",
                "as a fraction of an epoch (e.g. 0.5)");
}

/// The name of the [callbacks.NAME] table that is a model_checkpoint (its plugin key, or its name
/// without one), if any: the user's checkpoint callback, which replaces the default one.
std::optional<std::string> model_checkpoint_callback(toml::table& root) {
  if (const toml::table* callbacks = root["callbacks"].as_table())
    for (const auto& [key, node] : *callbacks)
      if (const toml::table* table = node.as_table())
        if ((*table)["plugin"].value_or(std::string(key.str())) == "model_checkpoint") return std::string(key.str());
  return std::nullopt;
}

/// Lightning's fast_dev_run: true (one batch) or a number of batches; false or 0 is off.
std::int64_t read_fast_dev_run(const sdk::Options& t) {
  const sdk::Key key{"fast_dev_run",
                     "true or N: N steps, N batches of each evaluation, no loggers or checkpoints "
                     "(does every loop run?)"};
  const sdk::Value value = t.value("fast_dev_run");
  if (value.is<bool>()) return t.get_bool(key, false) ? 1 : 0;
  TESSERA_CHECK(value.absent() || value.is<std::int64_t>(), t.locate("fast_dev_run"),
                " must be true, false or a number of batches (e.g. 5)");
  return t.get_int(key, 0, 0);
}

/// fast_dev_run = n: n steps of one epoch, n batches of every evaluation, no sanity check, no
/// loggers, no checkpoints (Lightning's debugging run: does every loop run at all?).
void apply_fast_dev_run(TrainerSettings& tr, LoggerSettings& logger) {
  const std::int64_t n = tr.fast_dev_run;
  if (n == 0) return;
  tr.max_steps = n;
  tr.max_epochs = 1;
  tr.min_steps = tr.min_epochs = 0;
  tr.limit_train_batches = {false, static_cast<double>(n * tr.accumulate_grad_batches)};  // the epoch ends after n steps
  tr.limit_val_batches = tr.limit_test_batches = tr.limit_predict_batches = {false, static_cast<double>(n)};
  tr.val_check_interval = 0;  // one validation, at the epoch's end
  tr.val_check_fraction = 1.0;
  tr.check_val_every_n_epoch = 1;
  tr.num_sanity_val_steps = 0;
  tr.checkpoint_every_n_steps = 0;
  tr.save_last = false;
  logger.loggers.clear();
}

/// Where `node` came from, for messages: "file.toml:12", or the "--set section.key=value" that made it.
std::string where_from(const toml::node& node, const std::string& path) {
  const auto& src = node.source();
  if (src.path && *src.path != path) return *src.path;
  return path + (src.begin.line ? ":" + std::to_string(src.begin.line) : "");
}

/// Applies one --set (section.key=value, or section.table.key=value for a nested table such as
/// [callbacks.NAME] or [strategy.mp_policy]); returns the section when the file has none of that name.
std::string apply_override(toml::table& root, const std::string& assignment) {
  auto eq = assignment.find('=');
  auto dot = assignment.find('.');
  TESSERA_CHECK(eq != std::string::npos && dot != std::string::npos && dot < eq, "--set ", assignment,
                ": expected section.key=value, e.g. --set trainer.max_steps=100");
  std::vector<std::string> names;
  for (std::size_t from = 0, to; from <= eq; from = to + 1) {
    to = std::min(assignment.find('.', from), eq);
    names.push_back(assignment.substr(from, to - from));
    TESSERA_CHECK(!names.back().empty(), "--set ", assignment, ": empty name in ", assignment.substr(0, eq),
                  "; expected section.key=value, e.g. --set trainer.max_steps=100");
  }
  const std::string section = names.front(), key = names.back();
  const std::string value = assignment.substr(eq + 1);
  const bool created = root.get(section) == nullptr;
  toml::table* table = &root;
  for (std::size_t i = 0; i + 1 < names.size(); ++i) {
    if (table->get(names[i]) == nullptr) table->insert_or_assign(names[i], toml::table{});
    toml::table* inner = table->get(names[i])->as_table();
    std::string dotted = names[0];
    for (std::size_t j = 1; j <= i; ++j) dotted += "." + names[j];
    TESSERA_CHECK(inner != nullptr, "--set ", assignment, ": ", dotted, " is not a table in the config file (it is ",
                  toml::impl::node_type_friendly_names[static_cast<int>(table->get(names[i])->type())],
                  "), so it has no key ", names[i + 1]);
    table = inner;
  }
  // The value node is moved, not copied, so it keeps its source ("--set ...") for messages.
  toml::table holder;
  try {
    holder = toml::parse("v = " + value, "--set " + assignment);
  } catch (const toml::parse_error&) {
    std::ostringstream quoted;  // a bare word is a string
    quoted << toml::value<std::string>(value);
    holder = toml::parse("v = " + quoted.str(), "--set " + assignment);
  }
  table->insert_or_assign(key, std::move(*holder.get("v")));
  return created ? section : "";
}

/// Applies one --unset (section, section.key or section.table.key): removes that key or table,
/// so that a shipped config can switch plugin (`--unset strategy --set strategy.plugin=ddp`)
/// without the old plugin's keys being refused by the new one. A name the config does not hold
/// is refused (a typo would otherwise leave the key in place, unnoticed).
void apply_unset(toml::table& root, const std::string& dotted) {
  std::vector<std::string> names;
  for (std::size_t from = 0, to; from <= dotted.size(); from = to + 1) {
    to = std::min(dotted.find('.', from), dotted.size());
    names.push_back(dotted.substr(from, to - from));
    TESSERA_CHECK(!names.back().empty(), "--unset ", dotted, ": empty name; expected section or section.key, e.g. ",
                  "--unset strategy.activation_checkpointing or --unset strategy");
  }
  toml::table* table = &root;
  std::string where = "the config";
  for (std::size_t i = 0; i < names.size(); ++i) {
    toml::node* node = table->get(names[i]);
    if (node == nullptr) {
      std::vector<std::string> keys;
      for (const auto& [key, value] : *table) keys.push_back(std::string(key.str()));
      TESSERA_FAIL("--unset ", dotted, ": ", where, " has no ", i == 0 ? "section [" + names[i] + "]" : "key " + names[i],
                   sdk::did_you_mean(names[i], keys), keys.empty() ? std::string(" (it is empty)")
                                                                  : "; it holds: " + sdk::join(keys));
    }
    if (i + 1 == names.size()) {
      table->erase(names[i]);
      return;
    }
    TESSERA_CHECK(node->is_table(), "--unset ", dotted, ": ", names[i], " is not a table, so it has no key ", names[i + 1]);
    table = node->as_table();
    where = "[";
    for (std::size_t j = 0; j <= i; ++j) where += (j ? "." : "") + names[j];
    where += "]";
  }
}

}  // namespace

bool is_unset(const std::string& override_entry) { return override_entry.rfind(kUnsetPrefix, 0) == 0; }

double read_duration(const sdk::Options& options, const sdk::Key& key) {
  const sdk::Value value = options.value(key.name);
  if (value.absent() || value.is<std::int64_t>() || value.is<double>()) return options.get_double(key, 0.0, 0.0);
  std::string text = options.get_string(key, "");
  int d = 0, h = 0, m = 0, s = 0;
  char end = 0;
  TESSERA_CHECK(
      std::sscanf(text.c_str(), "%d:%d:%d:%d%c", &d, &h, &m, &s, &end) == 4 && d >= 0 && h >= 0 && h < 24 && m >= 0 &&
          m < 60 && s >= 0 && s < 60,
      options.locate(key.name), " = \"", text,
      "\" is not a duration: write \"DD:HH:MM:SS\" (e.g. \"00:12:00:00\" for 12 hours) or a number of seconds");
  return ((d * 24.0 + h) * 60.0 + m) * 60.0 + s;
}

std::int64_t BatchLimit::of(std::int64_t num_batches) const {
  if (!fraction) return std::min(num_batches, static_cast<std::int64_t>(value));
  auto count = static_cast<std::int64_t>(std::floor(static_cast<double>(num_batches) * value));
  return value > 0 ? std::clamp<std::int64_t>(count, std::min<std::int64_t>(1, num_batches), num_batches) : 0;
}

Config Config::load(const std::string& path, const std::vector<std::string>& overrides) {
  Config config;
  config.path_ = path;
  TESSERA_CHECK(std::filesystem::is_regular_file(path), "config file ", path, " does not exist");
  toml::table root;
  try {
    root = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    TESSERA_FAIL(path, ":", e.source().begin.line, ":", e.source().begin.column, ": invalid TOML: ", e.description());
  }
  std::map<std::string, std::string> set_sections;  // a section that only --set names -> that --set
  for (const auto& assignment : overrides) {
    if (is_unset(assignment)) {
      apply_unset(root, assignment.substr(std::string(kUnsetPrefix).size()));
      continue;
    }
    std::string created = apply_override(root, assignment);
    if (!created.empty()) set_sections.emplace(created, "--set " + assignment);
  }
  config.resolved = root;

  std::vector<std::string> sections = {"trainer", "optimizer", "lr_scheduler", "lr_find", "launch", "logger", "callbacks"};
  sections.insert(sections.end(), kPluginSections.begin(), kPluginSections.end());
  for (const auto& [key, node] : root) {
    std::string name(key.str());
    if (name == "plugin_dirs") continue;
    bool known = std::find(sections.begin(), sections.end(), name) != sections.end();
    std::string where = set_sections.count(name) ? set_sections.at(name) : where_from(node, path);
    if (!known && !node.is_table()) {
      std::vector<std::string> candidates = sections;
      candidates.push_back("plugin_dirs");
      TESSERA_FAIL(where, ": unknown top-level key ", name, sdk::did_you_mean(name, candidates),
                   "; the only top-level key is plugin_dirs, every other key belongs in a section (",
                   sdk::join(sections), ")");
    }
    TESSERA_CHECK(known, where, ": unknown section [", name, "]", sdk::did_you_mean(name, sections),
                  "; valid sections: ", sdk::join(sections), ", and the key plugin_dirs");
    TESSERA_CHECK(node.is_table(), where, ": ", name, " must be a table ([", name, "])");
  }
  // Each section is moved out of `root` once: a copied toml node forgets its source line.
  auto section = [&](const std::string& name) {
    toml::table* t = root[name].as_table();
    return sdk::make_options(name, path, t ? std::move(*t) : toml::table{});
  };
  if (const toml::node* dirs = root.get("plugin_dirs")) {
    auto where = [&](const toml::node& n) { return where_from(n, path); };
    TESSERA_CHECK(dirs->is_array(), where(*dirs), ": plugin_dirs must be an array of directory names, e.g. "
                  "plugin_dirs = [\"build/plugins\"]");
    for (const toml::node& d : *dirs->as_array()) {
      TESSERA_CHECK(d.is_string() && !d.value_or(std::string()).empty() &&
                        d.value_or(std::string()).find('\0') == std::string::npos,
                    where(d), ": plugin_dirs entries must be non-empty directory names (strings), found ",
                    toml::impl::node_type_friendly_names[static_cast<int>(d.type())],
                    (d.is_string() ? " (empty or with a NUL)" : ""));
      config.plugin_dirs.push_back(d.value_or(std::string()));
    }
  }

  sdk::Options t = section("trainer");
  TrainerSettings& tr = config.trainer;
  tr.max_steps = t.get_int(
      {"max_steps", "optimizer steps to train; -1: train max_epochs epochs (0 is refused: it would train nothing)"},
      tr.max_steps, -1);
  // Lightning's max_steps = 0 trains nothing and exits successfully; a run that trains nothing
  // is refused here instead, before any work (validate / test run without training).
  TESSERA_CHECK(tr.max_steps != 0, t.locate("max_steps"), " = 0 would train nothing: set the number of optimizer ",
                "steps to train, or -1 (the default) to train [trainer] max_epochs epochs; to evaluate a checkpoint ",
                "without training, run `tessera validate` or `tessera test` with --ckpt-path");
  tr.max_epochs = t.get_int({"max_epochs", "epochs to train (default 1000000 when max_steps is set)"},
                            tr.max_steps > 0 ? 1000000 : tr.max_epochs, 1);
  tr.accumulate_grad_batches =
      t.get_int({"accumulate_grad_batches", "micro-batches whose gradients add up before each optimizer step"}, 1, 1);
  tr.gradient_clip_val = t.get_double(
      {"gradient_clip_val",
       "clip gradients at this value before each optimizer step (after the grad scaler unscales); 0: no clipping"},
      0.0, 0.0, kMaxFloat);
  // Each read only where it applies, so that tessera config lists it only there.
  if (tr.gradient_clip_val > 0)
    tr.gradient_clip_algorithm = t.get_choice(
        {"gradient_clip_algorithm",
         "norm: the total norm over every rank's shards (FSDP's clip_grad_norm_); value: each element clamped"},
        "norm", {"norm", "value"});
  if (tr.gradient_clip_val > 0 && tr.gradient_clip_algorithm == "norm")
    tr.norm_type = t.get_double(
        {"norm_type", "the p of the total gradient norm (inf allowed); gradient_clip_algorithm = \"norm\" only"}, 2.0,
        1e-6, INFINITY);
  for (const char* key : {"gradient_clip_algorithm", "norm_type"})
    TESSERA_CHECK(tr.gradient_clip_val > 0 || !t.has(key), t.locate(key), " is set but nothing is clipped (",
                  t.has("gradient_clip_val") ? t.locate("gradient_clip_val") + " = 0" : "no [trainer] gradient_clip_val",
                  "): set gradient_clip_val > 0 or remove ", key);
  TESSERA_CHECK(tr.gradient_clip_algorithm == "norm" || !t.has("norm_type"), t.locate("norm_type"),
                " applies to gradient_clip_algorithm = \"norm\" only; ", t.locate("gradient_clip_algorithm"),
                " = \"value\" clamps each gradient element: remove norm_type");
  tr.min_steps = t.get_int(
      {"min_steps", "a callback's stop request (e.g. early stopping's) is held back until this many steps"}, 0, 0);
  tr.min_epochs = t.get_int({"min_epochs", "a callback's stop request is held back until this many epochs"}, 0, 0);
  TESSERA_CHECK(tr.max_steps <= 0 || tr.min_steps <= tr.max_steps, t.locate("min_steps"), " = ", tr.min_steps,
                " is more than ", t.locate("max_steps"), " = ", tr.max_steps, ": lower min_steps or raise max_steps");
  TESSERA_CHECK(tr.min_epochs <= tr.max_epochs, t.locate("min_epochs"), " = ", tr.min_epochs, " is more than ",
                t.has("max_epochs") ? t.locate("max_epochs") : "[trainer] max_epochs (default)", " = ", tr.max_epochs,
                ": lower min_epochs or raise max_epochs");
  tr.limit_train_batches =
      read_limit(t, {"limit_train_batches", "batches per epoch: an integer count or a fraction in (0, 1]"},
                 tr.limit_train_batches);
  TESSERA_CHECK(tr.limit_train_batches.of(1) > 0, t.locate("limit_train_batches"),
                " leaves no batch to train on: give a number of batches >= 1 or a fraction in (0.0, 1.0]");
  read_validation_schedule(t, tr);
  tr.num_sanity_val_steps =
      t.get_int({"num_sanity_val_steps",
                 "validation batches run before the first step, so a broken validation fails at once; -1 all"},
                tr.num_sanity_val_steps, -1);
  tr.fast_dev_run = read_fast_dev_run(t);
  tr.limit_val_batches = read_limit(
      t, {"limit_val_batches", "validation batches: a count (0 skips validation) or a fraction"}, tr.limit_val_batches);
  tr.limit_test_batches =
      read_limit(t, {"limit_test_batches", "test batches: a count or a fraction"}, tr.limit_test_batches);
  tr.predict_output =
      read_path(t, {"predict_output", "predict writes every prediction to this torch.load-able file; \"\": none"}, "",
                /*optional=*/true);
  if (!tr.predict_output.empty()) {
    std::error_code ec;
    TESSERA_CHECK(!std::filesystem::is_directory(tr.predict_output, ec), t.locate("predict_output"), " = \"",
                  tr.predict_output, "\" is a directory: give the file to write, e.g. \"", tr.predict_output,
                  "/predictions.pt\"");
    tr.limit_predict_batches = {true, 1.0};  // written predictions: the whole set unless limited
  }
  tr.limit_predict_batches = read_limit(
      t, {"limit_predict_batches", "predict batches: a count or a fraction (default 1, all with predict_output)"},
      tr.limit_predict_batches);
  tr.overfit_batches =
      read_limit(t, {"overfit_batches", "train and validate on this many batches only, unshuffled, every epoch"},
                 tr.overfit_batches);
  const bool overfit = tr.overfit_batches.value > 0;
  for (const char* key : {"limit_train_batches", "limit_val_batches"})
    TESSERA_CHECK(!overfit || !t.has(key), t.locate("overfit_batches"), " sets ", key, " too: remove ",
                  t.locate(key));
  if (overfit) tr.limit_train_batches = tr.limit_val_batches = tr.overfit_batches;
  tr.log_every_n_steps = t.get_int({"log_every_n_steps", "training metrics are logged every N optimizer steps"}, 10, 1);
  tr.seed = t.get_int({"seed", "the seed of every rank's random generators (weights, dropout, shuffling)"}, 0, 0);
  tr.default_root_dir = read_path(t, {"default_root_dir", "where runs, logs and checkpoints go"}, tr.default_root_dir);
  // The default checkpoint callback's two keys, read (and listed by tessera config) only where
  // that callback is made: checkpointing on, and no [callbacks.NAME] model_checkpoint of the user's.
  tr.enable_checkpointing = t.get_bool(
      {"enable_checkpointing", "false: no checkpoint callback at all (a Ctrl-C still saves last.ckpt)"}, true);
  const std::optional<std::string> own_checkpoint = model_checkpoint_callback(root);
  for (const char* key : {"checkpoint_every_n_steps", "save_last"}) {
    TESSERA_CHECK(tr.enable_checkpointing || !t.has(key), t.locate("enable_checkpointing"), " = false, but ",
                  t.locate(key), " configures checkpoints: remove one of them");
    TESSERA_CHECK(!own_checkpoint || !t.has(key), path, ": [callbacks.", own_checkpoint.value_or(""), "] and ",
                  t.locate(key), " both configure checkpointing: move it into [callbacks.",
                  own_checkpoint.value_or(""), "] as ", key == std::string("save_last") ? "save_last" : "every_n_train_steps");
  }
  if (tr.enable_checkpointing && !own_checkpoint) {
    tr.checkpoint_every_n_steps = t.get_int(
        {"checkpoint_every_n_steps", "the default checkpoint callback's every_n_train_steps (0: at each epoch's end)"},
        0, 0);
    tr.save_last = t.get_bool(
        {"save_last", "the default checkpoint callback's save_last: keep last.ckpt pointing at the newest save"}, true);
  }
  tr.enable_model_summary = t.get_bool(
      {"enable_model_summary", "print the model's table of modules and parameter counts before training"}, true);
  const sdk::Key progress_bar{"enable_progress_bar", "auto: a progress bar when stdout is a terminal"};
  if (t.value("enable_progress_bar").is<bool>())
    tr.enable_progress_bar = t.get_bool(progress_bar, true) ? "true" : "false";
  else tr.enable_progress_bar = t.get_choice(progress_bar, "auto", {"auto", "true", "false"});
  tr.predict_after_fit =
      t.get_bool({"predict_after_fit", "print one predict batch (e.g. a text sample) at the end of fit"}, false);
  tr.init_from = read_path(t, {"init_from", "fine-tuning: start a new run from this checkpoint's weights; \"\": none"},
                           "", /*optional=*/true);
  if (!tr.init_from.empty())
    tr.init_from_strict = t.get_bool(  // listed only where it applies
        {"init_from_strict",
         "false: only tensors whose name and shape match load; the others keep their initialisation"},
        true);
  TESSERA_CHECK(!t.has("init_from_strict") || !tr.init_from.empty(), t.locate("init_from_strict"),
                " is set but no [trainer] init_from is: set init_from = PATH or remove init_from_strict");
  tr.resume = t.get_choice(
      {"resume", "auto: fit resumes from the newest committed checkpoint under default_root_dir that verifies (a "
                 "damaged one is passed over and kept)"},
      "never", {"never", "auto"});
  // Lightning-style spelling of [checkpoint_io] plugin: one key chooses how checkpoints are written.
  tr.checkpoint_format = t.get_choice(
      {"checkpoint_format",
       "how checkpoints are saved: torch (one full file), distributed (Tessera's sharded folder) or dcp (PyTorch's "
       "Distributed Checkpoint folder); the [checkpoint_io] plugin it names (\"\": [checkpoint_io] plugin's)"},
      "", {"", "torch", "distributed", "dcp"});
  tr.freeze = t.get_string_list(
      {"freeze", "module paths or parameter names whose parameters do not train (no gradient, no optimizer state)"},
      {});
  tr.max_time_s = read_duration(
      t, {"max_time", "\"DD:HH:MM:SS\" or seconds of training, then stop and save last.ckpt; 0: no limit"});
  tr.profiler = t.get_choice(
      {"profiler",
       "simple: time per hook; trace: a Chrome trace; pytorch: LibTorch's profiler over steps 3-5; \"\": none"},
      "", {"", "simple", "trace", "pytorch"});
  tr.nonfinite_loss = t.get_choice(
      {"nonfinite_loss",
       "a step whose loss is NaN/Inf on any rank: stop before the optimizer steps, naming where it appeared; skip: "
       "skip that step's update (a grad scaler, when there is one, skips it either way)"},
      "stop", {"stop", "skip"});
  tr.loss_average = t.get_choice(
      {"loss_average",
       "labels: a step's loss is the mean over every label of the global batch (integer targets that are not -100, "
       "else rows), whatever rank and micro-batch holds it, as one device computes it on the whole batch (Hugging "
       "Face's average_tokens_across_devices); micro_batches: each micro-batch's mean weighs the same (DDP's mean of "
       "means, which over-weighs the labels of a micro-batch that has few)"},
      "labels", {"labels", "micro_batches"});
  tr.detect_anomaly = t.get_bool(
      {"detect_anomaly", "check gradients for NaN/Inf before each optimizer step and stop naming the parameter"},
      false);
  tr.sync_batchnorm =
      t.get_bool({"sync_batchnorm",
                  "BatchNorm statistics over every data-parallel rank's samples (layers must be toolkit::SyncBatchNorm2d)"},
                 false);
  tr.skip_memory_check = t.get_bool(
      {"skip_memory_check", "start even when the plan's per-rank peak exceeds the memory available to the local ranks"},
      false);
  tr.resume_changed_hparams = t.get_string_list(
      {"resume_changed_hparams", "model hyper-parameters allowed to differ from the checkpoint's record when resuming"},
      {});
  t.check_all_used();

  sdk::Options lg = section("logger");
  config.logger.loggers = lg.get_string_list(
      {"loggers", "where metrics go: csv (metrics.csv), tensorboard (event files)"}, config.logger.loggers);
  for (const auto& name : config.logger.loggers)
    TESSERA_CHECK(name == "csv" || name == "tensorboard", lg.locate("loggers"), ": unknown logger \"", name, "\"",
                  sdk::did_you_mean(name, {"csv", "tensorboard"}), "; valid: csv, tensorboard");
  config.logger.name = lg.get_string({"name", "runs go to default_root_dir/name/"}, "");
  const sdk::Key version{"version", "N: the run folder version_N; text: that folder; \"\": the next free version_N"};
  if (lg.value("version").is<std::int64_t>())
    config.logger.version = std::to_string(lg.get_int(version, 0, 0));
  else config.logger.version = lg.get_string(version, "");
  for (const char* key : {"name", "version"}) {
    const std::string& part = std::string(key) == "name" ? config.logger.name : config.logger.version;
    TESSERA_CHECK(part.find('/') == std::string::npos && part != "." && part != "..", lg.locate(key),
                  " must be a folder name, not a path: \"", part, "\"");
  }
  lg.check_all_used();
  apply_fast_dev_run(config.trainer, config.logger);

  if (toml::table* callbacks = root["callbacks"].as_table()) {
    for (auto& [key, node] : *callbacks) {
      std::string name(key.str());
      TESSERA_CHECK(node.is_table(), where_from(node, path), ": [callbacks] ", name,
                    " must be a table: write [callbacks.", name, "] with its keys below it");
      config.callbacks.emplace_back(name, sdk::make_options("callbacks." + name, path, std::move(*node.as_table())));
    }
  }

  sdk::Options o = section("optimizer");
  sdk::OptimizerSettings& opt = config.optimizer;
  opt.name = o.get_choice({"name", "the optimizer; Adam and AdamW step through one fused kernel"}, "adamw",
                          {"adamw", "adam", "sgd"});
  opt.lr = o.get_double({"lr", "the peak learning rate (after warmup)"}, 1e-3, 0.0, kMaxFloat);
  std::vector<double> betas = o.get_double_list(
      {"betas", "Adam's (beta1, beta2): decay rates of the first and second moment estimates"}, {0.9, 0.999});
  TESSERA_CHECK(betas.size() == 2 && betas[0] >= 0 && betas[0] < 1 && betas[1] >= 0 && betas[1] < 1,
                o.locate("betas"), " must be two numbers in [0, 1), e.g. [0.9, 0.95]");
  opt.beta1 = betas[0];
  opt.beta2 = betas[1];
  opt.eps =
      o.get_double({"eps", "Adam's epsilon, added to the denominator for numerical stability"}, 1e-8, 0.0, kMaxFloat);
  opt.weight_decay =
      o.get_double({"weight_decay", "decoupled (AdamW) or L2 (Adam, SGD) weight decay; default 0.01 for adamw, else 0"},
                   opt.name == "adamw" ? 0.01 : 0.0, 0.0, kMaxFloat);
  opt.momentum = o.get_double({"momentum", "SGD's momentum"}, 0.0, 0.0, 1.0);
  // The schedule's keys live in [lr_scheduler] or, for short configs, in [optimizer].
  sdk::Options ls = section("lr_scheduler");
  for (const char* key : {"schedule", "warmup_steps", "min_lr"})
    TESSERA_CHECK(!(ls.has(key) && o.has(key)), o.locate(key), " and ", ls.locate(key),
                  " both set the schedule's ", key, ": keep one of them");
  auto schedule_options = [&](const char* key) -> const sdk::Options& { return ls.has(key) ? ls : o; };
  config.schedule.schedule =
      schedule_options("schedule")
          .get_choice({"schedule", "the learning rate after warmup: cosine or linear decay to min_lr, or constant"},
                      "cosine", {"cosine", "linear", "constant"});
  config.schedule.warmup_steps =
      schedule_options("warmup_steps").get_int({"warmup_steps", "steps of linear warmup from 0 to lr"}, 0, 0);
  config.schedule.min_lr = schedule_options("min_lr").get_double(
      {"min_lr", "where the cosine or linear decay ends, at the last step"}, 0.0, 0.0);
  TESSERA_CHECK(config.schedule.min_lr <= opt.lr, schedule_options("min_lr").locate("min_lr"), " = ",
                config.schedule.min_lr, " is above [optimizer] lr = ", opt.lr, ": min_lr must be in [0, lr]");
  for (const char* key : {"schedule", "warmup_steps", "min_lr"}) o.mark_used(key), ls.mark_used(key);
  o.check_all_used();
  ls.check_all_used();

  sdk::Options lf = section("lr_find");
  LrFindSettings& find = config.lr_find;
  find.min_lr = lf.get_double({"min_lr", "the range test's lowest learning rate"}, find.min_lr, 0.0, kMaxFloat);
  find.max_lr = lf.get_double({"max_lr", "the range test's highest learning rate"}, find.max_lr, 0.0, kMaxFloat);
  find.num_training = lf.get_int({"num_training", "optimizer steps of the range test"}, find.num_training, 2, 1000000);
  find.mode =
      lf.get_choice({"mode", "exponential: a geometric progression from min_lr to max_lr; linear: an arithmetic one"},
                    find.mode, {"exponential", "linear"});
  find.early_stop_threshold =
      lf.get_double({"early_stop_threshold", "stop once the smoothed loss exceeds this times its best; 0: never"},
                    find.early_stop_threshold, 0.0, kMaxFloat);
  find.before_fit = lf.get_bool(
      {"before_fit", "fit runs the range test first and trains with the suggested lr (Lightning's LearningRateFinder)"},
      false);
  TESSERA_CHECK(!find.before_fit || config.trainer.fast_dev_run == 0, lf.locate("before_fit"),
                " = true runs [lr_find] num_training steps before fit; [trainer] fast_dev_run runs a few batches of ",
                "each loop: remove one of them");
  TESSERA_CHECK(find.max_lr > find.min_lr, lf.locate("max_lr"), " = ", find.max_lr, " is not above min_lr = ",
                find.min_lr, ": the range test raises the learning rate from min_lr to max_lr");
  TESSERA_CHECK(find.mode == "linear" || find.min_lr > 0, lf.locate("min_lr"),
                " = 0: an exponential range starts above 0 (e.g. 1e-8); or mode = \"linear\"");
  lf.check_all_used();

  sdk::Options l = section("launch");
  LaunchSettings& la = config.launch;
  la.devices = l.get_int({"devices", "local ranks (processes) on this host"}, 1, 1, kMaxLocalRanks);
  la.nodes =
      l.get_int({"nodes", "hosts in the job; with torchrun, Slurm or mpirun it must match what they started"}, 1, 1);
  if (l.has("devices")) la.devices_key = l.locate("devices");
  if (l.has("nodes")) la.nodes_key = l.locate("nodes");
  la.node_rank = l.get_int({"node_rank", "this host's index among the nodes"}, 0, 0, la.nodes - 1);
  la.master_addr =
      l.get_string({"master_addr", "the address of rank 0's host, where the rendezvous store listens"}, la.master_addr);
  la.master_port = l.get_int({"master_port", "the rendezvous store's port; 0: a free port (single node)"}, 0, 0, 65535);
  la.cluster_environment =
      l.get_choice({"cluster_environment",
                    "who started the processes; auto detects torchrun, Slurm and Open MPI from the environment"},
                   "auto", {"auto", "local", "torchrun", "slurm", "mpi", "single"});
  la.num_threads =
      l.get_int({"num_threads", "compute threads per rank; 0: OMP_NUM_THREADS where set, else cores / local ranks"}, 0,
                0, kMaxThreads);
  la.collective_timeout_s = l.get_int(
      {"collective_timeout_s", "seconds a collective may take while training before the job is stopped with a report"},
      60, 1, kMaxTimeoutS);
  la.rendezvous_timeout_s = l.get_int(
      {"rendezvous_timeout_s", "seconds to join the store and create the process groups"}, 600, 1, kMaxTimeoutS);
  la.checkpoint_timeout_s =
      l.get_int({"checkpoint_timeout_s",
                 "seconds a collective may take while a checkpoint is saved or loaded (e.g. the save barrier)"},
                1800, 1, kMaxTimeoutS);
  la.shared_memory_collectives =
      l.get_bool({"shared_memory_collectives",
                  "CPU ranks on one host move all-gathers, reduce-scatters and all-reduces through shared memory"},
                 true);
  la.interface = l.get_string({"interface",
                               "the network interface every process group binds; default GLOO_SOCKET_IFNAME, else the "
                               "one reaching master_addr"},
                              "");
  l.check_all_used();

  for (const auto& name : kPluginSections) {
    sdk::Options options = section(name);
    config.plugin_names[name] = options.get_string({"plugin", "the " + name + " plugin (tessera plugins lists them)"},
                                                   kDefaultPlugins.at(name));
    if (name == "checkpoint_io" && !config.trainer.checkpoint_format.empty()) {
      TESSERA_CHECK(!options.has("plugin") || config.plugin_names[name] == config.trainer.checkpoint_format,
                    options.locate("plugin"), " = \"", config.plugin_names[name], "\" and [trainer] checkpoint_format = \"",
                    config.trainer.checkpoint_format, "\" choose different checkpoint formats: keep one");
      config.plugin_names[name] = config.trainer.checkpoint_format;
    }
    if (name == "data") {  // the host's own keys in [data]; the rest belong to the plugin
      config.data.batch_size = options.get_int(
          {"batch_size",
           "samples per rank per micro-batch (global batch = batch_size x ranks x accumulate_grad_batches)"},
          8, 1);
      // overfit_batches trains on the same batches every epoch.
      const bool overfit = config.trainer.overfit_batches.value > 0;
      const sdk::Key shuffle{"shuffle",
                             "a new order of the training samples every epoch (default true, false with "
                             "overfit_batches)"};
      TESSERA_CHECK(!overfit || !options.get_bool(shuffle, false), options.locate("shuffle"),
                    " = true, but [trainer] overfit_batches trains on the same batches every epoch: remove the key");
      config.data.shuffle = options.get_bool(shuffle, !overfit);
      // Batches are read in the training process (the data plugins index into memory).
      TESSERA_CHECK(
          options.get_int({"num_workers", "refused unless 0: batches are read in each rank's process"}, 0) == 0,
          options.locate("num_workers"),
          " is not supported: batches are read in each rank's training process; remove the key or set 0");
    }
    config.plugins.emplace(name, std::move(options));
  }
  return config;
}

}  // namespace tessera::host
