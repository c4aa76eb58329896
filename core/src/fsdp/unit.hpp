#pragma once
/// One FSDP unit at run time (PyTorch FSDP2's FSDPParamGroup): its layout, where it stands
/// in the step (gathered? gradients attached? reduced?), its collectives in flight and the
/// autograd state that tells when its gradients are complete.
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include "tessera/core/comm.hpp"
#include "fsdp/layout.hpp"

namespace tessera::core::fsdp {

struct FSDPUnit {
  // What it is.
  std::string name;  ///< module path, "<root>" for the root
  std::size_t index = 0;  ///< in registration order; the root is last
  bool is_root = false;
  bool checkpointed = false;  ///< activation checkpointing
  std::shared_ptr<torch::nn::Module> module;  ///< null for the root
  std::unique_ptr<UnitLayout> layout;
  std::string forward_tag, backward_tag, reduce_tag, replica_tag;  ///< collective names for reports

  // The schedule (scheduler.cpp).
  bool gathered = false;
  CommHandlePtr gather_handle;  ///< an all-gather in flight (a prefetch, until waited for)
  at::Tensor gather_input;
  at::Tensor post_forward_shard;  ///< what this rank keeps after forward with a post_forward_group
  bool grads_attached = false;  ///< unsharded gradients allocated and the parameters' .grad
  bool reduced = false;         ///< this backward's reduce-scatter launched
  CommHandlePtr reduce_handle;
  at::Tensor reduce_input, reduce_output;
  std::int64_t order_position = -1;  ///< in the first forward's execution order; -1: never ran
  /// Explicit prefetch (FSDP2's set_modules_to_forward_prefetch / _backward_prefetch): the
  /// units gathered when this one runs, in place of the implicit next / previous unit.
  std::vector<FSDPUnit*> forward_prefetch, backward_prefetch;

  // Gradient readiness (autograd_seam.cpp): hooks on the parameters' accumulators.
  // grad_accumulator()'s pointer: shared_ptr before LibTorch 2.14, intrusive_ptr since.
  std::vector<decltype(torch::autograd::impl::grad_accumulator(at::Tensor()))> accumulators;
  std::int64_t expected_grads = 0, pending_grads = 0;
  /// Frozen and trainable parameters in one unit (LoRA's adapters beside their frozen base): the
  /// last adapter gradient can be ready while the unit's backward still needs a frozen weight
  /// (the input gradient through a base Linear), so its post-backward also waits for the hook on
  /// its inputs, counted once per forward that attached it (input_hooks).
  bool has_frozen = false;
  std::int64_t input_hooks = 0;
};

}  // namespace tessera::core::fsdp
