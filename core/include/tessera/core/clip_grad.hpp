#pragma once
/// Gradient-norm clipping for every strategy (torch.nn.utils.clip_grad_norm_, and FSDP's
/// clip_grad_norm_ over sharded gradients).
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "tessera/core/comm.hpp"

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

}  // namespace tessera::core
