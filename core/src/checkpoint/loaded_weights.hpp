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
/// Where a floating tensor first holds a NaN or an infinity ("NaN at element 12 of 4096"), read in
/// blocks (no temporary the size of the tensor); empty when every element is finite.
std::string first_non_finite(const at::Tensor& t);
/// Throws naming the tensor when first_non_finite(value) finds one: a run would train to NaN.
void check_finite_weight(const std::string& name, const at::Tensor& value);

}  // namespace tessera::core
