#pragma once
/// Reading an autograd graph: what a forward left for backward (memory plans, the tensor-parallel
/// traffic of a traced forward).
#include <functional>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include "tessera/sdk/export.hpp"

namespace tessera::sdk {

/// Calls `visit` once for each node of the graph that `output` ends (none without history).
TESSERA_SDK_API void for_each_autograd_node(const at::Tensor& output,
                                            const std::function<void(torch::autograd::Node&)>& visit);

}  // namespace tessera::sdk
