#include "fsdp/flat_param.hpp"

#include <algorithm>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "fsdp/storage.hpp"

namespace tessera::core::fsdp {

FlatParamHandle::FlatParamHandle(std::vector<UnitParam> params, const Config& config)
    : params_(std::move(params)), config_(config) {
  for (const auto& p : params_) {
    offsets_.push_back(numel_);
    numels_.push_back(p.tensor.numel());
    numel_ += p.tensor.numel();
  }
  const std::int64_t world = config_.world;
  padded_ = (numel_ + world - 1) / world * world;
  if (padded_ == 0) padded_ = world;
  shard_numel_ = padded_ / world;
  shard_offset_ = config_.rank * shard_numel_;
  // The master shard keeps the parameters' own dtype: fp32 in the mixed modes, the half
  // dtype under *-true (the model never exists in fp32, as on one device).
  if (!params_.empty() && std::all_of(params_.begin(), params_.end(), [&](const UnitParam& p) {
        return p.tensor.scalar_type() == params_[0].tensor.scalar_type();
      }))
    master_dtype_ = params_[0].tensor.scalar_type();
  compute_dtype_ = config_.mixed_precision.param_dtype.value_or(master_dtype_);
}

at::Tensor FlatParamHandle::flatten_params() const {
  torch::NoGradGuard no_grad;
  at::Tensor flat = at::zeros({padded_}, at::TensorOptions().dtype(master_dtype_).device(config_.device));
  for (std::size_t i = 0; i < params_.size(); ++i)
    flat.narrow(0, offsets_[i], numels_[i]).copy_(params_[i].tensor.detach().reshape({-1}));
  return flat;
}

void FlatParamHandle::shard(at::Tensor flat) {
  torch::NoGradGuard no_grad;
  // A one-rank shard group (NO_SHARD, world 1) computing in fp32 where it keeps its shard
  // needs no second copy: the shard is the gathered buffer.
  const bool aliased = config_.world == 1 && shard_numel_ == padded_ && compute_dtype_ == master_dtype_ &&
                       config_.shard_options.device() == config_.device;
  if (aliased) {
    shard_ = flat;
  } else {
    shard_ = at::empty({shard_numel_}, config_.shard_options.dtype(master_dtype_));
    shard_.copy_(owned_part(flat));
  }
  // keep_low_precision_grads: the optimizer sees gradients in param_dtype, as PyTorch's FSDP
  // casts them (for optimizers that step in low precision; a wider reduce_dtype too);
  // otherwise the master dtype.
  at::ScalarType grad_dtype = config_.mixed_precision.keep_low_precision_grads ? compute_dtype_ : master_dtype_;
  // A unit with nothing to train (a frozen backbone's) never receives a gradient: none is kept.
  trainable_ = std::any_of(params_.begin(), params_.end(), [](const UnitParam& p) { return p.tensor.requires_grad(); });
  shard_grad_ = at::zeros({trainable_ ? sharded_grad_numel() : 0}, config_.shard_options.dtype(grad_dtype));
  // The buffers are built one at a time so that deferred init peaks at about one unit.
  full_ = flat.scalar_type() == compute_dtype_ ? flat : flat.to(compute_dtype_);
  flat.reset();
  grad_full_ = at::empty({0}, at::TensorOptions().dtype(compute_dtype_).device(config_.device));
  grad_full_.unsafeGetTensorImpl()->set_sizes_contiguous({unsharded_grad_numel()});  // sized now, allocated in backward
  point_params_at(full_);
  free_unsharded(/*recycle=*/false);  // what sharding frees is really freed
  for (std::size_t i = 0; i < params_.size(); ++i) {
    auto [start, length] = shard_slice(i);
    at::Tensor view = shard_.narrow(0, start, length).view(piece_shape(i, length));
    if (trainable_ && sharded_grad_offset(i) >= 0)
      view.mutable_grad() = shard_grad_.narrow(0, sharded_grad_offset(i), length).view(view.sizes());
    optimizer_views_.push_back(view);
  }
}

std::pair<std::int64_t, std::int64_t> FlatParamHandle::shard_slice(std::size_t i) const {
  std::int64_t lo = std::max(offsets_[i], shard_offset_);
  std::int64_t hi = std::min(offsets_[i] + numels_[i], shard_offset_ + shard_numel_);
  std::int64_t start = std::max<std::int64_t>(0, lo - shard_offset_), length = std::max<std::int64_t>(0, hi - lo);
  return {std::min(start, shard_numel_), length};
}

std::vector<at::Tensor> FlatParamHandle::unflatten(const at::Tensor& flat) const {
  std::vector<at::Tensor> out;
  for (std::size_t i = 0; i < params_.size(); ++i)
    out.push_back(flat.narrow(0, offsets_[i], numels_[i]).view(params_[i].tensor.sizes()));
  return out;
}

void FlatParamHandle::point_params_at(const at::Tensor& unsharded) {
  // LibTorch 2 checks a new view against its storage, so views of a freed buffer (after a
  // reshard) are made while it holds memory for a moment; they stay valid as it comes and goes.
  const bool freed = unsharded.storage().nbytes() < storage_bytes(unsharded);
  if (freed) alloc_storage(unsharded);
  std::vector<at::Tensor> views = unflatten(unsharded);
  for (std::size_t i = 0; i < params_.size(); ++i) params_[i].tensor.set_data(views[i]);
  if (freed) free_storage(unsharded);
}

std::pair<at::Tensor, at::Tensor> FlatParamHandle::all_gather_buffers(c10::Device device) {
  at::Tensor input = shard_.to(device, compute_dtype_, /*non_blocking=*/true);
  if (gathers_in_place()) {
    alloc_storage(full_);
    return {full_, input};
  }
  // The unsharded buffer gets its memory when the gathered data is copied out into it
  // (after_all_gather): a prefetch in flight holds one unit-sized buffer, not two.
  gathered_ = at::empty({config_.world * shard_numel_}, full_.options());
  return {gathered_, input};
}

at::Tensor FlatParamHandle::gathered_rows(std::int64_t first, std::int64_t count) const {
  return copy_in(full_, compute_dtype_).narrow(0, first * shard_numel_, count * shard_numel_).clone();
}

void FlatParamHandle::after_all_gather() {
  if (!gathered_.defined()) return;
  alloc_storage(full_);
  copy_out(gathered_, full_);
  gathered_.reset();
}

void FlatParamHandle::copy_out(const at::Tensor& gathered, const at::Tensor& unsharded) const {
  if (!gathered.is_same(unsharded)) unsharded.copy_(gathered.narrow(0, 0, unsharded.numel()));
}

at::Tensor FlatParamHandle::copy_in(const at::Tensor& unsharded, at::ScalarType dtype) const {
  return unsharded.scalar_type() == dtype ? unsharded : unsharded.to(dtype);
}

at::Tensor FlatParamHandle::gather_unsharded(const at::Tensor& shard, Communicator& group,
                                             const at::TensorOptions& options, const std::string& tag) const {
  at::Tensor gathered = at::empty({config_.world * shard_numel_}, options);
  group.all_gather(gathered, shard.to(options), tag)->wait();
  if (gathers_in_place()) return gathered;
  at::Tensor unsharded = at::empty({padded_}, options);
  copy_out(gathered, unsharded);
  return unsharded;
}

void FlatParamHandle::free_unsharded(bool recycle) {
  // Only a shard that is itself the unsharded buffer stays. A one-rank group's cast copy
  // (bf16 of fp32 shards) is freed too, as PyTorch's FSDP2 reshards at world size 1: kept,
  // it held the whole model in the compute dtype for the whole step.
  if (!unsharded_is_shard()) free_storage(full_, recycle);
}

void FlatParamHandle::attach_unsharded_grads() {
  alloc_storage(grad_full_);
  grad_full_.zero_();
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const std::int64_t offset = unsharded_grad_offset(i);
    if (offset >= 0) params_[i].tensor.mutable_grad() = grad_full_.narrow(0, offset, numels_[i]).view(params_[i].tensor.sizes());
  }
}

