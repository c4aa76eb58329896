#pragma once
// `tessera plan`: each rank's memory budget and traffic for a configured job, predicted
// without running a step. This file is the arithmetic and the report (unit-tested in
// tests/host/plan_test.cpp); plan_job.cpp gathers its inputs: the strategy's layout
// (sdk::StrategyMemoryLayout), a trace of one forward, and the process's own baseline.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tessera/sdk/memory_layout.hpp"

namespace tessera::host {

struct PlanInputs {
  std::string strategy;                      ///< the [strategy] plugin's name
  std::optional<sdk::MemoryLayout> layout;   ///< absent: the strategy does not describe its layout
  std::string optimizer = "adamw";           ///< [optimizer] name
  double momentum = 0;                       ///< [optimizer] momentum (sgd)
  std::int64_t world_size = 1;
  std::int64_t local_ranks = 1;              ///< ranks on this machine
  std::int64_t accumulate_grad_batches = 1;
  /// CPU groups across hosts gather and reduce in two levels ([launch] shared_memory_collectives).
  bool two_level_collectives = false;
  bool layout_of_micro_batches = false;  ///< the layout counts what accumulating micro-batches keeps (fsdp, fsdp2)
  double activation_bytes = 0;     ///< what autograd keeps from one forward (the trace)
  double baseline_bytes = 0;       ///< the process with LibTorch, the plugins and the data loaded
  double runtime_bytes = 0;        ///< what a training process holds beyond that (see plan_job.cpp)
  std::string activation_method;   ///< how the activations were measured, for the report
  /// The loss path beyond the activations (toolkit::loss_path_memory of the traced loss): the
  /// largest transient of the loss's forward or backward (the whole logits' gradients, or one
  /// chunk of the fused loss) plus the fused loss's kept weight gradient.
  double loss_bytes = 0;
  bool loss_bytes_per_sample = false;  ///< the unfused logits': they grow with the batch
  std::string loss_method;             ///< for the report
  /// The job trains on CUDA: every row but the trainer's runtime is device memory, except the
  /// parameters, gradients and optimizer state under cpu_offload, which stay in host memory.
  bool cuda = false;
  bool cpu_offload = false;
  /// The strategy frees the sharded gradients after each optimizer step and backward
  /// allocates them again as it frees activations (fsdp and fsdp2 on CUDA; ddp and
  /// single_device on LibTorch 2, whose zero_grad sets them to none): on the device
  /// the two do not peak together, so the device peak counts the larger of them only.
  bool gradients_freed_after_step = false;
  double cublas_workspace_bytes = 0;  ///< one of a CUDA job's two workspaces (cublas_workspace_bytes())
  /// [callbacks] weight_averaging / ema_weight_averaging: the average is a copy of what the
  /// optimizer steps (fp32 for 16-bit) plus, with use_buffers, of the network's buffers.
  bool weight_averaging = false;
  double averaged_buffer_bytes = 0;
};

/// One cuBLAS workspace. LibTorch 2 takes one from its caching allocator for each cuBLAS handle
/// and stream (shared with cuBLASLt), and handles are per thread: a training step holds two,
/// forward's thread's and that of autograd's device thread, which runs backward; both count in
/// peak_cuda_mb. CUBLAS_WORKSPACE_CONFIG's
/// ":KiB:count" segments when set and parsable (`config`, may be null), else its default for
/// the GPU's compute capability major: 32 MiB from 9 (Hopper) on, 8 MiB + 128 KiB before;
/// 32 MiB when no GPU is visible (`compute_major` < 0).
double cublas_workspace_bytes(const char* config, int compute_major);

/// One line of the budget.
struct PlanRow {
  std::string name;
  double bytes = 0;
  std::string detail;
  bool on_device = false;  ///< in CUDA memory (a CUDA job's), else host memory
};

/// One collective with the bytes a rank sends for it per optimizer step.
struct PlanTraffic {
  std::string kind, what;
  std::int64_t group_size = 1;
  double data_bytes = 0;  ///< full size of the data, summed over the step's calls
  double sent_bytes = 0;  ///< ring algorithm: (g-1)/g of it for all-gather and reduce-scatter, 2(g-1)/g all-reduce
  double crossing_bytes = -1;  ///< of those, what crosses between hosts (crossing_hosts_bytes()); < 0: not known
};

struct MemoryPlan {
  bool known = false;        ///< false: the strategy gave no layout (only the baseline is known)
  std::string description;
  std::vector<PlanRow> rows;     ///< the training budget, largest rank
  bool cuda = false;             ///< rows on the device, planned apart from the host's
  double device_peak = 0;        ///< CUDA jobs: the device rows, tensor memory at the peak of a step
  double baseline = 0;           ///< the process with LibTorch, the plugins and the data loaded
  double training_peak = 0;      ///< baseline + every host row
  double setup_peak = 0;         ///< baseline + building/sharding the model
  double peak = 0;               ///< peak RSS per rank: the larger of the two
  double job_bytes = 0;          ///< peak x local ranks: what this machine must hold
  std::vector<PlanTraffic> traffic;
  double sent_per_step = 0;      ///< bytes each rank sends per optimizer step
  double crossing_per_step = -1; ///< of those, bytes between hosts (a job on several hosts; < 0: not known)
  std::string crossing_how;      ///< "two levels" or "Gloo's rings", for the report
  std::vector<std::string> notes;
  /// The largest per-rank [data] batch_size that fits this machine (largest_batch_size()), and
  /// what bounds it, e.g. "the 20480 MB available to 2 local rank(s)"; absent when not planned.
  std::optional<std::int64_t> largest_batch_size;
  std::string batch_size_bound;
};

/// Bytes a rank sends for a collective over `group` ranks on data of `bytes` (ring algorithm).
double ring_bytes_sent(const std::string& kind, double bytes, std::int64_t group);
/// Of the bytes a rank sends for a collective over every rank of a job on `world / local_ranks`
/// hosts, those that cross between hosts, on average over the ranks: in two levels a host's
/// ranks exchange only their own part with the other hosts (ring_bytes_sent of data / local
/// ranks over the hosts); through Gloo alone, H of a ring's N steps cross, and an all-to-all's
/// reduce-scatter sends to every rank of the other hosts. Negative on CUDA (NCCL's own routes).
double crossing_hosts_bytes(const std::string& kind, double data_bytes, std::int64_t world, std::int64_t local_ranks,
                            bool two_levels, bool cuda);
/// Bytes as the report prints them: "123 MB" (MiB, whole).
std::string mb(double bytes);
/// Moments the optimizer keeps per parameter element: adam/adamw 2, sgd with momentum 1, else 0.
int optimizer_moments(const std::string& optimizer, double momentum);

MemoryPlan make_plan(const PlanInputs& inputs);

/// The report: one column for the largest rank (ranks differ only by padding here), in MB.
std::string format_plan(const MemoryPlan& plan, std::int64_t world_size, std::int64_t local_ranks);
/// The same as JSON (bytes).
std::string plan_json(const MemoryPlan& plan, std::int64_t world_size, std::int64_t local_ranks);

/// Lightning's Tuner.scale_batch_size, predicted instead of tried: the largest per-rank batch
/// size whose plan fits `available` bytes of host memory for this machine's ranks and, for a
/// CUDA job, `device_bytes` per GPU (<= 0: unknown, not checked), with the activations traced
/// for `traced_batch_size` samples scaled in proportion (what autograd keeps is per sample).
/// 0: not even one sample fits. At most kBatchSizeSearchLimit (every size up to it fits).
constexpr std::int64_t kBatchSizeSearchLimit = std::int64_t{1} << 20;
std::int64_t largest_batch_size(const PlanInputs& in, std::int64_t traced_batch_size, double available,
                                double device_bytes);

/// MemAvailable of /proc/meminfo in bytes, or -1; TESSERA_MEMORY_AVAILABLE_MB overrides it (tests).
double memory_available_bytes();
/// A field of this process's /proc/self/status in kB ("VmRSS", "VmHWM", "RssAnon"); 0 where it
/// cannot be read.
std::int64_t proc_status_kb(const std::string& field);
/// A warning when `plan.job_bytes` (host memory) exceeds `available` bytes (fit prints it before any work); "" otherwise.
std::string memory_warning(const MemoryPlan& plan, double available, std::int64_t local_ranks);
/// "" unless a CUDA plan's device peak per rank exceeds `device_bytes` (a GPU's memory); else
/// the warning, naming the device rows ("at least" when the activations were not traced).
std::string device_memory_warning(const MemoryPlan& plan, double device_bytes, bool activations_traced);

}  // namespace tessera::host
