#include "fsdp/memory_plan.hpp"

#include <algorithm>

#include <c10/core/ScalarType.h>

#include "tessera/core/comm.hpp"

namespace tessera::core::fsdp {

namespace {

double bytes_of(std::int64_t numel, c10::ScalarType dtype) {
  return static_cast<double>(numel) * static_cast<double>(c10::elementSize(dtype));
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

const char* name_of(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::FULL_SHARD: return "FULL_SHARD";
    case ShardingStrategy::SHARD_GRAD_OP: return "SHARD_GRAD_OP";
    case ShardingStrategy::NO_SHARD: return "NO_SHARD";
    case ShardingStrategy::HYBRID_SHARD: return "HYBRID_SHARD";
  }
  return "?";
}

std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return "fp32";
    case c10::ScalarType::BFloat16: return "bf16";
    case c10::ScalarType::Half: return "fp16";
    case c10::ScalarType::Double: return "fp64";
    default: return c10::toString(t);
  }
}

}  // namespace

UnitShard shard_unit(const PlannedUnitSizes& unit, ParamLayout layout, std::int64_t shard_size) {
  UnitShard out;
  std::int64_t trainable = 0;
  for (const PlannedParam& p : unit.params) {
    out.numel += p.rows * p.row_numel;
    if (p.trainable) trainable += p.rows * p.row_numel;
    if (layout == ParamLayout::per_parameter) {
      out.shard += ceil_div(p.rows, shard_size) * p.row_numel;
      if (p.trainable) out.trainable_shard += ceil_div(p.rows, shard_size) * p.row_numel;
    }
  }
  if (layout == ParamLayout::flat) {
    std::int64_t padded = ceil_div(out.numel, shard_size) * shard_size;
    out.shard = (padded == 0 ? shard_size : padded) / shard_size;
    out.trainable_shard = trainable == out.numel ? out.shard : ceil_div(trainable, shard_size);
  } else if (out.shard == 0) {
    out.shard = 1;
    out.trainable_shard = trainable > 0 ? 1 : 0;
  }
  out.gathered = shard_size * out.shard;
  return out;
}

