// ZeRO stage 1 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
// Parameter Models", 2020) as a third-party strategy plugin, written only against the
// installed Tessera SDK and its strategy API (tessera/core/strategy_base.hpp, comm.hpp,
// clip_grad.hpp, checkpoint.hpp).
//
// Parameters and gradients are replicated, as under DDP. The trainable parameters are laid
// end to end in one flat vector, padded to a multiple of the world size N, and rank r owns
// the r-th 1/N of it: after backward the gradient is reduce-scattered (mean), so each rank
// holds the averaged gradient of its part only; the optimizer keeps state for, and steps on,
// that part only (one tensor per parameter piece, named after the parameter); after the step
// the updated parts are all-gathered into every rank's parameters. Checkpoints hold the full
// optimizer state (gathered), so they resume on any world size or strategy.
#include <algorithm>
#include <array>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <tessera/core/checkpoint.hpp>
#include <tessera/core/clip_grad.hpp>
#include <tessera/core/strategy_base.hpp>
#include <tessera/sdk/error.hpp>
#include <tessera/sdk/plugin.hpp>

namespace {

using tessera::core::CommunicatorPtr;
using tessera::core::OptimStateKeyType;
namespace sdk = tessera::sdk;

/// The per-element optimizer state keys of the optimizers Tessera builds (Adam, AdamW, SGD).
constexpr std::array<const char*, 4> kElementwiseState{"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"};

class Zero1Strategy final : public tessera::core::StrategyBase {
 public:
  explicit Zero1Strategy(const sdk::Options& options) : StrategyBase(options) {}

  void backward(const at::Tensor& loss, bool sync_gradients) override {
    precision().pre_backward(loss).backward();
    if (sync_gradients) reduce_scatter_gradients();  // else gradients accumulate (no_sync)
  }

  sdk::StepResult optimizer_step(double gradient_clip_val, double norm_type) override {
    sdk::StepResult result = StrategyBase::optimizer_step(gradient_clip_val, norm_type);
    if (result.stepped) all_gather_parameters();
    return result;
  }

  /// The pieces are disjoint and cover every parameter once: the norm is reduced over ranks.
  double clip_grad_norm(double max_norm, double norm_type) override {
    std::vector<at::Tensor> gradients;
    for (const Piece& piece : pieces_)
      if (piece.tensor.grad().defined()) gradients.push_back(piece.tensor.grad());
    return tessera::core::clip_grad_norm(gradients, {}, max_norm, norm_type, &world(), root_device());
  }

  void load_model_state_dict(const sdk::StateDict& state, bool strict) override {
    StrategyBase::load_model_state_dict(state, strict);
    torch::NoGradGuard no_grad;
    for (Piece& piece : pieces_) piece.tensor.copy_(slice(piece, params_[piece.param]));
  }

  /// The full optimizer state in PyTorch's format, keyed by index with parameter names:
  /// every per-element state tensor is all-gathered through the flat layout. Collective.
  sdk::Checkpoint optimizer_state() override {
    sdk::Checkpoint local = tessera::core::rekey_optim_state_dict(StrategyBase::optimizer_state(),
                                                                  OptimStateKeyType::PARAM_NAME);
    auto local_state = local.at("state").toGenericDict();
    // Agree on what exists anywhere: which state keys, the step count, which parameters have state.
    const std::size_t num_keys = kElementwiseState.size(), step_at = num_keys, param_at = num_keys + 1;
    std::vector<double> known(param_at + params_.size(), 0.0);
    for (const Piece& piece : pieces_) {
      if (!local_state.contains(names_[piece.param])) continue;
      sdk::Checkpoint entry = local_state.at(names_[piece.param]).toGenericDict();
      for (std::size_t k = 0; k < num_keys; ++k)
        if (entry.contains(kElementwiseState[k])) known[k] = 1.0;
      if (entry.contains("step")) known[step_at] = std::max(known[step_at], step_of(entry));
      known[param_at + piece.param] = 1.0;
    }
    at::Tensor agreed = at::tensor(known, at::kDouble);
    world().all_reduce(agreed, sdk::ReduceOp::max, "zero1 optimizer state keys")->wait();
    std::copy(agreed.data_ptr<double>(), agreed.data_ptr<double>() + agreed.numel(), known.begin());

    std::vector<std::pair<std::string, at::Tensor>> gathered;  // key -> the full flat state
    for (std::size_t k = 0; k < num_keys; ++k) {
      if (known[k] == 0) continue;
      at::Tensor mine = at::zeros({shard_numel_}, flat_.options());
      for (const Piece& piece : pieces_)
        if (local_state.contains(names_[piece.param])) {
          sdk::Checkpoint entry = local_state.at(names_[piece.param]).toGenericDict();
          if (entry.contains(kElementwiseState[k]))
            mine.narrow(0, piece.shard_offset, piece.length).copy_(entry.at(kElementwiseState[k]).toTensor());
        }
      at::Tensor full = at::empty({shard_numel_ * world().size()}, flat_.options());
      world().all_gather(full, mine, std::string("zero1 optimizer state ") + kElementwiseState[k])->wait();
      gathered.emplace_back(kElementwiseState[k], full);
    }

    c10::impl::GenericDict state(c10::StringType::get(), c10::AnyType::get());
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (known[param_at + i] == 0) continue;
      sdk::Checkpoint entry = sdk::make_checkpoint();
      if (known[step_at] > 0) entry.insert("step", at::scalar_tensor(known[step_at], at::kFloat));
      for (const auto& [key, full] : gathered)
        entry.insert(key, full.narrow(0, offsets_[i], params_[i].numel()).view(params_[i].sizes()).clone());
      state.insert(names_[i], entry);
    }
    sdk::Checkpoint out = sdk::make_checkpoint();
    out.insert("state", state);
    out.insert("param_groups", groups_with(local, names_));
    return tessera::core::rekey_optim_state_dict(out, OptimStateKeyType::PARAM_ID);
  }

