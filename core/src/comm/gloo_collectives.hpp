#pragma once
/// Gloo's side of the gathers and reductions, shared by a group's own collectives
/// (c10d_communicator.cpp) and the cross-host level of the two-level ones
/// (hierarchical_collectives.cpp). Templates: ProcessGroupGloo is a ProcessGroup in LibTorch
/// 1.13 and a Backend in 2.x, with the same collective methods.
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "tessera/core/comm.hpp"
#include "tessera/sdk/types.hpp"

namespace tessera::core::detail {

inline c10d::ReduceOp to_c10d(sdk::ReduceOp op) {
  switch (op) {
    case sdk::ReduceOp::sum:
    case sdk::ReduceOp::mean: return c10d::ReduceOp::SUM;  // mean = sum, then divide (Gloo has no AVG)
    case sdk::ReduceOp::max: return c10d::ReduceOp::MAX;
    case sdk::ReduceOp::min: return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

/// Gather, all-to-all and broadcast move 16-bit tensors as bytes, the one type every Gloo build
/// moves: 1.13's has no bf16, Debian sid's 2.14 no 16-bit type at all ("Invalid scalar type").
/// The bits are never interpreted on the way; reductions convert to fp32 instead. A 0-dim
/// tensor goes as one element (a dtype view must widen its last dimension).
inline at::Tensor wire_view(const at::Tensor& t) {
  if (t.element_size() != 2) return t;
  return (t.dim() == 0 ? t.view({1}) : t).view(at::kByte);
}

/// Receive buffers of Gloo's reduce_scatter (all_to_all + sum), reused across calls: FSDP
/// reduces the same unit sizes every step, and a fresh buffer of tens of MB is page-faulted
/// in on every call (a 64 MB reduce-scatter ran at 0.75x the all-gather's bandwidth).
class ReceiveBufferPool {
 public:
  at::Tensor take(const at::Tensor& like) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& idle = idle_[{like.numel(), like.scalar_type()}];
    if (idle.empty()) return at::empty_like(like);
    at::Tensor t = std::move(idle.back());
    idle.pop_back();
    return t;
  }
  void give(at::Tensor t) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& idle = idle_[{t.numel(), t.scalar_type()}];
    if (idle.size() < kIdlePerSize) idle.push_back(std::move(t));
  }

 private:
  static constexpr std::size_t kIdlePerSize = 2;  // FSDP keeps two reductions in flight
  std::mutex mutex_;
  std::map<std::pair<std::int64_t, at::ScalarType>, std::vector<at::Tensor>> idle_;
};

/// A Gloo collective in flight and the local step that completes it (copy-out, sum, divide),
/// run after its work finished; `finish` may be empty.
struct GlooIssued {
  c10::intrusive_ptr<c10d::Work> work;
  std::function<void()> finish;
};

/// `output` (contiguous, `size` x input) := every rank's `input`, in rank order.
template <typename Backend>
GlooIssued gloo_all_gather(Backend& backend, const at::Tensor& output, const at::Tensor& input, std::int64_t size) {
  at::Tensor in = wire_view(input.contiguous()).view({-1});
  at::Tensor out = wire_view(output).view({-1});
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (std::int64_t r = 0; r < size; ++r) outputs[0].push_back(out.narrow(0, r * in.numel(), in.numel()));
  std::vector<at::Tensor> inputs{in};
  return {backend.allgather(outputs, inputs), nullptr};
}

/// all_to_all + local sum: each rank receives every rank's copy of its own chunk, the same bytes
/// on the wire as a ring reduce-scatter (the 1.13 Gloo backend has no reduce_scatter).
template <typename Backend>
GlooIssued gloo_reduce_scatter(Backend& backend, const std::shared_ptr<ReceiveBufferPool>& pool, at::Tensor output,
                               const at::Tensor& input, sdk::ReduceOp op, std::int64_t size) {
  at::Tensor in = input.contiguous().view({-1});
  at::Tensor received = pool->take(in);
  std::vector<std::int64_t> splits;
  at::Tensor wire_out = wire_view(received), wire_in = wire_view(in);
  auto work = backend.alltoall_base(wire_out, wire_in, splits, splits);
  return {work, [received, in, output, op, size, pool]() mutable {
            reduce_rows(received.view({size, -1}), output, op);
            pool->give(std::move(received));
          }};
}

/// `tensor` := op over every rank's `tensor`; 16-bit tensors are reduced in fp32 unless the
/// backend reduces them itself (NCCL: the one collective NCCL shares with Gloo's code here).
template <typename Backend>
GlooIssued gloo_all_reduce(Backend& backend, at::Tensor tensor, sdk::ReduceOp op, std::int64_t size,
                           bool sixteen_bit_in_fp32 = true) {
  const bool low_precision =
      sixteen_bit_in_fp32 && (tensor.scalar_type() == at::kBFloat16 || tensor.scalar_type() == at::kHalf);
  at::Tensor wire = low_precision || !tensor.is_contiguous() ? tensor.to(at::kFloat).contiguous() : tensor;
  std::vector<at::Tensor> tensors{wire};
  c10d::AllreduceOptions options;
  options.reduceOp = to_c10d(op);
  auto work = backend.allreduce(tensors, options);
  return {work, [tensor, wire, op, size]() mutable {
            if (op == sdk::ReduceOp::mean) wire.div_(static_cast<double>(size));
            if (!wire.is_same(tensor)) tensor.copy_(wire);
          }};
}

}  // namespace tessera::core::detail
