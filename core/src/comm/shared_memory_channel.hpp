#pragma once
/// All-gather, reduce-scatter and all-reduce among the ranks of one host through a POSIX
/// shared-memory segment, beside the group's Gloo process group. Gloo on loopback moves every
/// byte through the kernel's TCP stack (about 1 GB/s on 2 cores, with its threads competing
/// for the cores the ranks compute on); here a rank copies its part into its slot once and
/// each peer reads it once, as NCCL's and DeepSpeed's shared-memory transports do.
///
/// A SerialWorkQueue runs the collectives in issue order, overlapping the caller's compute. Ranks
/// step through rounds of at most one slot per rank; a rank waits for its peers on futexes in
/// the segment and notices a peer that exited (its pid is gone) within a fraction of a second.
/// Sums run in rank order, in fp32 for 16-bit types, so every rank gets the same bits.
#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "collective_channel.hpp"
#include "tessera/sdk/types.hpp"

namespace tessera::core::detail {

class SharedMemoryChannel final : public CollectiveChannel {
 public:
  /// Collective over the group behind `store`, whose ranks all run on this host with `pids`
  /// (host_layout.hpp): the channel, or nullptr (every rank alike) when the segment cannot be
  /// made (/dev/shm full or missing): then Gloo carries everything.
  static std::unique_ptr<SharedMemoryChannel> open(c10d::Store& store, std::int64_t rank, std::int64_t size,
                                                   std::vector<pid_t> pids, double timeout_s);
  ~SharedMemoryChannel() override;

  /// The dtypes the reductions handle; all_gather moves any dtype.
  static bool reduces(at::ScalarType dtype);

  c10::intrusive_ptr<c10d::Work> all_gather(at::Tensor output, at::Tensor input) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(at::Tensor output, at::Tensor input, sdk::ReduceOp op) override;
  c10::intrusive_ptr<c10d::Work> all_reduce(at::Tensor tensor, sdk::ReduceOp op) override;
  std::string describe() const override;
  /// Stops the worker: a collective waiting for its peers fails at once, later ones too.
  void close();

  /// Bytes each rank's slot holds per round, and rounds in flight (the segment's size, which
  /// `tessera plan` counts).
  static constexpr std::int64_t kSlotBytes = std::int64_t{2} << 20;
  static constexpr int kBuffers = 2;
  /// All-reduce chunks from this size on are reduced piece by piece (rank q sums piece q of
  /// every rank's chunk, then the pieces are gathered: a reduce-scatter and an all-gather), so
  /// that a rank reads about twice the chunk instead of world times it; smaller ones, where the
  /// second round's wait costs more than the reads save, are reduced whole by every rank.
  static constexpr std::int64_t kSplitAllReduceBytes = std::int64_t{256} << 10;

 private:
  struct Impl;
  explicit SharedMemoryChannel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessera::core::detail
