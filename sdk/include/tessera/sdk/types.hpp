#pragma once
/// Plain data shared by the interfaces: batches, step outputs, state dicts, checkpoints.
#include <cstdint>
#include <map>
#include <string>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/Tensor.h>
#include <torch/ordered_dict.h>

#include "tessera/sdk/export.hpp"

namespace tessera::sdk {

/// One batch as a data plugin produces it: `input` and (optionally) `target`, batch on dim 0.
/// `position_ids` [B, T] (optional, token data) is each token's position within its sample for
/// rows that pack several samples, restarting at 0 where a sample starts (Hugging Face's
/// padding-free convention): a model keeps attention inside each sample and restarts its
/// positional encoding there. Undefined: every row is one sequence, positions 0 .. T-1.
struct Batch {
  at::Tensor input;
  at::Tensor target;
  at::Tensor position_ids;
  std::int64_t size() const { return input.defined() ? input.size(0) : 0; }
};

/// What a *_step returns: the loss to optimise (training) and extra metrics to log.
/// Metrics are scalar tensors; the strategy averages them across ranks before logging.
/// `items` counts what throughput is measured in (tokens or samples) on this rank.
struct StepOutput {
  at::Tensor loss;
  std::map<std::string, at::Tensor> metrics;
  std::int64_t items = 0;
};

/// A model state dict: original parameter and buffer names (never a flat-param prefix).
using StateDict = torch::OrderedDict<std::string, at::Tensor>;

/// A checkpoint: a nested dictionary of strings to tensors and plain values, the shape of a
/// Lightning checkpoint ("state_dict", "optimizer_states", "global_step", "epoch",
/// "hyper_parameters", ...). It pickles to a file Python's torch.load reads.
using Checkpoint = c10::impl::GenericDict;  // keys are strings

/// An empty checkpoint dictionary (str -> any).
TESSERA_SDK_API Checkpoint make_checkpoint();

enum class ReduceOp { sum, mean, max, min };

/// Where this process sits in the job, as detected by the host's cluster environment.
struct ClusterInfo {
  std::int64_t global_rank = 0;
  std::int64_t world_size = 1;
  std::int64_t local_rank = 0;
  std::int64_t local_world_size = 1;
  std::int64_t node_rank = 0;
  std::int64_t num_nodes = 1;
  std::string master_addr = "127.0.0.1";
  std::int64_t master_port = 0;
  std::string environment = "single";  ///< "single", "local", "torchrun", "slurm", "mpi"
  std::int64_t collective_timeout_s = 60;
};

/// How the host's loader walks a dataset; process_dataloader() fills the distributed part
/// (PyTorch's DistributedSampler semantics: disjoint per-rank slices of a seeded shuffle).
struct DataLoaderSpec {
  std::int64_t batch_size = 1;  ///< per rank
  bool shuffle = false;
  bool drop_last = false;
  std::int64_t seed = 0;
  std::int64_t num_replicas = 1;
  std::int64_t rank = 0;
};

}  // namespace tessera::sdk