sdk::MemoryLayout plan_sharded_memory(const ShardedPlanInput& in) {
  sdk::MemoryLayout out;
  const std::int64_t s = std::max<std::int64_t>(1, in.shard_size);
  std::vector<UnitShard> shards;
  for (const auto& u : in.units) shards.push_back(shard_unit(u, in.layout, s));
  const std::size_t n_units = in.units.size();
  const bool has_root = n_units > 0 && in.units.back().name == "<root>";
  const std::size_t children = has_root ? n_units - 1 : n_units;
  UnitShard root = has_root ? shards.back() : UnitShard{};
  std::size_t largest = 0;
  for (std::size_t i = 0; i < children; ++i)
    if (shards[i].gathered > shards[largest].gathered) largest = i;
  UnitShard big = children > 0 ? shards[largest] : UnitShard{};

  // A unit with nothing to train (frozen) has no gradients, sharded or unsharded, and no
  // reduction: `trained_*` count the others.
  std::int64_t shard_total = 0, trainable_total = 0, gathered_total = 0, child_gathered_total = 0;
  std::int64_t trained_shard_total = 0, trained_gathered_total = 0, trained_big = 0;
  // A per-parameter unit keeps, and reduces, the gradients of its trainable parameters only
  // (FSDPParamGroup); a flat one its whole flat gradient (frozen parts as zeros).
  for (std::size_t i = 0; i < n_units; ++i) {
    shard_total += shards[i].shard;
    trainable_total += shards[i].trainable_shard;
    gathered_total += shards[i].gathered;
    if (i < children) child_gathered_total += shards[i].gathered;
    if (shards[i].trainable_shard == 0) continue;
    const std::int64_t grad_shard = in.layout == ParamLayout::per_parameter ? shards[i].trainable_shard : shards[i].shard;
    trained_shard_total += grad_shard;
    trained_gathered_total += grad_shard * s;
    if (i < children) trained_big = std::max(trained_big, grad_shard * s);
  }
  const std::int64_t trained_root =
      root.trainable_shard == 0 ? 0 : in.layout == ParamLayout::per_parameter ? root.trainable_shard * s : root.gathered;
  out.units = static_cast<std::int64_t>(n_units);
  out.largest_unit = children > 0 ? in.units[largest].name + " (" + std::to_string(big.numel) + " elements)"
                                  : "<root> (" + std::to_string(root.numel) + " elements)";

  // Persistent: master shards, their gradients, the optimizer's moments on the shards.
  out.param_bytes = bytes_of(shard_total, in.master_dtype) + bytes_of(in.replicated_numel, in.master_dtype);
  out.grad_bytes = bytes_of(trained_shard_total, in.grad_dtype) + bytes_of(in.replicated_trainable_numel, in.master_dtype);
  out.optimizer_numel = trainable_total + in.replicated_trainable_numel;  // frozen parameters: no moments
  out.optimizer_dtype = in.master_dtype;

  // Gathered units. A one-rank shard group computing in the master dtype where it keeps its
  // shard aliases the shard (nothing gathered: flat_param.cpp); in another dtype, or from host
  // memory (cpu_offload), its device copies are gathered and freed as shards are.
  const bool aliased = s == 1 && in.compute_dtype == in.master_dtype && !in.offloaded;
  const bool reshards = !aliased && (in.sharding_strategy == ShardingStrategy::FULL_SHARD ||
                                     in.sharding_strategy == ShardingStrategy::HYBRID_SHARD);
  std::int64_t at_once = 1;
  if (reshards) {
    // The running unit and one prefetched (backward_prefetch in backward, forward_prefetch in
    // forward), capped by limit_all_gathers; the root stays gathered from forward to backward.
    if (in.backward_prefetch != BackwardPrefetch::NONE || in.forward_prefetch) at_once = 2;
    if (in.max_gathered_units > 0) at_once = std::min(at_once, in.max_gathered_units);
    at_once = std::min<std::int64_t>(at_once, static_cast<std::int64_t>(children));
    out.gathered_bytes = bytes_of(root.gathered + at_once * big.gathered, in.compute_dtype);
    if (in.reshard_group > 1 && in.reshard_group < s)  // 1/k of every unit kept from forward to backward
      out.gathered_bytes += bytes_of(child_gathered_total / in.reshard_group, in.compute_dtype);
  } else if (!aliased) {
    out.gathered_bytes = bytes_of(gathered_total, in.compute_dtype);  // SHARD_GRAD_OP, NO_SHARD
  }

  // A reduce-scatter's input is a second buffer when cast to reduce_dtype, and always under the
  // per-parameter layout (its shards' gathered order differs from the parameters').
  const bool second_input = in.reduce_dtype != in.compute_dtype || in.layout == ParamLayout::per_parameter;

  // Backward: the root's unsharded gradient for the whole of it, the unit computing its
  // gradient and the two older units whose reductions are in flight; when their inputs are
  // copies, the copies (collective buffers) stand for those two: a unit's unsharded gradient
  // goes once copied (flat_param.cpp). Gathered from forward on (SHARD_GRAD_OP), every unit
  // whose backward is done frees its parameters: the peak is backward's start, the root's and
  // one unit's gradients beside every unit. Accumulating without reducing (PyTorch's
  // no_sync), every unit's, from the first micro-batch to the last.
  const bool accumulates_unsharded = in.micro_batches > 1 && !in.reduce_every_micro_batch;
  const bool one_unit_computing = (s > 1 && second_input) || (!reshards && !aliased);
  const std::int64_t grads_at_once =
      std::min<std::int64_t>(one_unit_computing ? 1 : 3, static_cast<std::int64_t>(children));
  out.unsharded_grad_bytes = accumulates_unsharded
                                 ? bytes_of(trained_gathered_total, in.compute_dtype)
                                 : bytes_of(trained_root + grads_at_once * trained_big, in.compute_dtype);

  // Collective buffers at once: per reduction in flight, its output (a shard), over Gloo the
  // all-to-all's receive buffer (the input's size), and the input itself when it is a second
  // buffer; the per-parameter layout's all-gather output beside the unsharded parameters, and
  // the cast all-gather input. Shared memory reduces from the peers' slots and NCCL from the input
  // itself: no receive buffer. Shared memory: a segment per group of more than one rank that
  // carries data: the shard group's, the replicas' (their all-reduce), the tensor-parallel
  // group's (the model's own all-reduces) and the post-forward reshard group's.
  const bool gloo = in.transport == PlannedTransport::gloo;
  if (in.transport == PlannedTransport::shared_memory)
    out.collective_buffer_bytes =
        core::shared_memory_segment_bytes(s) + core::shared_memory_segment_bytes(in.replicate_size) +
        core::shared_memory_segment_bytes(in.tp_size) +
        (in.reshard_group > 1 && in.reshard_group < s ? core::shared_memory_segment_bytes(in.reshard_group) : 0.0);
  if (s > 1) {
    const std::int64_t in_flight = std::min<std::int64_t>(2, static_cast<std::int64_t>(n_units));
    const std::int64_t unit_gathered = big.gathered > 0 ? big.gathered : root.gathered;  // the largest unit
    const double unit_reduction = bytes_of(unit_gathered, in.reduce_dtype);
    out.collective_buffer_bytes += static_cast<double>(in_flight) * bytes_of(unit_gathered / s, in.reduce_dtype);
    if (!gloo) {
      if (second_input) out.collective_buffer_bytes += static_cast<double>(in_flight) * unit_reduction;
    } else {
      out.collective_buffer_bytes += static_cast<double>(in_flight) * unit_reduction * (second_input ? 2 : 1);
      // Gloo's list all-gather stages its output in one flat tensor of the gathered size.
      out.collective_buffer_bytes += bytes_of(unit_gathered, in.compute_dtype);
    }
    if (in.layout == ParamLayout::per_parameter) out.collective_buffer_bytes += bytes_of(big.gathered, in.compute_dtype);
    if (in.compute_dtype != in.master_dtype) out.collective_buffer_bytes += bytes_of(at_once * big.shard, in.compute_dtype);
  }

  // Collectives: the all-gathers of one micro-batch, the reductions of the optimizer step.
  const std::string c = dtype_name(in.compute_dtype), r = dtype_name(in.reduce_dtype);
  const double reductions = in.reduce_every_micro_batch ? static_cast<double>(in.micro_batches) : 1.0;
  const std::string every = in.reduce_every_micro_batch && in.micro_batches > 1
                                ? ", every one of " + std::to_string(in.micro_batches) + " micro-batches"
                                : "";
  if (s > 1) {
    out.collectives.push_back({"all_gather", "forward all-gather of every unit (" + c + ")",
                               bytes_of(gathered_total, in.compute_dtype), s});
    if (reshards && children > 1) {
      // The unit forward ran last (the last child) stays gathered for backward, which starts with it.
      const std::int64_t group = in.reshard_group > 1 && in.reshard_group < s ? in.reshard_group : s;
      out.collectives.push_back({"all_gather", "backward re-gather of the units but the last (" + c + ")",
                                 bytes_of(child_gathered_total - shards[children - 1].gathered, in.compute_dtype),
                                 group});
    }
    out.collectives.push_back({"reduce_scatter", "gradient reduce-scatter of every unit (" + r + every + ")",
                               reductions * bytes_of(trained_gathered_total, in.reduce_dtype), s});
  }
  if (in.replicate_size > 1)
    out.collectives.push_back({"all_reduce", "gradient all-reduce of the shards over replicas (" + r + every + ")",
                               reductions * bytes_of(trained_shard_total, in.reduce_dtype), in.replicate_size});
  if (in.replicated_trainable_numel > 0 && s * in.replicate_size > 1)
    out.collectives.push_back({"all_reduce", "gradient all-reduce of the ignored (replicated) parameters (fp32" + every + ")",
                               reductions * bytes_of(in.replicated_trainable_numel, c10::ScalarType::Float), s * in.replicate_size});

  out.description = in.strategy + " " + name_of(in.sharding_strategy) + ": " + std::to_string(children) +
                    " unit(s) + root, " + (in.layout == ParamLayout::flat ? "flat padded" : "per-parameter dim-0") +
                    " shards over " + std::to_string(s) + " rank(s)" +
                    (in.replicate_size > 1 ? " x " + std::to_string(in.replicate_size) + " replicas" : "") +
                    (in.tp_size > 1 ? " x tp " + std::to_string(in.tp_size) : "") + "; master " +
                    dtype_name(in.master_dtype) + ", gathered " + c + ", reduced " + r + ", optimizer grads " +
                    dtype_name(in.grad_dtype) + "; " + std::to_string(reshards ? at_once : 0) +
                    " unit(s) gathered at once besides the root" + (aliased ? " (one rank: shards are the parameters)" : "") +
                    (accumulates_unsharded ? "; every unit keeps its unsharded gradient over " +
                                                 std::to_string(in.micro_batches) + " micro-batches"
                                           : "");
  return out;
}

}  // namespace tessera::core::fsdp