  /// Takes this rank's piece of each parameter's state from a full optimizer state (any
  /// strategy's, any world size).
  void load_optimizer_state(const sdk::Checkpoint& saved) override {
    sdk::Checkpoint full = tessera::core::rekey_optim_state_dict(saved, OptimStateKeyType::PARAM_NAME);
    auto full_state = full.at("state").toGenericDict();
    c10::impl::GenericDict state(c10::StringType::get(), c10::AnyType::get());
    std::vector<std::string> local_names;
    for (const Piece& piece : pieces_) {
      const std::string& name = names_[piece.param];
      local_names.push_back(name);
      if (!full_state.contains(name)) continue;
      sdk::Checkpoint entry = sdk::make_checkpoint();
      for (const auto& item : full_state.at(name).toGenericDict()) {
        const bool elementwise = item.value().isTensor() && item.key().toStringRef() != "step";
        if (!elementwise) {
          entry.insert(item.key(), item.value());
          continue;
        }
        at::Tensor t = item.value().toTensor();
        TESSERA_CHECK(t.numel() == params_[piece.param].numel(), "optimizer state '", item.key().toStringRef(),
                      "' of parameter '", name, "' has ", t.numel(), " elements in the checkpoint but the parameter has ",
                      params_[piece.param].numel());
        entry.insert(item.key(), slice(piece, t).clone());
      }
      state.insert(name, entry);
    }
    sdk::Checkpoint local = sdk::make_checkpoint();
    local.insert("state", state);
    local.insert("param_groups", groups_with(full, local_names));
    StrategyBase::load_optimizer_state(local);
  }

