#pragma once
/// The per-parameter layout (PyTorch FSDP2's FSDPParamGroup of FSDPParams): every parameter
/// is sharded on dim 0 over the shard group (torch.chunk's split: ceil(rows / world) rows per
/// rank, the last ranks' pieces padded), so the optimizer steps on tensors that keep their
/// own N-D shape (a dim-0 slice). A unit's pieces sit one after another in one shard buffer,
/// so one all-gather and one reduce-scatter still move a whole unit; the gathered rows are
/// copied out into the parameters, and the gradients copied in, around each collective.
#include "fsdp/flat_param.hpp"

namespace tessera::core::fsdp {

class FSDPParamGroup final : public FlatParamHandle {
 public:
  FSDPParamGroup(std::vector<UnitParam> params, const Config& config);

  OwnedRange owned_range(std::size_t i) const override;
  at::Tensor owned_part(const at::Tensor& unsharded) const override;
  /// A unit of frozen and trainable parameters (LoRA's base and adapters) reduces the trainable
  /// parameters' chunks only, as FSDP2 reduces the parameters that have gradients: the frozen
  /// ones' zeros are neither sent nor summed.
  /// Its gradients, unsharded and sharded, are kept for the trainable parameters only.
  at::Tensor reduce_scatter_input(at::ScalarType dtype) override;
  std::int64_t reduce_numel() const override { return reduces_subset() ? reduce_numel_ : shard_numel_; }

 protected:
  bool gathers_in_place() const override { return false; }
  void copy_out(const at::Tensor& gathered, const at::Tensor& unsharded) const override;
  at::Tensor copy_in(const at::Tensor& unsharded, at::ScalarType dtype) const override;
  std::pair<std::int64_t, std::int64_t> shard_slice(std::size_t i) const override;
  std::int64_t unsharded_grad_offset(std::size_t i) const override {
    return reduces_subset() ? grad_offsets_[i] : FlatParamHandle::unsharded_grad_offset(i);
  }
  std::int64_t unsharded_grad_numel() const override { return reduces_subset() ? trainable_numel_ : padded_; }
  std::int64_t sharded_grad_offset(std::size_t i) const override {
    return reduces_subset() ? rows_[i].reduce_offset : FlatParamHandle::sharded_grad_offset(i);
  }
  std::int64_t sharded_grad_numel() const override { return reduce_numel(); }
  std::vector<std::int64_t> piece_shape(std::size_t i, std::int64_t length) const override;

 private:
  /// Dim 0 of parameter i (1 for a scalar) and the elements of one row.
  struct Rows {
    std::int64_t rows = 0, row_numel = 0;
    std::int64_t chunk = 0;         ///< rows per rank (the last ranks' padded)
    std::int64_t shard_offset = 0;  ///< where its chunk starts in every rank's shard
    std::int64_t owned = 0;         ///< rows this rank owns
    std::int64_t reduce_offset = -1;  ///< where its chunk starts in every rank's reduced gradient; -1: frozen
  };
  bool reduces_subset() const { return reduce_numel_ > 0 && reduce_numel_ < shard_numel_; }
  /// Parameter i of `unsharded` as [rows, row_numel].
  at::Tensor rows_of(const at::Tensor& unsharded, std::size_t i) const;
  /// Parameter i's padded chunks in a gathered buffer, [world, chunk, row_numel].
  at::Tensor chunks_of(const at::Tensor& gathered, std::size_t i) const;
  /// Copies between a parameter's rows and its chunks (padding untouched).
  void copy_rows(const at::Tensor& rows, const at::Tensor& chunks, std::size_t i, bool into_chunks) const;

  std::vector<Rows> rows_;
  std::int64_t reduce_numel_ = 0;  ///< the trainable parameters' chunks
  std::vector<std::int64_t> grad_offsets_;  ///< in the unsharded gradient of the trainable parameters; -1: frozen
  std::int64_t trainable_numel_ = 0;
};

}  // namespace tessera::core::fsdp
