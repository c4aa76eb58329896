#pragma once
// ShardedModule's state, private to the engine: the units in registration order (each one's
// layout: flat shards or per-parameter ones), the parameters kept whole, and the scheduler
// that gathers and reduces them. fsdp.hpp names it only, so none of these types is installed.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "tessera/core/comm.hpp"
#include "tessera/core/fsdp.hpp"
#include "tessera/core/fsdp/options.hpp"
#include "fsdp/scheduler.hpp"
#include "fsdp/unit.hpp"

namespace tessera::core::fsdp {

struct ShardedModule::State {
  std::shared_ptr<torch::nn::Module> network;
  FSDPOptions options;
  CommunicatorPtr shard_group;
  CommunicatorPtr replicate_group;
  c10::Device device{c10::kCPU};
  std::vector<std::unique_ptr<FSDPUnit>> units;  // children in registration order, root last
  std::vector<UnitParam> replicated;  // ignored modules' and exempt norm layers' parameters
  std::vector<std::shared_ptr<torch::nn::Module>> norm_layers;  // outside the mixed-precision policy
  std::map<std::string, at::ScalarType> buffer_dtypes;  // buffers cast to buffer_dtype: their own dtype
  std::unique_ptr<Scheduler> scheduler;
  bool summoned = false;
};

}  // namespace tessera::core::fsdp