at::Tensor FlatParamHandle::reduce_scatter_input(at::ScalarType dtype) {
  at::Tensor input = copy_in(grad_full_, dtype);
  // A copy (another dtype, or the per-parameter layout's rank-major order) lets the unsharded
  // gradients go now rather than when the reduction finishes: a unit less at backward's peak.
  if (!input.is_same(grad_full_)) free_unsharded_grads();
  return input;
}

bool FlatParamHandle::accumulate_sharded_grad(const at::Tensor& reduced) {
  bool copy_in_flight = false;
  if (shard_grad_released_) {  // the first gradient since the step: the same storage, allocated again
    alloc_storage(shard_grad_);
    shard_grad_released_ = false;
    shard_grad_.copy_(reduced);
  } else if (shard_grad_.device() == reduced.device()) {
    shard_grad_.add_(reduced);
  } else if (!shard_grad_written_ && shard_grad_.scalar_type() == reduced.scalar_type()) {
    // cpu_offload: the first gradient since the step goes to pinned memory without blocking
    // (the scheduler waits once for all of them); the stream orders reuse of the source.
    shard_grad_.copy_(reduced, /*non_blocking=*/true);
    copy_in_flight = true;
  } else {
    shard_grad_.add_(reduced.to(shard_grad_.device()));  // accumulating: on the CPU
  }
  shard_grad_written_ = true;
  return copy_in_flight;
}

