#pragma once
/// What carries a CPU group's gathers and reductions beside its Gloo group: the shared-memory
/// channel when every rank is on one host, the two-level collectives when the ranks span hosts
/// with as many on each (broadcasts, all-to-all and barriers stay on the group's Gloo).
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "tessera/sdk/types.hpp"

namespace tessera::core::detail {

class CollectiveChannel {
 public:
  virtual ~CollectiveChannel() = default;
  /// Communicator's contracts: contiguous tensors of a dtype reduces() takes for the reductions;
  /// `input` may be `output`'s own chunk. The Work completes on the channel's own thread.
  virtual c10::intrusive_ptr<c10d::Work> all_gather(at::Tensor output, at::Tensor input) = 0;
  virtual c10::intrusive_ptr<c10d::Work> reduce_scatter(at::Tensor output, at::Tensor input, sdk::ReduceOp op) = 0;
  virtual c10::intrusive_ptr<c10d::Work> all_reduce(at::Tensor tensor, sdk::ReduceOp op) = 0;
  /// The path, for the log: "shared memory among the 4 ranks of this host".
  virtual std::string describe() const = 0;
};

}  // namespace tessera::core::detail
