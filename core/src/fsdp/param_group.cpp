#include "fsdp/param_group.hpp"

#include <ATen/ATen.h>

namespace tessera::core::fsdp {

FSDPParamGroup::FSDPParamGroup(std::vector<UnitParam> params, const Config& config)
    : FlatParamHandle(std::move(params), config) {
  // The unsharded buffer needs no padding here: the padding lives in the shards.
  padded_ = numel_;
  shard_numel_ = 0;
  for (const auto& p : params_) {
    Rows r;
    r.rows = p.tensor.dim() == 0 ? 1 : p.tensor.size(0);
    r.row_numel = r.rows == 0 ? 0 : p.tensor.numel() / r.rows;
    r.chunk = (r.rows + config_.world - 1) / config_.world;
    r.shard_offset = shard_numel_;
    r.owned = std::max<std::int64_t>(0, std::min(r.chunk, r.rows - config_.rank * r.chunk));
    shard_numel_ += r.chunk * r.row_numel;
    grad_offsets_.push_back(-1);
    if (p.tensor.requires_grad()) {
      r.reduce_offset = reduce_numel_;
      reduce_numel_ += r.chunk * r.row_numel;
      grad_offsets_.back() = trainable_numel_;
      trainable_numel_ += p.tensor.numel();
    }
    rows_.push_back(r);
  }
  // A unit with no elements still takes part in its collectives, with one element of padding.
  if (shard_numel_ == 0) shard_numel_ = 1;
  shard_offset_ = 0;  // unused: the shard is not one range of the unsharded buffer
}

at::Tensor FSDPParamGroup::rows_of(const at::Tensor& unsharded, std::size_t i) const {
  return unsharded.narrow(0, offsets_[i], numels_[i]).view({rows_[i].rows, rows_[i].row_numel});
}

at::Tensor FSDPParamGroup::chunks_of(const at::Tensor& gathered, std::size_t i) const {
  const Rows& r = rows_[i];
  return gathered.view({config_.world, shard_numel_})
      .narrow(1, r.shard_offset, r.chunk * r.row_numel)
      .view({config_.world, r.chunk, r.row_numel});
}

// Ranks whose chunk is whole move in one strided copy, the one partly filled rank in another.
void FSDPParamGroup::copy_rows(const at::Tensor& rows, const at::Tensor& chunks, std::size_t i,
                               bool into_chunks) const {
  const Rows& r = rows_[i];
  if (r.chunk == 0 || r.row_numel == 0) return;
  const std::int64_t whole = r.rows / r.chunk, rest = r.rows % r.chunk;
  auto copy = [&](const at::Tensor& a, const at::Tensor& b) { into_chunks ? b.copy_(a) : a.copy_(b); };
  if (whole > 0)
    copy(rows.narrow(0, 0, whole * r.chunk).view({whole, r.chunk, r.row_numel}), chunks.narrow(0, 0, whole));
  if (rest > 0) copy(rows.narrow(0, whole * r.chunk, rest), chunks.select(0, whole).narrow(0, 0, rest));
}

void FSDPParamGroup::copy_out(const at::Tensor& gathered, const at::Tensor& unsharded) const {
  for (std::size_t i = 0; i < params_.size(); ++i)
    copy_rows(rows_of(unsharded, i), chunks_of(gathered, i), i, /*into_chunks=*/false);
}

at::Tensor FSDPParamGroup::copy_in(const at::Tensor& unsharded, at::ScalarType dtype) const {
  at::Tensor gathered = at::zeros({config_.world * shard_numel_}, unsharded.options().dtype(dtype));
  for (std::size_t i = 0; i < params_.size(); ++i)
    copy_rows(rows_of(unsharded, i), chunks_of(gathered, i), i, /*into_chunks=*/true);
  return gathered;
}

at::Tensor FSDPParamGroup::reduce_scatter_input(at::ScalarType dtype) {
  if (!reduces_subset()) return FlatParamHandle::reduce_scatter_input(dtype);
  at::Tensor input = at::zeros({config_.world * reduce_numel_}, grad_full_.options().dtype(dtype));
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const Rows& r = rows_[i];
    if (r.reduce_offset < 0) continue;
    const at::Tensor chunks = input.view({config_.world, reduce_numel_})
                                  .narrow(1, r.reduce_offset, r.chunk * r.row_numel)
                                  .view({config_.world, r.chunk, r.row_numel});
    const at::Tensor rows = grad_full_.narrow(0, grad_offsets_[i], numels_[i]).view({r.rows, r.row_numel});
    copy_rows(rows, chunks, i, /*into_chunks=*/true);
  }
  free_unsharded_grads();  // copied: the unsharded gradients go now
  return input;
}

at::Tensor FSDPParamGroup::owned_part(const at::Tensor& unsharded) const {
  at::Tensor shard = at::zeros({shard_numel_}, unsharded.options());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const Rows& r = rows_[i];
    if (r.owned == 0) continue;
    shard.narrow(0, r.shard_offset, r.owned * r.row_numel)
        .view({r.owned, r.row_numel})
        .copy_(rows_of(unsharded, i).narrow(0, config_.rank * r.chunk, r.owned));
  }
  return shard;
}

std::pair<std::int64_t, std::int64_t> FSDPParamGroup::shard_slice(std::size_t i) const {
  return {rows_[i].shard_offset, rows_[i].owned * rows_[i].row_numel};
}

OwnedRange FSDPParamGroup::owned_range(std::size_t i) const {
  const Rows& r = rows_[i];
  if (r.owned == 0) return {0, 0};
  return {config_.rank * r.chunk * r.row_numel, r.owned * r.row_numel};
}

std::vector<std::int64_t> FSDPParamGroup::piece_shape(std::size_t i, std::int64_t length) const {
  const at::Tensor& t = params_[i].tensor;
  if (t.dim() == 0) return length == 1 ? std::vector<std::int64_t>{} : std::vector<std::int64_t>{0};
  std::vector<std::int64_t> shape = t.sizes().vec();
  shape[0] = rows_[i].owned;
  return shape;
}

}  // namespace tessera::core::fsdp
