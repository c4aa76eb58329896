#pragma once
/// CUDA tensors over a host communicator: `process_group_backend = "gloo"` on CUDA.
#include "tessera/core/comm.hpp"

namespace tessera::core::detail {

/// Wraps a Gloo communicator (with shared memory between the ranks of a host) for CUDA tensors:
/// each collective copies its inputs to host memory, runs there and copies the result back
/// before it returns. The copies are synchronous on the current CUDA stream, so the result is
/// in that stream's order as after NCCL's wait, and nothing overlaps: slow, and the one way
/// several ranks share a GPU (NCCL refuses two ranks on one device). Tensors already on the
/// host pass through.
CommunicatorPtr stage_through_host(CommunicatorPtr host);

}  // namespace tessera::core::detail
