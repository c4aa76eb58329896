#pragma once
/// The [optimizer] section, and the default optimizer a Module builds from it.
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/optim/optimizer.h>

#include "tessera/sdk/export.hpp"
#include "tessera/sdk/types.hpp"

namespace tessera::sdk {

struct OptimizerSettings {
  std::string name = "adamw";  ///< "adamw", "adam" or "sgd"
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double momentum = 0.0;  ///< sgd only
};

/// A parameter as the optimizer will see it: under FSDP this is the local shard, named
/// after the original parameter.
struct NamedParameter {
  std::string name;
  at::Tensor tensor;
};

/// AdamW/Adam/SGD over `params` (one param group), from `settings`. Adam and AdamW step
/// through the fused kernels aten::_fused_adam_ and _fused_adamw_ where the parameters' device
/// has them (CUDA; the CPU: LibTorch's from 2.4, below it the toolkit's, registered when
/// libtessera_toolkit is loaded, as it is in every tessera process), otherwise through
/// LibTorch's loop.
TESSERA_SDK_API std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::vector<NamedParameter>& params,
                                                                        const OptimizerSettings& settings);

/// Whether this LibTorch has a fused Adam kernel for `device`'s backend.
TESSERA_SDK_API bool has_fused_adam(const c10::Device& device);

/// What an optimizer is, asked of it here and nowhere else: checkpoints, the lr monitor and the
/// precision checks read its class, hyper-parameters and state through these functions, in
/// PyTorch's state_dict names. LibTorch's Adam, AdamW and SGD (make_optimizer's, fused or not)
/// are described; another class has an empty name and no state keys, and saving or loading
/// its state is refused naming the supported ones.
struct OptimizerKind {
  std::string name;                ///< "AdamW", "Adam" or "SGD"; empty for another class
  std::vector<std::string> state;  ///< the per-parameter state a checkpoint may hold for it
  std::vector<std::string> required_state;  ///< what a saved state must hold (Adam's moments)
};
TESSERA_SDK_API OptimizerKind optimizer_kind(const torch::optim::Optimizer& optimizer);
/// A param group's hyper-parameters: lr, betas, eps, weight_decay, amsgrad (Adam, AdamW); lr,
/// momentum, dampening, weight_decay, nesterov (SGD). Throws sdk::Error for another class.
TESSERA_SDK_API Checkpoint hyper_parameters(const torch::optim::OptimizerOptions& options);
/// Sets those of `saved` (a param group of a state_dict; the others stay), lr for any class.
/// Throws sdk::Error for a value of the wrong type, naming its key.
TESSERA_SDK_API void set_hyper_parameters(torch::optim::OptimizerOptions& options, const Checkpoint& saved);
/// A parameter's state ("step" as a float tensor, as PyTorch saves it). Throws for another class.
TESSERA_SDK_API Checkpoint parameter_state(const torch::optim::OptimizerParamState& state);
/// A new state of `optimizer`'s class holding `saved`'s values (tensors cloned). Throws for
/// another class.
TESSERA_SDK_API std::unique_ptr<torch::optim::OptimizerParamState> make_parameter_state(
    const torch::optim::Optimizer& optimizer, const Checkpoint& saved);

/// The key of `p`'s per-parameter state in a C++ optimizer's state(): its TensorImpl's
/// printed address in LibTorch 1.x, the pointer itself in 2.x.
template <class Key = std::decay_t<decltype(std::declval<const torch::optim::Optimizer&>().state())>::key_type>
Key optimizer_state_key(const at::Tensor& p) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream address;
    address << p.unsafeGetTensorImpl();
    return address.str();
  } else {
    return p.unsafeGetTensorImpl();
  }
}

}  // namespace tessera::sdk
