#pragma once
/// An in-process world of N ranks for unit tests (PyTorch's fake process group, but the
/// data really moves): run_fake_ranks() runs `body` on N threads, each with its own
/// core::Communicator whose collectives exchange tensors through shared memory with the
/// semantics of the c10d communicator (same results for the same inputs, same byte counts
/// in stats()). Layout, state-dict and mesh logic is then testable without processes; the
/// multi-process tests over Gloo stay the proof of parity.
///
/// Collectives start at the call (inputs are copied then) and complete in wait(), which
/// blocks until every rank of the group has started the same collective. A rank that calls
/// a different collective than the others (kind, size, root or op), or returns while the
/// others wait for it, fails with a message naming both sides; a collective still
/// incomplete after `timeout` fails every waiting rank.
#include <chrono>
#include <functional>

#include "tessera/core/comm.hpp"

namespace tessera::testing {

/// Runs `body(world)` for ranks 0..world_size-1 on their own threads and joins them. Throws
/// sdk::Error listing every rank that threw (with its message) once all have stopped.
void run_fake_ranks(int world_size, const std::function<void(core::CommunicatorPtr world)>& body,
                    std::chrono::seconds timeout = std::chrono::seconds(60));

}  // namespace tessera::testing
