#pragma once
/// Gradient clipping for every strategy: by norm (torch.nn.utils.clip_grad_norm_, and FSDP's
/// clip_grad_norm_ over sharded gradients) and by value (clip_grad_value_).
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "tessera/core/comm.hpp"

namespace torch::optim {
class Optimizer;
}

namespace tessera::core {

/// The total `norm_type` norm (inf allowed) of all gradients, computed in fp32 on `device`;
/// if it exceeds `max_norm` every gradient is scaled in place to it. `sharded`: each rank of
/// `group` holds a disjoint part (their norms are reduced over it: collective); `replicated`:
/// the same on every rank, counted once. `group` may be null (nothing is sharded).
double clip_grad_norm(const std::vector<at::Tensor>& sharded, const std::vector<at::Tensor>& replicated,
                      double max_norm, double norm_type, Communicator* group, c10::Device device);

/// As above, with `split` gradients that are sharded over `group` and also split over
/// `split_group` (tensor-parallel pieces): their norms are reduced over both.
double clip_grad_norm(const std::vector<at::Tensor>& sharded, const std::vector<at::Tensor>& split,
                      const std::vector<at::Tensor>& replicated, double max_norm, double norm_type,
                      Communicator* group, Communicator* split_group, c10::Device device);

/// Clamps every gradient of `optimizer`'s parameters to [-clip_value, clip_value] in place.
/// Element by element, so a rank clamping only its shards or tensor-parallel pieces does
/// exactly what one device does to the whole gradients: no collective.
void clip_grad_value(torch::optim::Optimizer& optimizer, double clip_value);

}  // namespace tessera::core
