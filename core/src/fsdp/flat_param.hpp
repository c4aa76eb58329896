#pragma once
/// The flat-parameter layout (PyTorch FSDP1's FlatParamHandle): a unit's parameters are
/// views into one padded 1-D buffer, sharded as equal contiguous pieces over the shard group,
/// so one all-gather and one reduce-scatter move a whole unit. The optimizer steps on
/// per-parameter views of the master shard.
#include <vector>

#include "fsdp/layout.hpp"
#include "tessera/sdk/precision.hpp"

namespace tessera::core::fsdp {

class FlatParamHandle : public UnitLayout {
 public:
  struct Config {
    std::int64_t rank = 0;        ///< in the shard group
    std::int64_t world = 1;       ///< shard group size
    c10::Device device{c10::kCPU};  ///< where the unit computes and collectives run
    at::TensorOptions shard_options;  ///< where master shards live (device, or pinned CPU)
    sdk::MixedPrecisionPolicy mixed_precision;
  };

  /// Plans the flat layout of `params` (no memory yet: see shard()).
  FlatParamHandle(std::vector<UnitParam> params, const Config& config);

  /// The parameters' current values as one padded flat buffer in the master dtype.
  at::Tensor flatten_params() const;
  /// Takes `flat` (as flatten_params() returns it, possibly on another device) as the unit's
  /// values: keeps this rank's shard, points the parameters at the unsharded buffer, frees it.
  void shard(at::Tensor flat);
  /// The unsharded flat buffer's element count and where parameter i starts in it.
  std::int64_t padded_numel() const { return padded_; }
  std::int64_t offset(std::size_t i) const { return offsets_[i]; }

  const std::vector<UnitParam>& params() const override { return params_; }
  at::ScalarType compute_dtype() const override { return compute_dtype_; }
  at::ScalarType master_dtype() const override { return master_dtype_; }

  bool unsharded_is_shard() const override { return full_.is_same(shard_); }
  std::pair<at::Tensor, at::Tensor> all_gather_buffers(c10::Device device) override;
  at::Tensor gathered_rows(std::int64_t first, std::int64_t count) const override;
  void free_unsharded(bool recycle) override;

  void attach_unsharded_grads() override;
  at::Tensor reduce_scatter_input(at::ScalarType dtype) override;
  std::int64_t shard_numel() const override { return shard_numel_; }
  bool accumulate_sharded_grad(const at::Tensor& reduced) override;
  void free_unsharded_grads() override;

  const std::vector<at::Tensor>& optimizer_tensors() const override { return optimizer_views_; }
  std::vector<at::Tensor> sharded_grads() const override {
    return trainable_ ? std::vector<at::Tensor>{shard_grad_} : std::vector<at::Tensor>{};
  }
  void zero_sharded_grads(bool release) override;
  void materialize_sharded_grads() override;

  OwnedRange owned_range(std::size_t i) const override;
  std::vector<at::Tensor> gather_full_params(Communicator& shard_group, c10::Device device,
                                             const std::string& tag) override;
  std::vector<at::Tensor> gather_full_state(const std::vector<at::Tensor>& pieces, Communicator& shard_group,
                                            c10::Device device, const std::string& tag) override;
  void load_full_params(const std::vector<const at::Tensor*>& values) override;
  at::Tensor owned_part(const at::Tensor& unsharded) const override;
  void write_back(const at::Tensor& piece, const at::Tensor& before) override;
  void point_params_at(const at::Tensor& unsharded) override;
  const at::Tensor& unsharded() const override { return full_; }
  at::Tensor local_shard() const override { return shard_; }
  void load_local_shard(const at::Tensor& value) override;
  std::int64_t sharded_bytes() const override;

  void after_all_gather() override;

 protected:
  // What a layout of another shape (FSDPParamGroup) redefines. The unsharded buffer holds the
  // parameters one after the other; the gathered buffer is [world, shard_numel()], rank r's
  // shard in row r. For flat parameters the two are the same buffer.
  /// Whether the all-gather writes straight into the unsharded buffer.
  virtual bool gathers_in_place() const { return true; }
  /// unsharded := the gathered buffer's contents in the unsharded order.
  virtual void copy_out(const at::Tensor& gathered, const at::Tensor& unsharded) const;
  /// The gathered-order buffer of `unsharded` in `dtype` (the reduce-scatter's input).
  virtual at::Tensor copy_in(const at::Tensor& unsharded, at::ScalarType dtype) const;
  /// Where parameter i's owned elements sit in the shard: [start, start + length).
  virtual std::pair<std::int64_t, std::int64_t> shard_slice(std::size_t i) const;
  /// Where parameter i's gradient lives in the unsharded gradient buffer and in the sharded
  /// gradient (-1: nowhere, a frozen parameter of a layout that keeps gradients of the trainable
  /// ones only), and those buffers' sizes; the flat layout keeps one for every parameter.
  virtual std::int64_t unsharded_grad_offset(std::size_t i) const { return offsets_[i]; }
  virtual std::int64_t unsharded_grad_numel() const { return padded_; }
  virtual std::int64_t sharded_grad_offset(std::size_t i) const { return shard_slice(i).first; }
  virtual std::int64_t sharded_grad_numel() const { return shard_numel_; }
  /// The shape the optimizer sees parameter i's piece of `length` elements in.
  virtual std::vector<std::int64_t> piece_shape(std::size_t, std::int64_t length) const { return {length}; }

  /// Splits an unsharded buffer into each parameter's full-shape view.
  std::vector<at::Tensor> unflatten(const at::Tensor& flat) const;
  /// all_gather of this rank's shard into a full unsharded buffer of `options` (collective).
  at::Tensor gather_unsharded(const at::Tensor& shard, Communicator& group, const at::TensorOptions& options,
                              const std::string& tag) const;

  std::vector<UnitParam> params_;
  Config config_;
  std::vector<std::int64_t> offsets_, numels_;
  std::int64_t numel_ = 0, padded_ = 0, shard_numel_ = 0, shard_offset_ = 0;
  at::ScalarType compute_dtype_ = at::kFloat;
  at::ScalarType master_dtype_ = at::kFloat;  // of the shard: the parameters' own (bf16 under bf16-true)
  at::Tensor shard_, shard_grad_, full_, grad_full_;
  at::Tensor gathered_;  // the all-gather's output while it is in flight (when not in place)
  std::vector<at::Tensor> optimizer_views_;
  bool trainable_ = true;             // a parameter requires grad: the unit has sharded gradients
  bool shard_grad_written_ = false;   // since the last optimizer step (cpu_offload copies into it)
  bool shard_grad_released_ = false;  // its storage freed by zero_sharded_grads(release)
};

}  // namespace tessera::core::fsdp
