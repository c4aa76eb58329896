#include "tessera/sdk/tensor_parallel.hpp"

#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "tessera/sdk/error.hpp"

namespace tessera::sdk {

TensorParallelGroup::~TensorParallelGroup() = default;
TensorParallelModule::~TensorParallelModule() = default;

namespace {

/// The length of one rank's piece along the placement's dimension; checks that it divides.
std::int64_t piece_length(const at::Tensor& full, TensorParallelPlacement p, std::int64_t size) {
  TESSERA_CHECK(p.stride >= 1 && size >= 1, "tensor parallel: stride (", p.stride, ") and group size (", size,
                ") must be at least 1");
  TESSERA_CHECK(p.dim < full.dim(), "tensor parallel: placement dim ", p.dim, " of a ", full.dim(),
                "-d tensor of shape ", full.sizes());
  const std::int64_t length = full.size(p.dim);
  TESSERA_CHECK(length % (p.stride * size) == 0, "tensor parallel: dimension ", p.dim, " of a tensor of shape ",
                full.sizes(), " (", length, ") does not split into ", p.stride, " part(s) x ", size,
                " rank(s) of equal size");
  return length / (p.stride * size);
}

}  // namespace

at::Tensor tensor_parallel_shard(const at::Tensor& full, TensorParallelPlacement placement, std::int64_t rank,
                                 std::int64_t size) {
  if (placement.dim < 0) return full;
  const std::int64_t piece = piece_length(full, placement, size);
  TESSERA_CHECK(rank >= 0 && rank < size, "tensor parallel: rank ", rank, " outside a group of ", size);
  std::vector<at::Tensor> pieces;
  for (std::int64_t part = 0; part < placement.stride; ++part)
    pieces.push_back(full.narrow(placement.dim, (part * size + rank) * piece, piece));
  return at::cat(pieces, placement.dim);  // a copy: `full` may be freed after
}

at::Tensor tensor_parallel_unshard(const at::Tensor& local, TensorParallelPlacement placement,
                                   TensorParallelGroup& group) {
  if (placement.dim < 0) return local;
  TESSERA_CHECK(placement.dim < local.dim() && local.size(placement.dim) % placement.stride == 0,
                "tensor parallel: a local piece of shape ", local.sizes(), " does not split into ", placement.stride,
                " part(s) on dimension ", placement.dim);
  at::Tensor gathered = group.all_gather(local, placement.dim);  // rank 0's parts, rank 1's parts, ...
  if (placement.stride == 1) return gathered;
  const std::int64_t piece = local.size(placement.dim) / placement.stride;
  std::vector<at::Tensor> chunks = gathered.split(piece, placement.dim);
  std::vector<at::Tensor> ordered;  // part 0 of every rank, then part 1, ...
  for (std::int64_t part = 0; part < placement.stride; ++part)
    for (std::int64_t r = 0; r < group.size(); ++r) ordered.push_back(chunks[r * placement.stride + part]);
  return at::cat(ordered, placement.dim);
}

std::map<std::string, TensorParallelPlacement> tensor_parallel_placements(const torch::nn::Module& module) {
  std::map<std::string, TensorParallelPlacement> out;
  auto add = [&](const std::string& prefix, const torch::nn::Module& m) {
    if (const auto* tp = dynamic_cast<const TensorParallelModule*>(&m))
      for (const auto& [name, placement] : tp->tensor_parallel_placements())
        out[prefix.empty() ? name : prefix + "." + name] = placement;
  };
  add("", module);
  for (const auto& item : module.named_modules("", /*include_self=*/false)) add(item.key(), *item.value());
  return out;
}

}  // namespace tessera::sdk
