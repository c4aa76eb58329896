#pragma once
/// Deferred initialisation (PyTorch's meta-device init + param_init_fn, Lightning's
/// init_module(empty_init=True)): a model is built without memory and each sharding unit is
/// given real memory and initialised only when a strategy shards it, so no rank ever holds
/// the whole model.
#include <cstdint>
#include <functional>
#include <set>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include "tessera/sdk/guard.hpp"

namespace tessera::core {

/// model_sharded_context() under deferred init: while the guard lives, CPU allocations all
/// share one scratch block (the size of the largest tensor), so building a model costs about
/// one tensor. A sharding strategy then gives each unit real memory and initialises it
/// (initialize_modules) before the next unit. Other tensors made under the guard hold garbage.
sdk::GuardPtr deferred_init_guard();
/// deferred_init_guard() again, for work on a model built under it that must not give it
/// memory (a tensor-parallel plan cutting its deferred weights into pieces): allocations share
/// the scratch block again, and the generator's replay point stays where the first guard put it.
sdk::GuardPtr resume_deferred_init_guard();
/// Whether `t` was created under deferred_init_guard() and not given real memory yet.
bool is_deferred(const at::Tensor& t);
/// Whether any parameter or buffer of `network` is deferred.
bool has_deferred_tensors(const torch::nn::Module& network);

/// Initialises one module's own tensors in place; false: not handled (see initialize_modules).
using ParamInitFn = std::function<bool(const std::string& path, torch::nn::Module& module)>;
/// Initialises every module of `network` whose own parameters are among `params` (now given
/// real memory): buffers zeroed on `device`, then `init` (the model's init_parameters), else
/// LibTorch's reset_parameters() for Linear, Embedding, LayerNorm, Conv1d-3d, BatchNorm1d-3d
/// (the values of an eager build with the same seed when units come in construction order).
/// A module with parameters both inside and outside `params`, or of an unknown class, throws.
/// A module holding tensor-parallel pieces (sdk::TensorParallelModule; this rank is `tp_rank`
/// of `tp_size`) is initialised at full shape: each split parameter is pointed at a transient
/// full-size tensor, `init` or the reset runs on it, and this rank's piece is copied back: the
/// values of an eager build cut by the model's parallelize (one module's full tensors at a time).
void initialize_modules(torch::nn::Module& network, const std::set<const void*>& params, c10::Device device,
                        const ParamInitFn& init, std::int64_t tp_rank = 0, std::int64_t tp_size = 1);
/// LibTorch's own initialiser for `module`, if it is one of the classes above, or its own
/// sdk::ResettableLayer::reset_parameters() (initialize_modules gives it its full shapes first).
bool reset_known_module(torch::nn::Module& module);
/// Rewinds the default CPU generator to where deferred_init_guard() started, so units
/// initialised in construction order draw an eager build's values.
void replay_deferred_init_rng();
/// Frees the scratch memory: only once no parameter or buffer is deferred any more.
void release_deferred_init_memory();

}  // namespace tessera::core
