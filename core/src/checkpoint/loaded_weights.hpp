#pragma once
// What a strategy checks of each tensor it loads into a parameter (StrategyBase and the sharded
// engine alike), before training on it: private to the engine, beside its sources.
#include <string>

#include <ATen/core/Tensor.h>

namespace tessera::core {

/// A checkpoint's value for a floating-point parameter must be stored as one (F32, BF16, F16 or
/// F64): an integer or bool tensor would be converted value by value into garbage weights.
/// Throws naming the tensor, its dtype and the valid ones.
void check_weight_dtype(const std::string& name, const at::Tensor& value, const at::Tensor& parameter);

}  // namespace tessera::core
