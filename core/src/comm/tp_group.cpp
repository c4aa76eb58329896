#include "tessera/core/tp_group.hpp"

#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "tessera/sdk/error.hpp"

namespace tessera::core {

namespace {

class CommunicatorTensorParallelGroup final : public sdk::TensorParallelGroup {
 public:
  explicit CommunicatorTensorParallelGroup(CommunicatorPtr comm) : comm_(std::move(comm)) {}

  std::int64_t rank() const override { return comm_->rank(); }
  std::int64_t size() const override { return comm_->size(); }

  void all_reduce_sum(at::Tensor& tensor) override {
    if (comm_->size() == 1) return;
    // The communicator reduces contiguous memory; a strided tensor goes through a copy.
    at::Tensor buffer = tensor.is_contiguous() ? tensor : tensor.contiguous();
    comm_->all_reduce(buffer, sdk::ReduceOp::sum, "tensor-parallel all-reduce")->wait();
    if (!buffer.is_same(tensor)) tensor.copy_(buffer);
  }

  at::Tensor all_gather(const at::Tensor& tensor, std::int64_t dim) override {
    TESSERA_CHECK(dim >= 0 && dim < tensor.dim(), "tensor-parallel all_gather: dim ", dim, " of a tensor of shape ",
                  tensor.sizes());
    if (comm_->size() == 1) return tensor;
    at::Tensor input = tensor.contiguous();
    std::vector<std::int64_t> shape{comm_->size()};
    shape.insert(shape.end(), input.sizes().begin(), input.sizes().end());
    at::Tensor rows = at::empty(shape, input.options());  // [ranks, *shape], rank-major
    comm_->all_gather(rows, input, "tensor-parallel all-gather")->wait();
    return at::cat(rows.unbind(0), dim);
  }

 private:
  CommunicatorPtr comm_;
};

class PlanningTensorParallelGroup final : public sdk::TensorParallelGroup {
 public:
  explicit PlanningTensorParallelGroup(std::int64_t size) : size_(size) {}
  std::int64_t rank() const override { return 0; }
  std::int64_t size() const override { return size_; }
  void all_reduce_sum(at::Tensor&) override {}
  at::Tensor all_gather(const at::Tensor& tensor, std::int64_t dim) override {
    return at::cat(std::vector<at::Tensor>(static_cast<std::size_t>(size_), tensor), dim);
  }

 private:
  std::int64_t size_;
};

}  // namespace

std::shared_ptr<sdk::TensorParallelGroup> make_planning_tensor_parallel_group(std::int64_t size) {
  TESSERA_CHECK(size >= 1, "make_planning_tensor_parallel_group: size ", size, " < 1");
  return std::make_shared<PlanningTensorParallelGroup>(size);
}

std::shared_ptr<sdk::TensorParallelGroup> make_tensor_parallel_group(CommunicatorPtr tp) {
  TESSERA_CHECK(tp != nullptr, "make_tensor_parallel_group: no communicator (null)");
  return std::make_shared<CommunicatorTensorParallelGroup>(std::move(tp));
}

std::vector<std::pair<TensorPiece, at::Tensor>> tensor_parallel_pieces(const at::Tensor& local,
                                                                       sdk::TensorParallelPlacement placement,
                                                                       std::int64_t rank, std::int64_t size) {
  if (placement.dim < 0) return {{TensorPiece::whole(local.sizes()), local}};
  TESSERA_CHECK(placement.dim < local.dim() && placement.stride >= 1 && local.size(placement.dim) % placement.stride == 0,
                "tensor_parallel_pieces: a local piece of shape ", local.sizes(), " does not split into ",
                placement.stride, " part(s) on dimension ", placement.dim);
  TESSERA_CHECK(rank >= 0 && rank < size, "tensor_parallel_pieces: rank ", rank, " outside a group of ", size);
  const std::int64_t piece = local.size(placement.dim) / placement.stride;
  std::vector<std::int64_t> global = local.sizes().vec(), offsets(local.dim(), 0), lengths = local.sizes().vec();
  global[placement.dim] *= size;
  lengths[placement.dim] = piece;
  std::vector<std::pair<TensorPiece, at::Tensor>> out;
  for (std::int64_t part = 0; part < placement.stride; ++part) {
    offsets[placement.dim] = (part * size + rank) * piece;  // as sdk::tensor_parallel_shard cuts
    out.emplace_back(TensorPiece::box(global, offsets, lengths), local.narrow(placement.dim, part * piece, piece));
  }
  return out;
}

}  // namespace tessera::core
