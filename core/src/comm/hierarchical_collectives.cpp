#include "hierarchical_collectives.hpp"

#include <chrono>

namespace tessera::core::detail {

namespace {

bool sixteen_bit(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf; }

/// A mean's division by the group's size (integers truncate, as the shared-memory channel's).
void divide(at::Tensor& t, std::int64_t size) {
  if (at::isIntegralType(t.scalar_type(), /*includeBool=*/false)) t.div_(size, "trunc");
  else t.div_(static_cast<double>(size));
}

/// Within a host a mean is a sum: the division comes once, across hosts.
sdk::ReduceOp within_host(sdk::ReduceOp op) { return op == sdk::ReduceOp::mean ? sdk::ReduceOp::sum : op; }

}  // namespace

HierarchicalCollectives::HierarchicalCollectives(HostLayout layout, std::unique_ptr<SharedMemoryChannel> within,
                                                 c10::intrusive_ptr<c10d::ProcessGroupGloo> across,
                                                 std::string across_path, double timeout_s)
    : layout_(std::move(layout)), hosts_(static_cast<std::int64_t>(layout_.hosts.size())),
      per_host_(layout_.ranks_per_host()), size_(hosts_ * per_host_), within_(std::move(within)),
      across_(std::move(across)), across_path_(std::move(across_path)), timeout_s_(timeout_s) {
  place_major_ = at::empty({size_}, at::kLong);
  auto* order = place_major_.data_ptr<std::int64_t>();
  for (std::int64_t l = 0; l < per_host_; ++l)
    for (std::int64_t h = 0; h < hosts_; ++h)
      order[l * hosts_ + h] = layout_.hosts[static_cast<std::size_t>(h)][static_cast<std::size_t>(l)];
}

HierarchicalCollectives::~HierarchicalCollectives() {
  within_->close();  // a collective of this host's level fails at once, and its worker with it
  queue_.close();
}

std::string HierarchicalCollectives::describe() const {
  return "two levels: shared memory among the " + std::to_string(per_host_) + " ranks of each of " +
         std::to_string(hosts_) + " hosts, " + across_path_ + " across hosts";
}

void HierarchicalCollectives::finish(GlooIssued issued) const {
  issued.work->wait(std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s_ * 1000)));
  if (issued.finish) issued.finish();
}

c10::intrusive_ptr<c10d::Work> HierarchicalCollectives::all_gather(at::Tensor output, at::Tensor input) {
  return queue_.submit([this, output, input]() mutable {
    const std::int64_t m = input.numel();
    // Across: this rank's column gathers its chunk from every host (read before the output,
    // which may hold the input, is written).
    at::Tensor column = at::empty({hosts_ * m}, input.options());
    finish(gloo_all_gather(*across_, column, input, hosts_));
    // Within: the host's columns, place-major; then every chunk to its rank's place.
    at::Tensor everyone = at::empty({size_ * m}, input.options());
    within_->all_gather(everyone, column)->wait();
    output.view({size_, m}).index_copy_(0, place_major_, everyone.view({size_, m}));
  });
}

c10::intrusive_ptr<c10d::Work> HierarchicalCollectives::reduce_scatter(at::Tensor output, at::Tensor input,
                                                                       sdk::ReduceOp op) {
  // Place-major copy now: the output may lie inside the input.
  const std::int64_t m = output.numel();
  at::Tensor by_place = input.view({size_, m}).index_select(0, place_major_).view({-1});
  return queue_.submit([this, output, by_place, op]() mutable {
    const std::int64_t m = output.numel();
    // Within: this rank's place's chunks of every host, summed over this host.
    at::Tensor partial = at::empty({hosts_ * m}, output.options());
    within_->reduce_scatter(partial, by_place, within_host(op))->wait();
    // Across: this rank's own chunk, summed over the hosts.
    at::Tensor wide = sixteen_bit(partial) ? partial.to(at::kFloat) : partial;
    at::Tensor result = sixteen_bit(output) ? at::empty({m}, wide.options()) : output;
    finish(gloo_reduce_scatter(*across_, pool_, result, wide, within_host(op), hosts_));
    if (op == sdk::ReduceOp::mean) divide(result, size_);
    if (!result.is_same(output)) output.copy_(result);
  });
}

c10::intrusive_ptr<c10d::Work> HierarchicalCollectives::all_reduce(at::Tensor tensor, sdk::ReduceOp op) {
  return queue_.submit([this, tensor, op]() mutable {
    const std::int64_t n = tensor.numel();
    const std::int64_t piece = (n + per_host_ - 1) / per_host_;
    // L equal pieces: a size that does not divide goes through a padded copy.
    at::Tensor flat = tensor.view({-1}), whole = flat;
    if (piece * per_host_ != n) {
      whole = at::zeros({piece * per_host_}, tensor.options());
      whole.narrow(0, 0, n).copy_(flat);
    }
    at::Tensor mine = whole.narrow(0, layout_.local * piece, piece);
    within_->reduce_scatter(mine, whole, within_host(op))->wait();
    at::Tensor wide = sixteen_bit(mine) ? mine.to(at::kFloat) : mine;
    finish(gloo_all_reduce(*across_, wide, within_host(op), hosts_));
    if (op == sdk::ReduceOp::mean) divide(wide, size_);
    if (!wide.is_same(mine)) mine.copy_(wide);
    within_->all_gather(whole, mine)->wait();
    if (!whole.is_same(flat)) flat.copy_(whole.narrow(0, 0, n));
  });
}

}  // namespace tessera::core::detail
