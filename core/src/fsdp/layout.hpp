#pragma once
/// How one unit's parameters are laid out across the ranks of its shard group: the one
/// thing flat-parameter FSDP (FSDP1) and per-parameter FSDP (FSDP2) do differently. The
/// scheduler, the state dicts and summon_full_params work against this interface only.
/// (PyTorch: FSDP1's FlatParamHandle in _flat_param.py, FSDP2's FSDPParam in _fsdp_param.py.)
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "tessera/core/comm.hpp"

namespace tessera::core::fsdp {

/// One original parameter of a unit: the module's own tensor (always of its full shape) and
/// every name it has in the network (several when tied).
struct UnitParam {
  std::vector<std::string> names;
  at::Tensor tensor;
};

/// The part of an original parameter this rank owns, as a range of its flattened elements.
struct OwnedRange {
  std::int64_t start = 0;
  std::int64_t length = 0;
};

class UnitLayout {
 public:
  virtual ~UnitLayout() = default;

  virtual const std::vector<UnitParam>& params() const = 0;
  /// The dtype the unit gathers and computes in, and the master shards' dtype.
  virtual at::ScalarType compute_dtype() const = 0;
  virtual at::ScalarType master_dtype() const = 0;

  // --- all-gather (unshard) ---
  /// Gathering changes nothing: this rank's shard is the unsharded data (one-rank groups).
  virtual bool unsharded_is_shard() const = 0;
  /// Returns {output, input} of the unit's one all-gather (input: this rank's shard in compute
  /// dtype on `device`); the unsharded storage exists once after_all_gather() returned.
  virtual std::pair<at::Tensor, at::Tensor> all_gather_buffers(c10::Device device) = 0;
  /// After the all-gather completed: makes the gathered data the parameters' (per-parameter
  /// layouts copy it out of the collective's buffer; the flat layout gathered in place).
  virtual void after_all_gather() {}
  /// Rows [first, first + count) of the all-gather's output ([world, shard_numel()]) made from
  /// the gathered parameters, as a new tensor: what a rank keeps after forward to re-gather
  /// it in backward within a smaller group (reshard_after_forward = k).
  virtual at::Tensor gathered_rows(std::int64_t first, std::int64_t count) const = 0;
  /// Frees the unsharded storage (the module's parameters keep their shapes, not their data).
  virtual void free_unsharded(bool recycle) = 0;

  // --- gradients (reduce-scatter) ---
  /// Allocates zeroed unsharded gradients and points the parameters' .grad at them.
  virtual void attach_unsharded_grads() = 0;
  /// The unsharded gradients as the reduce-scatter's input, in `dtype`; when that is a copy,
  /// the unsharded gradients are freed already (as free_unsharded_grads()).
  virtual at::Tensor reduce_scatter_input(at::ScalarType dtype) = 0;
  /// Elements of this rank's shard (the all-gather's input).
  virtual std::int64_t shard_numel() const = 0;
  /// Elements of this rank's reduced gradient (the reduce-scatter's output): shard_numel(), or
  /// fewer where a layout reduces its trainable parameters only (frozen ones beside them).
  virtual std::int64_t reduce_numel() const { return shard_numel(); }
  /// Adds this rank's reduced gradient into the sharded gradient. Returns true when it left
  /// a device-to-host copy in flight (cpu_offload), to be waited for on the stream.
  virtual bool accumulate_sharded_grad(const at::Tensor& reduced) = 0;
  /// Drops the parameters' .grad and frees the unsharded gradients.
  virtual void free_unsharded_grads() = 0;

  // --- what the optimizer steps on ---
  /// Per original parameter: this rank's piece of it (possibly empty), with its gradient.
  virtual const std::vector<at::Tensor>& optimizer_tensors() const = 0;
  /// The sharded gradients, as disjoint tensors (for the norm and zeroing).
  virtual std::vector<at::Tensor> sharded_grads() const = 0;
  /// After an optimizer step: zeroes the sharded gradients, or with `release` frees their
  /// storage until the next reduction writes them (torch's zero_grad(set_to_none=True):
  /// forward runs without them); re-attaches any the optimizer set to none.
  virtual void zero_sharded_grads(bool release) = 0;
  /// Before an optimizer step: zeroed storage for released gradients no reduction wrote (a
  /// unit unused this step), so that the optimizer reads zeros, as without release.
  virtual void materialize_sharded_grads() = 0;

  // --- pieces of the original tensors (state dicts, optimizer state, summon) ---
  /// Which elements of parameter `i` this rank owns.
  virtual OwnedRange owned_range(std::size_t i) const = 0;
  /// The full value of every parameter in the master dtype on `device` (collective over the
  /// shard group), without touching the module's parameters.
  virtual std::vector<at::Tensor> gather_full_params(Communicator& shard_group, c10::Device device,
                                                     const std::string& tag) = 0;
  /// This rank's piece of a per-parameter state (optimizer moments): `pieces[i]` shaped like
  /// optimizer_tensors()[i]; gathered into full tensors shaped like each parameter (collective).
  virtual std::vector<at::Tensor> gather_full_state(const std::vector<at::Tensor>& pieces, Communicator& shard_group,
                                                    c10::Device device, const std::string& tag) = 0;
  /// Loads full values (null: leave that parameter) into this rank's shard.
  virtual void load_full_params(const std::vector<const at::Tensor*>& values) = 0;
  /// This rank's part of an unsharded buffer (the gathered one, or a copy of it): what
  /// write_back() takes.
  virtual at::Tensor owned_part(const at::Tensor& unsharded) const = 0;
  /// Writes this rank's part (as owned_part() returns it) into the master shard;
  /// with `before` defined only the elements that differ from it (so a param_dtype below the
  /// master's does not round unchanged master values).
  virtual void write_back(const at::Tensor& piece, const at::Tensor& before) = 0;
  /// Points the module's parameters at `unsharded` (the gathered buffer or a CPU copy of it).
  virtual void point_params_at(const at::Tensor& unsharded) = 0;
  /// The gathered buffer itself (for summon_full_params with offload_to_cpu).
  virtual const at::Tensor& unsharded() const = 0;
  /// LOCAL state dict: this rank's whole shard as stored, and its inverse.
  virtual at::Tensor local_shard() const = 0;
  virtual void load_local_shard(const at::Tensor& value) = 0;
  /// Bytes of sharded state held on this rank (master shard + sharded gradient).
  virtual std::int64_t sharded_bytes() const = 0;
};

}  // namespace tessera::core::fsdp
