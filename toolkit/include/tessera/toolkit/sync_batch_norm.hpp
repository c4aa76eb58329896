#pragma once
/// BatchNorm over the whole data-parallel batch: PyTorch's SyncBatchNorm, what Lightning's
/// Trainer(sync_batchnorm=True) converts BatchNorm layers to. LibTorch modules have no forward
/// hooks, so a model opts in by building its BatchNorm2d layers as this class; with [trainer]
/// sync_batchnorm = true the host connects them to the data-parallel ranks, and in training
/// every rank normalises with the mean and variance of all ranks' samples (and keeps the same
/// running statistics), so N ranks train as one device does on the global batch. Unconnected,
/// in eval mode, or on one rank it is torch::nn::BatchNorm2d exactly: LibTorch's BatchNorm base,
/// the same parameters, buffers and names (checkpoints load into either), kept in fp32 by FSDP's
/// mixed precision and reset by deferred init as BatchNorm2d is.
#include <functional>

#include <torch/nn/modules/batchnorm.h>

#include "tessera/sdk/layer.hpp"

namespace tessera::toolkit {

/// Sums `tensor` over the data-parallel ranks, in place; every rank must call it in the same order.
using AllReduceSum = std::function<void(at::Tensor& tensor)>;

class SyncBatchNorm2dImpl : public torch::nn::BatchNormImplBase<2, SyncBatchNorm2dImpl>,
                            public sdk::ResettableLayer,
                            public sdk::BatchNormLayer {
 public:
  using torch::nn::BatchNormImplBase<2, SyncBatchNorm2dImpl>::BatchNormImplBase;

  void reset_parameters() override { torch::nn::BatchNormImplBase<2, SyncBatchNorm2dImpl>::reset_parameters(); }

  at::Tensor forward(const at::Tensor& input);

  /// Makes training statistics global (the host does, under [trainer] sync_batchnorm); an empty
  /// function makes them this rank's again.
  void set_all_reduce(AllReduceSum all_reduce) { all_reduce_ = std::move(all_reduce); }
  bool synchronised() const { return static_cast<bool>(all_reduce_); }

 protected:
  void _check_input_dim(const at::Tensor& input) override;

 private:
  AllReduceSum all_reduce_;
};
TORCH_MODULE(SyncBatchNorm2d);

}  // namespace tessera::toolkit

/// LibTorch 1.13 defines BatchNorm's pretty_print out of line for its own three classes only
/// (2.x inline, for any): this class's, declared before any use, is in libtessera_toolkit.
template <>
void torch::nn::BatchNormImplBase<2, tessera::toolkit::SyncBatchNorm2dImpl>::pretty_print(std::ostream& stream) const;