 protected:
  void setup_module() override {
    torch::NoGradGuard no_grad;
    for (auto& p : network_->parameters()) broadcast(p, 0);  // every replica starts from rank 0's
    for (auto& b : network_->buffers()) broadcast(b, 0);
    std::int64_t total = 0;
    for (const auto& item : network_->named_parameters(/*recurse=*/true)) {
      if (!item.value().requires_grad()) continue;
      TESSERA_CHECK(params_.empty() || item.value().scalar_type() == params_[0].scalar_type(),
                    "zero1 keeps one flat buffer per model, so every trainable parameter needs one dtype: '",
                    item.key(), "' is ", item.value().scalar_type(), ", '", names_[0], "' is ",
                    params_[0].scalar_type());
      names_.push_back(item.key());
      params_.push_back(item.value());
      offsets_.push_back(total);
      total += item.value().numel();
    }
    TESSERA_CHECK(!params_.empty(), "zero1: the model has no trainable parameters");
    const std::int64_t n = world().size(), rank = world().rank();
    shard_numel_ = (total + n - 1) / n;
    flat_ = at::zeros({shard_numel_ * n}, params_[0].options());
    shard_ = at::zeros({shard_numel_}, params_[0].options());
    shard_grad_ = at::zeros({shard_numel_}, params_[0].options());
    const std::int64_t begin = rank * shard_numel_, end = begin + shard_numel_;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const std::int64_t lo = std::max(begin, offsets_[i]), hi = std::min(end, offsets_[i] + params_[i].numel());
      if (lo >= hi) continue;
      Piece piece{i, lo - offsets_[i], hi - lo, lo - begin, {}};
      piece.tensor = slice(piece, params_[i]).clone().set_requires_grad(true);
      pieces_.push_back(std::move(piece));
    }
  }

  /// What the optimizer steps on: this rank's piece of each parameter, under its name.
  std::vector<sdk::NamedParameter> optimizer_parameters() override {
    std::vector<sdk::NamedParameter> out;
    for (const Piece& piece : pieces_) out.push_back({names_[piece.param], piece.tensor});
    return out;
  }

  void zero_grad() override {
    for (auto& p : params_) p.mutable_grad() = at::Tensor();
    for (Piece& piece : pieces_) piece.tensor.mutable_grad() = at::Tensor();
  }

 private:
  /// This rank's part of parameter `param`: elements [begin, begin + length) of its flattened
  /// values, at `shard_offset` in this rank's 1/N of the flat vector.
  struct Piece {
    std::size_t param;
    std::int64_t begin;
    std::int64_t length;
    std::int64_t shard_offset;
    at::Tensor tensor;
  };

  /// `piece` of `full` (the parameter or a state tensor of its shape), as a 1-D view.
  static at::Tensor slice(const Piece& piece, const at::Tensor& full) {
    return full.detach().reshape({-1}).narrow(0, piece.begin, piece.length);
  }

  static double step_of(const sdk::Checkpoint& entry) {
    const c10::IValue& step = entry.at("step");
    return step.isTensor() ? step.toTensor().item<double>() : static_cast<double>(step.toInt());
  }

  /// The saved param groups with their "params" replaced by `names` (one group).
  static c10::impl::GenericList groups_with(const sdk::Checkpoint& dict, const std::vector<std::string>& names) {
    auto groups = dict.at("param_groups").toListRef();
    TESSERA_CHECK(groups.size() <= 1, "zero1 supports one optimizer param group, found ", groups.size());
    c10::impl::GenericList out(c10::AnyType::get());
    for (const c10::IValue& group : groups) {
      sdk::Checkpoint copy = group.toGenericDict().copy();
      copy.insert_or_assign("params", c10::List<std::string>(names));
      out.push_back(copy);
    }
    return out;
  }

  void reduce_scatter_gradients() {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      at::Tensor slot = flat_.narrow(0, offsets_[i], params_[i].numel());
      if (params_[i].grad().defined()) slot.copy_(params_[i].grad().reshape({-1}));
      else slot.zero_();
    }
    world().reduce_scatter(shard_grad_, flat_, sdk::ReduceOp::mean, "zero1 gradient reduce-scatter")->wait();
    for (Piece& piece : pieces_)  // a parameter without a gradient is not stepped, as on one device
      piece.tensor.mutable_grad() = params_[piece.param].grad().defined()
                                        ? shard_grad_.narrow(0, piece.shard_offset, piece.length)
                                        : at::Tensor();
  }

  void all_gather_parameters() {
    torch::NoGradGuard no_grad;
    for (const Piece& piece : pieces_) shard_.narrow(0, piece.shard_offset, piece.length).copy_(piece.tensor);
    world().all_gather(flat_, shard_, "zero1 parameter all-gather")->wait();
    for (std::size_t i = 0; i < params_.size(); ++i)
      params_[i].view({-1}).copy_(flat_.narrow(0, offsets_[i], params_[i].numel()));
  }

  std::vector<std::string> names_;
  std::vector<at::Tensor> params_;
  std::vector<std::int64_t> offsets_;  ///< of each parameter in the flat vector
  std::int64_t shard_numel_ = 0;       ///< ceil(total / N): each rank's part, the last one padded
  at::Tensor flat_;                    ///< N parts: gradients before the reduce-scatter, parameters after the gather
  at::Tensor shard_;                   ///< this rank's part of the parameters, for the gather
  at::Tensor shard_grad_;              ///< this rank's part of the averaged gradient
  std::vector<Piece> pieces_;
};

}  // namespace

TESSERA_PLUGIN(strategy, "1.0.0",
               tessera::sdk::plugin_entry<Zero1Strategy>(
                   "zero1", "ZeRO stage 1 (out-of-tree example): replicated parameters and gradients, optimizer "
                            "state and step sharded 1/N per rank"));
