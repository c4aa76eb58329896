#pragma once
// Gathers a memory plan's inputs for a configured job (see plan.hpp): the plugins created and
// checked as `fit` creates them, the model built under deferred init (about one tensor of
// memory, never the whole model), the strategy's layout, a trace of one forward and the
// process's own baseline.
#include <string>

#include "config/config.hpp"
#include "plan/plan.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::host {

struct PlannedJob {
  MemoryPlan plan;
  std::int64_t world_size = 1;
  std::int64_t local_ranks = 1;
};

/// What plan_job throws when the job itself cannot start: the data cannot be set up or the
/// model cannot be built, as every rank of fit would find. fit stops on it before any rank starts.
class JobSetupError : public sdk::Error {
 public:
  using sdk::Error::Error;
};

/// Throws sdk::Error for a configuration that cannot run (the same checks as fit's), a
/// JobSetupError when the data or the model fails to set up. Without `trace_activations` the
/// forward is not traced (activations count 0, and a note says so): a CUDA job's activations
/// are device memory, its host rows are whole without them.
PlannedJob plan_job(const Config& config, bool trace_activations = true);

/// The CUDA memory each of this machine's ranks has (bytes: the smallest GPU they train on, shared
/// by the ranks on it over Gloo), or -1 when unknown
/// (no CUDA in this build, no such device). TESSERA_DEVICE_MEMORY_MB overrides it (tests).
double cuda_memory_bytes(const Config& config, std::int64_t local_ranks);

/// Whether the job trains on CUDA, by its [strategy] accelerator (core::accelerator_is_cuda,
/// the rule of the shipped strategies; read from the config, so for any strategy plugin).
bool trains_on_cuda(const Config& config);

}  // namespace tessera::host
