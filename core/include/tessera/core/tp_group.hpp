#pragma once
/// The SDK's TensorParallelGroup over a core communicator (the device mesh's "tp" group), for
/// strategies that build a model's sdk::ParallelContext.
#include <memory>
#include <utility>
#include <vector>

#include "tessera/core/comm.hpp"
#include "tessera/core/tensor_piece.hpp"
#include "tessera/sdk/tensor_parallel.hpp"

namespace tessera::core {

/// Blocking sum and gather over `tp` (tagged "tensor-parallel ..." in the collective ledger).
std::shared_ptr<sdk::TensorParallelGroup> make_tensor_parallel_group(CommunicatorPtr tp);

/// Rank 0 of `size` ranks, communicating nothing: for `tessera plan`, which parallelizes a
/// model over it to lay out and trace one real rank's pieces. Sums leave the tensor as it is and
/// gathers repeat it: the shapes and the autograd graph are a rank's, the values meaningless.
std::shared_ptr<sdk::TensorParallelGroup> make_planning_tensor_parallel_group(std::int64_t size);

/// Where rank `rank`'s `local` piece of a parameter placed by `placement` over `size` ranks sits
/// in the full tensor, for state dicts and sharded checkpoints: one box per stride part, each
/// with the view of `local` that holds it (one whole box when replicated).
std::vector<std::pair<TensorPiece, at::Tensor>> tensor_parallel_pieces(const at::Tensor& local,
                                                                       sdk::TensorParallelPlacement placement,
                                                                       std::int64_t rank, std::int64_t size);

}  // namespace tessera::core
