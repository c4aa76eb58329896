#include "host_staged_communicator.hpp"

#include <ATen/ATen.h>

namespace tessera::core::detail {
namespace {

/// The collective and its copy back finished before the handle was made.
class Done final : public CommHandle {
 public:
  void wait() override {}
};

at::Tensor on_host(const at::Tensor& t) { return t.to(at::kCPU).contiguous(); }
at::Tensor host_like(const at::Tensor& t) { return at::empty(t.sizes(), t.options().device(at::kCPU)); }

class HostStagedCommunicator final : public Communicator {
 public:
  explicit HostStagedCommunicator(CommunicatorPtr host) : host_(std::move(host)) {}

  std::int64_t rank() const override { return host_->rank(); }
  std::int64_t size() const override { return host_->size(); }
  const CommStats& stats() const override { return host_->stats(); }

  CommHandlePtr all_gather(at::Tensor output, const at::Tensor& input, const std::string& tag) override {
    at::Tensor out = host_like(output);
    host_->all_gather(out, on_host(input), tag)->wait();
    return back(output, out);
  }
  CommHandlePtr reduce_scatter(at::Tensor output, const at::Tensor& input, sdk::ReduceOp op,
                               const std::string& tag) override {
    at::Tensor out = host_like(output);
    host_->reduce_scatter(out, on_host(input), op, tag)->wait();
    return back(output, out);
  }
  CommHandlePtr all_reduce(at::Tensor tensor, sdk::ReduceOp op, const std::string& tag) override {
    at::Tensor staged = on_host(tensor);
    host_->all_reduce(staged, op, tag)->wait();
    return back(tensor, staged);
  }
  CommHandlePtr broadcast(at::Tensor tensor, std::int64_t src, const std::string& tag) override {
    at::Tensor staged = on_host(tensor);
    host_->broadcast(staged, src, tag)->wait();
    return back(tensor, staged);
  }
  CommHandlePtr all_to_all(at::Tensor output, const at::Tensor& input, const std::string& tag) override {
    at::Tensor out = host_like(output);
    host_->all_to_all(out, on_host(input), tag)->wait();
    return back(output, out);
  }
  void barrier(const std::string& tag) override { host_->barrier(tag); }
  std::shared_ptr<Communicator> split(const std::vector<std::vector<std::int64_t>>& groups) override {
    return stage_through_host(host_->split(groups));
  }

 private:
  /// A copy from pageable host memory returns once the data is on the device.
  static CommHandlePtr back(at::Tensor& device, const at::Tensor& host) {
    if (!device.is_same(host)) device.copy_(host);
    return std::make_shared<Done>();
  }

  CommunicatorPtr host_;
};

}  // namespace

CommunicatorPtr stage_through_host(CommunicatorPtr host) {
  return std::make_shared<HostStagedCommunicator>(std::move(host));
}

}  // namespace tessera::core::detail
