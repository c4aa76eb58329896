#include "train/fault_injection.hpp"

#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <thread>

#include <ATen/ATen.h>

#include "tessera/sdk/error.hpp"

namespace tessera::host {

FaultInjection::FaultInjection(std::int64_t rank, RunLog& log) : rank_(rank), log_(log) {
  const char* spec = std::getenv("TESSERA_FAULT_INJECT");
  if (spec == nullptr) return;
  std::stringstream in(spec);
  for (std::string item; std::getline(in, item, ',');) {
    auto eq = item.find('=');
    if (eq != std::string::npos) fields_[item.substr(0, eq)] = item.substr(eq + 1);
  }
}

bool FaultInjection::mine(const char* kind) const {
  if (fields_.empty() || std::stoll(fields_.at("rank")) != rank_) return false;
  const std::string& k = fields_.at("kind");
  return kind == nullptr ? k != "nan_grad" : k == kind;
}

void FaultInjection::poison_gradient(torch::nn::Module& network, std::function<std::int64_t()> global_step) const {
  if (!mine("nan_grad")) return;
  const std::int64_t step = std::stoll(fields_.at("step"));
  const std::string& name = fields_.at("param");
  at::Tensor* param = network.named_parameters().find(name);
  TESSERA_CHECK(param != nullptr, "fault injection: no parameter ", name);
  param->register_hook([step, global_step](const at::Tensor& grad) -> at::Tensor {
    if (global_step() + 1 != step) return at::Tensor();
    at::Tensor poisoned = grad.clone();
    poisoned.view(-1)[0] = std::numeric_limits<float>::quiet_NaN();
    return poisoned;
  });
}

void FaultInjection::at_step(std::int64_t step, bool saving) const {
  if (!mine(nullptr) || std::stoll(fields_.at("step")) != step) return;
  const std::string& kind = fields_.at("kind");
  if ((kind == "slow_save") != saving) return;
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (fields_.count("attempt") && fields_.at("attempt") != (attempt ? attempt : "0")) return;
  log_.info("fault injection: rank " + std::to_string(rank_) + " " + kind + " at step " + std::to_string(step));
  if (kind == "sigint") return void(::raise(SIGINT));  // as Ctrl-C: handled at the step's end
  if (kind == "kill") ::raise(SIGKILL);
  if (kind == "hang") std::this_thread::sleep_for(std::chrono::hours(1));
  if (kind == "error") TESSERA_FAIL("fault injection: rank ", rank_, " fails at step ", step);
  if (kind == "slow_save") return std::this_thread::sleep_for(std::chrono::seconds(std::stoll(fields_.at("seconds"))));
  std::_Exit(3);
}

}  // namespace tessera::host
