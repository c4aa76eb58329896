#pragma once
/// Gathers and reductions of a group whose ranks span hosts, L ranks on each of H hosts, in two
/// levels: the ranks of a host meet in shared memory, and only the ranks with the same place
/// on their host ("columns") talk across hosts, through a Gloo group of their own. Each byte
/// of a reduction crosses between hosts once per rank instead of once per pair of ranks:
///   reduce-scatter  = within the host, reduce-scatter by place (each rank gets its place's
///                     chunks for every host, summed over its host); across, reduce-scatter those;
///   all-gather      = across, all-gather the column's chunks; within, all-gather those;
///   all-reduce      = within, reduce-scatter into L pieces; across, all-reduce each piece;
///                     within, all-gather the pieces.
/// Sums run in a fixed order (rank order within a host, Gloo's fixed order across), so every
/// run gives the same bits; 16-bit data is summed across hosts in fp32, and a mean divides there.
#include <memory>
#include <string>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "collective_channel.hpp"
#include "gloo_collectives.hpp"
#include "host_layout.hpp"
#include "serial_work_queue.hpp"
#include "shared_memory_channel.hpp"

namespace tessera::core::detail {

class HierarchicalCollectives final : public CollectiveChannel {
 public:
  /// `within`: this host's ranks' channel; `across`: the Gloo group of this rank's column, whose
  /// rank h is the rank with this place on host h; `across_path` says how it is reached.
  HierarchicalCollectives(HostLayout layout, std::unique_ptr<SharedMemoryChannel> within,
                          c10::intrusive_ptr<c10d::ProcessGroupGloo> across, std::string across_path, double timeout_s);
  ~HierarchicalCollectives() override;

  c10::intrusive_ptr<c10d::Work> all_gather(at::Tensor output, at::Tensor input) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(at::Tensor output, at::Tensor input, sdk::ReduceOp op) override;
  c10::intrusive_ptr<c10d::Work> all_reduce(at::Tensor tensor, sdk::ReduceOp op) override;
  std::string describe() const override;

 private:
  /// Waits for the cross-host half, then completes it locally.
  void finish(GlooIssued issued) const;

  HostLayout layout_;
  std::int64_t hosts_, per_host_, size_;
  /// Group rank of row l * hosts + h of the place-major order the within-host level works in.
  at::Tensor place_major_;
  std::unique_ptr<SharedMemoryChannel> within_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> across_;
  std::string across_path_;
  double timeout_s_;
  std::shared_ptr<ReceiveBufferPool> pool_ = std::make_shared<ReceiveBufferPool>();
  SerialWorkQueue queue_;  ///< last: its thread stops before the rest goes
};

}  // namespace tessera::core::detail
