#include "tessera/core/clip_grad.hpp"

#include <cmath>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/optim/optimizer.h>

#include "tessera/sdk/error.hpp"

namespace tessera::core {

double clip_grad_norm(const std::vector<at::Tensor>& sharded, const std::vector<at::Tensor>& replicated,
                      double max_norm, double norm_type, Communicator* group, c10::Device device) {
  return clip_grad_norm(sharded, {}, replicated, max_norm, norm_type, group, nullptr, device);
}

double clip_grad_norm(const std::vector<at::Tensor>& sharded, const std::vector<at::Tensor>& split,
                      const std::vector<at::Tensor>& replicated, double max_norm, double norm_type,
                      Communicator* group, Communicator* split_group, c10::Device device) {
  TESSERA_CHECK(norm_type > 0, "gradient clipping norm_type must be > 0 or inf, got ", norm_type);
  const bool inf_norm = std::isinf(norm_type);
  auto accumulate = [&](at::Tensor& total, const std::vector<at::Tensor>& gradients) {
    for (const at::Tensor& g : gradients) {
      if (!g.defined() || g.numel() == 0) continue;
      at::Tensor gf = g.detach().to(at::kFloat);
      at::Tensor part = (inf_norm ? gf.abs().max() : gf.abs().pow(norm_type).sum()).reshape({1}).to(device);
      total = inf_norm ? at::maximum(total, part) : total + part;
    }
  };
  const sdk::ReduceOp op = inf_norm ? sdk::ReduceOp::max : sdk::ReduceOp::sum;
  at::Tensor total = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
  if (!split.empty() && split_group != nullptr && split_group->size() > 1) {
    accumulate(total, split);
    split_group->all_reduce(total, op, "clip_grad_norm over tensor-parallel pieces")->wait();
  } else {
    accumulate(total, split);
  }
  accumulate(total, sharded);
  if (group != nullptr && group->size() > 1) group->all_reduce(total, op, "clip_grad_norm")->wait();
  accumulate(total, replicated);  // after the reduction: the same on every rank, counted once
  const double norm = inf_norm ? total.item<double>() : std::pow(total.item<double>(), 1.0 / norm_type);
  const double coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1.0) {
    torch::NoGradGuard no_grad;
    for (const auto* list : {&sharded, &split, &replicated})
      for (const at::Tensor& g : *list)
        if (g.defined()) g.detach().mul_(coefficient);
  }
  return norm;
}

void clip_grad_value(torch::optim::Optimizer& optimizer, double clip_value) {
  TESSERA_CHECK(clip_value > 0, "gradient clipping by value needs a clip value > 0, got ", clip_value);
  torch::NoGradGuard no_grad;
  for (const auto& group : optimizer.param_groups())
    for (const at::Tensor& p : group.params())
      if (p.grad().defined()) p.grad().clamp_(-clip_value, clip_value);
}

}  // namespace tessera::core
