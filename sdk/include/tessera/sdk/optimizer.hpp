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
