#pragma once
// The run configuration: one TOML file plus --set overrides, validated before any work
// starts. Plugin sections become sdk::Options handed to the plugin factories.
#include <map>
#include <string>
#include <vector>

#include "tessera/sdk/optimizer.hpp"
#include "tessera/sdk/options.hpp"
#include "tessera/sdk/plugin.hpp"
#include "tessera/sdk/toml_options.hpp"

namespace tessera::host {

/// An entry of Config::load's overrides that removes a key or section (the CLI's --unset):
/// kUnsetPrefix + "section.key". Every other entry is a --set's "section.key=value".
inline constexpr const char* kUnsetPrefix = "--unset ";
bool is_unset(const std::string& override_entry);

/// Lightning's limit_{val,test,predict}_batches: an integer is a number of batches (0 skips
/// the loop), a float in [0.0, 1.0] a fraction of them.
struct BatchLimit {
  bool fraction = true;
  double value = 1.0;
  /// How many of `num_batches` to run (a non-zero fraction runs at least one).
  std::int64_t of(std::int64_t num_batches) const;
};

struct TrainerSettings {
  std::int64_t max_steps = -1;
  std::int64_t max_epochs = 1;
  std::int64_t accumulate_grad_batches = 1;
  double gradient_clip_val = 0.0;
  std::string gradient_clip_algorithm = "norm";  ///< "norm" (the total norm) or "value" (each element)
  double norm_type = 2.0;
  std::int64_t min_steps = 0;   ///< a callback's stop request (early stopping) waits until then
  std::int64_t min_epochs = 0;  ///< ... and until this many epochs are complete
  BatchLimit limit_train_batches;  ///< all: batches of each training epoch
  std::int64_t val_check_interval = 0;  ///< steps between validations over the run; 0 = see val_check_fraction
  double val_check_fraction = 1.0;      ///< validate every this fraction of an epoch (1.0: at its end)
  std::int64_t check_val_every_n_epoch = 1;  ///< epoch-end and fractional validations run in every n-th epoch
  std::int64_t num_sanity_val_steps = 2;     ///< validation batches run before the first step; -1 all
  BatchLimit overfit_batches{false, 0.0};  ///< > 0: train and validate on these batches only, unshuffled
  std::int64_t fast_dev_run = 0;  ///< > 0: that many batches of each loop, no loggers, no checkpoints
  BatchLimit limit_val_batches;                    ///< all
  BatchLimit limit_test_batches;                   ///< all
  BatchLimit limit_predict_batches{false, 1.0};   ///< one batch: a sample, not the whole set (all with predict_output)
  /// `predict` writes every prediction here (one file, in dataset order), besides printing the first batch.
  std::string predict_output;
  std::int64_t log_every_n_steps = 10;
  std::int64_t seed = 0;
  std::string default_root_dir = "tessera_logs";
  std::int64_t checkpoint_every_n_steps = 0;  ///< 0 = only last.ckpt
  bool save_last = true;
  bool enable_checkpointing = true;  ///< false: no checkpoint callback (Lightning's flag)
  bool enable_model_summary = true;  ///< the module table and unit plan at the start of fit
  std::string enable_progress_bar = "auto";  ///< "auto" (on a terminal), "true", "false"
  bool predict_after_fit = false;            ///< print one predict batch (e.g. a text sample) at the end
  /// A checkpoint whose weights a run starts from (fine-tuning) when it resumes from none.
  std::string init_from;
  std::string checkpoint_format;  ///< "": the [checkpoint_io] plugin's; else that plugin's name
  /// false: init_from loads the tensors whose name and shape are the model's; the others keep
  /// the model's initialisation (a new head, added adapters), listed in the log.
  bool init_from_strict = true;
  /// "auto": fit resumes from the newest committed checkpoint under default_root_dir when one
  /// exists (as --ckpt-path last), so a job restarted by torchrun --max-restarts or a requeue
  /// goes on where it stopped; "never": only --ckpt-path resumes.
  std::string resume = "never";
  /// Parameter names or module paths whose parameters do not train (requires_grad false).
  std::vector<std::string> freeze;
  double max_time_s = 0;                     ///< stop fit after this long (0: no limit); "DD:HH:MM:SS" in TOML
  std::string profiler;                      ///< "" (none), "simple" or "trace"
  bool sync_batchnorm = false;  ///< the model's toolkit::SyncBatchNorm2d layers normalise over every data-parallel rank
  /// A step whose loss is NaN/Inf on any rank (and no grad scaler to skip it): "stop" the run
  /// before the optimizer steps, with detect_anomaly's report; "skip" its optimizer step.
  std::string nonfinite_loss = "stop";
  /// "labels": a step's loss is the mean over every label of the global batch (all ranks and
  /// micro-batches; a -100 target is none), as one device computes it on the whole batch;
  /// "micro_batches": each micro-batch's mean weighs the same (DDP's mean of the ranks' means).
  std::string loss_average = "labels";
  bool detect_anomaly = false;  ///< check the loss and the reduced gradients for NaN/Inf before each optimizer step
  /// true: fit starts a job whose memory plan exceeds the machine (a warning instead of a refusal).
  bool skip_memory_check = false;
  /// Model hyper-parameters that may differ from a resumed checkpoint's record (fit --ckpt-path
  /// refuses any other difference, naming each key).
  std::vector<std::string> resume_changed_hparams;
};

/// [logger]: where a run's files go (Lightning's loggers make the version folders).
struct LoggerSettings {
  std::vector<std::string> loggers = {"csv"};  ///< "csv", "tensorboard"
  std::string name;     ///< "": runs in default_root_dir/version_N; else default_root_dir/name/version_N
  std::string version;  ///< "": the next free version_N; an integer N: version_N; other text: that folder
};

struct ScheduleSettings {
  std::string schedule = "cosine";  ///< "cosine", "linear" or "constant"
  std::int64_t warmup_steps = 0;
  double min_lr = 0.0;
};

/// `tessera lr-find` (Lightning's Tuner.lr_find): the learning-rate range test.
struct LrFindSettings {
  double min_lr = 1e-8;
  double max_lr = 1.0;
  std::int64_t num_training = 100;   ///< optimizer steps, from min_lr to max_lr
  std::string mode = "exponential";  ///< or "linear": how the lr rises from step to step
  double early_stop_threshold = 4.0;  ///< stop once the smoothed loss exceeds this x its best; 0: never
  bool before_fit = false;  ///< fit runs the test first and trains with the suggested lr
};

/// Upper bounds that catch typos (100000 threads runs without end) without limiting real use.
inline constexpr std::int64_t kMaxThreads = 1024;
inline constexpr std::int64_t kMaxLocalRanks = 1024;

struct LaunchSettings {
  std::int64_t devices = 1;
  std::int64_t nodes = 1;
  /// Where the config sets devices / nodes ("file:line: [launch] devices"); empty when left
  /// out. An external launcher's counts must then agree (Lightning's validate_settings).
  std::string devices_key, nodes_key;
  std::int64_t node_rank = 0;
  std::string master_addr = "127.0.0.1";
  std::int64_t master_port = 0;  ///< 0: the local launcher picks a free port
  std::string cluster_environment = "auto";
  std::int64_t num_threads = 0;  ///< 0: cores / local ranks
  std::int64_t collective_timeout_s = 60;    ///< each collective while training
  std::int64_t rendezvous_timeout_s = 600;   ///< joining the store and creating the process groups
  std::int64_t checkpoint_timeout_s = 1800;  ///< collectives while a checkpoint is saved or loaded
  bool shared_memory_collectives = true;     ///< CPU ranks of one host reduce and gather through shared memory
  /// The network interface every process group binds (GLOO_SOCKET_IFNAME when empty; neither:
  /// the interface that reaches master_addr).
  std::string interface;
};

struct DataSettings {
  std::int64_t batch_size = 8;  ///< per rank, as in Lightning
  bool shuffle = true;
};

/// Every plugin kind's section, in creation order.
inline const std::vector<std::string> kPluginSections = {"strategy", "precision", "checkpoint_io", "model", "data"};
/// The kind of plugin each of them holds.
inline const std::map<std::string, sdk::PluginKind> kPluginKinds = {
    {"strategy", sdk::PluginKind::strategy}, {"precision", sdk::PluginKind::precision},
    {"checkpoint_io", sdk::PluginKind::checkpoint_io}, {"model", sdk::PluginKind::model},
    {"data", sdk::PluginKind::data}};

class Config {
 public:
  Config() = default;
  // Move-only: a copied TOML table forgets the source lines that error messages name.
  Config(Config&&) = default;
  Config& operator=(Config&&) = default;
  Config(const Config&) = delete;
  Config& operator=(const Config&) = delete;

