#pragma once
/// When each unit is gathered, freed and reduced (PyTorch's _runtime_utils / FSDP2's
/// FSDPState hooks): unshard before a unit runs with the next unit prefetched (the first
/// forward's execution order), reshard after, re-gather in backward, reduce-scatter each
/// unit's gradients as soon as they are complete with at most two reductions in flight,
/// and no_sync accumulation. Implements the autograd seam's hooks and the forward seam.
#include <deque>
#include <memory>
#include <vector>

#include "tessera/core/comm.hpp"
#include "fsdp/autograd_seam.hpp"
#include "tessera/core/fsdp/options.hpp"
#include "fsdp/unit.hpp"

namespace tessera::core::fsdp {

class Scheduler final : public UnitHooks {
 public:
  /// `units`: children in registration order, the root last (owned by the caller, who keeps
  /// them alive as long as the scheduler). `replicated`: parameters outside every unit whose
  /// gradients are all-reduced (ignored modules, exempt norm layers).
  Scheduler(std::vector<std::unique_ptr<FSDPUnit>>& units, std::vector<at::Tensor> replicated,
            const FSDPOptions& options, CommunicatorPtr shard_group, CommunicatorPtr replicate_group,
            c10::Device device);
  ~Scheduler() override;

  /// Installs the forward seam (sdk::UnitRunner) on every child unit's module and the
  /// gradient-ready hooks on every unit.
  void install();

  enum class Phase { forward, backward, prefetch_forward, prefetch_backward };
  void unshard(FSDPUnit& unit, Phase phase);
  void reshard(FSDPUnit& unit);

  /// Before a step's forward: gathers the root unit (and attaches gradients when training).
  void begin_forward(bool training);
  /// After a forward without backward (evaluation): frees what was gathered.
  void end_forward();
  /// Around loss.backward(): with `sync` false gradients accumulate unsharded (no_sync).
  void begin_backward(bool sync);
  void finish_backward();
  /// After the optimizer step: zeroes the sharded and replicated gradients.
  void zero_grad();
  /// Whether gradients may be attached outside grad mode (a training step, or sync).
  bool training_step_active() const { return sync_ || accumulating_; }
  /// Whether a training step's forward ran and its synchronising backward has not finished.
  bool accumulating() const { return accumulating_; }
  /// The most units (the root aside) gathered or gathering at once so far.
  std::int64_t peak_units_gathered() const { return peak_units_gathered_; }

  // UnitHooks
  void pre_backward(FSDPUnit& unit) override;
  void post_backward(FSDPUnit& unit) override;

  /// Runs a unit's forward between unshard and reshard (the sdk::UnitRunner of its module).
  std::vector<at::Tensor> run_forward(FSDPUnit& unit, sdk::UnitFunction forward, const std::vector<at::Tensor>& inputs);

 private:
  void finish_gather(FSDPUnit& unit);
  void keep_post_forward_shard(FSDPUnit& unit);
  /// Frees every unit's gathered data and what it kept after forward.
  void reshard_all();
  std::int64_t units_gathered() const;
  void attach_gradients(FSDPUnit& unit);
  void reduce_gradients(FSDPUnit& unit);
  void finish_reduction(FSDPUnit& unit);
  void reduce_replicated_gradients();
  FSDPUnit* previous_unit(const FSDPUnit& unit) const;
  FSDPUnit* next_unit(const FSDPUnit& unit) const;
  void record_forward(FSDPUnit& unit);
  void freeze_order();

  std::vector<std::unique_ptr<FSDPUnit>>& units_;
  std::vector<at::Tensor> replicated_;
  const FSDPOptions& options_;
  CommunicatorPtr shard_group_;
  CommunicatorPtr replicate_group_;
  c10::Device device_;
  std::deque<FSDPUnit*> reducing_;  // reductions launched and not finished, oldest first
  std::vector<FSDPUnit*> order_;    // units in the first forward's execution order
  bool order_frozen_ = false;
  bool offload_copies_pending_ = false;  // cpu_offload gradient copies launched, not waited for
  bool sync_ = true;
  bool accumulating_ = false;
  std::int64_t peak_units_gathered_ = 0;
};

}  // namespace tessera::core::fsdp