void FlatParamHandle::free_unsharded_grads() {
  for (auto& p : params_) p.tensor.mutable_grad().reset();
  free_storage(grad_full_);
}

void FlatParamHandle::zero_sharded_grads(bool release) {
  // The optimizer's gradients are views of shard_grad_'s storage: freeing its bytes (not the
  // storage) keeps them valid for when the next reduction allocates them again. Offloaded
  // gradients (pinned host memory) stay: pinning again each step would cost more than it saves.
  if (release && shard_grad_.device() == config_.device && !shard_grad_released_) {
    free_storage(shard_grad_, /*recycle=*/false);
    shard_grad_released_ = true;
  } else if (!shard_grad_released_) {
    shard_grad_.zero_();
  }
  shard_grad_written_ = false;
  for (std::size_t i = 0; trainable_ && i < optimizer_views_.size(); ++i)
    if (!optimizer_views_[i].grad().defined() && sharded_grad_offset(i) >= 0)  // zero_grad(set_to_none) in LibTorch 2.x
      optimizer_views_[i].mutable_grad() = shard_grad_.narrow(0, sharded_grad_offset(i), optimizer_views_[i].numel())
                                               .view(optimizer_views_[i].sizes());
}

void FlatParamHandle::materialize_sharded_grads() {
  if (!shard_grad_released_) return;
  alloc_storage(shard_grad_);
  shard_grad_.zero_();
  shard_grad_released_ = false;
}

OwnedRange FlatParamHandle::owned_range(std::size_t i) const {
  std::int64_t lo = std::max(offsets_[i], shard_offset_);
  std::int64_t hi = std::min(offsets_[i] + numels_[i], shard_offset_ + shard_numel_);
  if (hi <= lo) return {0, 0};
  return {lo - offsets_[i], hi - lo};
}

std::vector<at::Tensor> FlatParamHandle::gather_full_params(Communicator& shard_group, c10::Device device,
                                                            const std::string& tag) {
  return unflatten(gather_unsharded(shard_, shard_group, at::TensorOptions().dtype(master_dtype_).device(device), tag));
}

std::vector<at::Tensor> FlatParamHandle::gather_full_state(const std::vector<at::Tensor>& pieces,
                                                           Communicator& shard_group, c10::Device device,
                                                           const std::string& tag) {
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(device);
  at::Tensor flat_shard = at::zeros({shard_numel_}, fp32);
  for (std::size_t i = 0; i < params_.size(); ++i)
    if (pieces[i].numel() > 0) flat_shard.narrow(0, shard_slice(i).first, pieces[i].numel()).copy_(pieces[i].reshape({-1}));
  std::vector<at::Tensor> out;
  for (const at::Tensor& view : unflatten(gather_unsharded(flat_shard, shard_group, fp32, tag).cpu()))
    out.push_back(view.clone());
  return out;
}

// Only the owned elements of each value are read (no unsharded buffer): a full checkpoint
// mapped from its file (core::load_pickle) then costs each rank its shard, not the model.
void FlatParamHandle::load_full_params(const std::vector<const at::Tensor*>& values) {
  torch::NoGradGuard no_grad;
  // A parameter without a value keeps its own (load_state_dict(strict=False)); the padding is
  // zero from shard() on, as nothing steps on it.
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const OwnedRange owned = owned_range(i);
    if (values[i] == nullptr || owned.length == 0) continue;
    shard_.narrow(0, shard_slice(i).first, owned.length)
        .copy_(values[i]->reshape({-1}).narrow(0, owned.start, owned.length));
  }
}

at::Tensor FlatParamHandle::owned_part(const at::Tensor& unsharded) const {
  return unsharded.narrow(0, shard_offset_, shard_numel_);
}

void FlatParamHandle::write_back(const at::Tensor& piece, const at::Tensor& before) {
  if (!before.defined()) return void(shard_.copy_(piece));
  shard_.copy_(at::where(piece.ne(before), piece.to(master_dtype_), shard_.to(piece.device())));
}

void FlatParamHandle::load_local_shard(const at::Tensor& value) { shard_.copy_(value); }

std::int64_t FlatParamHandle::sharded_bytes() const {
  return static_cast<std::int64_t>(storage_bytes(shard_) + storage_bytes(shard_grad_));
}

}  // namespace tessera::core::fsdp