  /// Parses `path`, applies `overrides` in order ("section.key=value", value parsed as TOML,
  /// else a string; or kUnsetPrefix + "section[.key]", which removes that key or section) and
  /// validates every host-owned section. Throws sdk::Error naming file:line/key.
  static Config load(const std::string& path, const std::vector<std::string>& overrides);

  const std::string& path() const { return path_; }
  std::vector<std::string> plugin_dirs;
  TrainerSettings trainer;
  sdk::OptimizerSettings optimizer;
  ScheduleSettings schedule;
  LrFindSettings lr_find;
  LaunchSettings launch;
  DataSettings data;
  LoggerSettings logger;
  /// The [callbacks.NAME] tables in file order: NAME is a built-in callback or, with
  /// `plugin = "..."` (default NAME), a callback plugin.
  std::vector<std::pair<std::string, sdk::Options>> callbacks;
  /// The whole file with --set applied (saved in each run's folder as config.toml).
  toml::table resolved;
  /// The [strategy], [precision], ... tables; the factories read their own keys.
  std::map<std::string, sdk::Options> plugins;
  /// The `plugin = "..."` of each plugin section (with defaults).
  std::map<std::string, std::string> plugin_names;

 private:
  std::string path_;
};

/// A value as written in a config: floats in their shortest exact form (3e-4, not
/// 0.00029999999999999997), the rest as TOML++ writes them.
std::string toml_value(const sdk::Value& value);
/// `key = value`, its doc as a trailing comment, and a newline.
std::string toml_line(const std::string& key, const sdk::Value& value, const std::string& doc = "");
/// A key's doc line as listed: its Key's doc, then get_choice's valid values ("[a | b]").
std::string key_doc(const sdk::KeyRecord& record);

/// From now on, notes the default and doc of every key that sdk::Options reads (observe_keys),
/// for list_config: a config loaded and its plugins created after this call are listed whole.
void note_defaults();
/// `tessera config` and each run's config.toml: every key that the host and the selected
/// plugins read, as TOML: the file's and --set's values as they are, each default (as noted)
/// commented out (`# key = value`), so that the listing is a config equivalent to this one.
std::string list_config(const Config& config);

/// A duration key as Lightning writes it: "DD:HH:MM:SS", or a number of seconds; 0 when absent.
double read_duration(const sdk::Options& options, const sdk::Key& key);

}  // namespace tessera::host
