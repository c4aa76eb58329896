#include "callbacks/weight_averaging.hpp"

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "callbacks/callbacks.hpp"
#include "tessera/core/checkpoint.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/module.hpp"
#include "tessera/sdk/strategy.hpp"

namespace tessera::host {

namespace {

/// The average of a 16-bit tensor is kept in fp32: in bf16 an update of (1 - decay) x the
/// difference would mostly round away.
at::Tensor average_storage(const at::Tensor& t) {
  const bool low = t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
  return low ? t.to(at::kFloat) : t.clone();
}

}  // namespace

WeightAveraging::WeightAveraging(const sdk::Options& o, bool ema)
    : ema_(ema),
      decay_(ema ? o.get_double({"decay", "the exponential moving average's decay per update"}, 0.999, 0.0, 1.0) : 0.0),
      every_n_steps_(o.get_int({"update_every_n_steps", "update the average every N optimizer steps"}, 1, 1)),
      // Lightning's None: 0 (every step counts) and -1 (no updates at epoch ends).
      starting_at_step_(o.get_int({"update_starting_at_step", "first optimizer step that updates the average"}, 0, 0)),
      starting_at_epoch_(o.get_int(
          {"update_starting_at_epoch", "first epoch that updates the average; -1: from update_starting_at_step"}, -1,
          -1)),
      use_buffers_(o.get_bool({"use_buffers", "average the buffers too (else copy them)"}, true)) {}

std::vector<at::Tensor> WeightAveraging::targets(sdk::Trainer& trainer) const {
  std::vector<at::Tensor> out;
  for (const auto& group : trainer.strategy().optimizer().param_groups())
    for (const auto& p : group.params()) out.push_back(p);
  if (use_buffers_)
    for (const auto& b : trainer.lightning_module().network()->buffers()) out.push_back(b);
  return out;
}

void WeightAveraging::start(sdk::Trainer& trainer) {
  average_.clear();
  for (const auto& t : targets(trainer)) average_.push_back(average_storage(t.detach()));
  averaged_ = 0;
}

void WeightAveraging::update(sdk::Trainer& trainer) {
  torch::NoGradGuard no_grad;
  const std::vector<at::Tensor> now = targets(trainer);
  TESSERA_CHECK(now.size() == average_.size(), "weight averaging: the model has ", now.size(),
                " tensors to average, the average ", average_.size());
  for (std::size_t i = 0; i < now.size(); ++i) {
    at::Tensor& average = average_[i];
    const at::Tensor current = now[i].detach().to(average.scalar_type());
    if (averaged_ == 0 || !average.is_floating_point()) average.copy_(current);  // AveragedModel's first update
    else if (ema_) average.mul_(decay_).add_(current, 1.0 - decay_);  // torch's get_ema_avg_fn
    else average.add_((current - average) / static_cast<double>(averaged_ + 1));  // equal weights (SWA)
  }
  ++averaged_;
}

void WeightAveraging::on_after_optimizer_step(sdk::Trainer& trainer) {
  // Lightning's should_update(step_idx), step_idx = global_step - 1.
  const std::int64_t step_idx = trainer.global_step() - 1;
  if (trainer.global_step() <= latest_update_step_ || average_.empty()) return;
  if (step_idx >= starting_at_step_ && step_idx % every_n_steps_ == 0) {
    update(trainer);
    latest_update_step_ = trainer.global_step();
  }
}

void WeightAveraging::on_fit_start(sdk::Trainer& trainer) {
  if (average_.empty()) start(trainer);  // not resumed: the weights fit starts from (after init_from)
}

void WeightAveraging::on_train_epoch_end(sdk::Trainer& trainer) {
  const std::int64_t epoch_idx = trainer.current_epoch() - 1;  // the epoch that ended
  if (starting_at_epoch_ < 0 || epoch_idx <= latest_update_epoch_ || epoch_idx < starting_at_epoch_) return;
  update(trainer);
  latest_update_epoch_ = epoch_idx;
}

void WeightAveraging::swap_in(sdk::Trainer& trainer) {
  torch::NoGradGuard no_grad;
  const std::vector<at::Tensor> now = targets(trainer);
  kept_.clear();
  for (std::size_t i = 0; i < now.size(); ++i) {
    kept_.push_back(now[i].detach().clone());
    now[i].detach().copy_(average_[i]);
  }
}

void WeightAveraging::swap_out(sdk::Trainer& trainer) {
  torch::NoGradGuard no_grad;
  const std::vector<at::Tensor> now = targets(trainer);
  for (std::size_t i = 0; i < now.size(); ++i) now[i].detach().copy_(kept_[i]);
  kept_.clear();
}

void WeightAveraging::on_validation_start(sdk::Trainer& trainer) {
  if (trainer.stage() == "fit" && !average_.empty() && !finished_) swap_in(trainer);
}

void WeightAveraging::on_validation_end(sdk::Trainer& trainer) {
  if (!kept_.empty()) swap_out(trainer);
}

void WeightAveraging::on_fit_end(sdk::Trainer& trainer) {
  if (average_.empty()) return;
  torch::NoGradGuard no_grad;
  const std::vector<at::Tensor> now = targets(trainer);
  for (std::size_t i = 0; i < now.size(); ++i) now[i].detach().copy_(average_[i]);
  finished_ = true;
  trainer.print("weight averaging: the model now holds the average of " + std::to_string(averaged_) + " updates");
}

void WeightAveraging::on_save_checkpoint(sdk::Trainer& trainer, sdk::Checkpoint& checkpoint) {
  if (average_.empty() || finished_) return;
  // The weights the model does not hold now, as the strategy writes them (full or its pieces).
  auto other_weights = [&] {
    const bool holds_average = !kept_.empty();
    holds_average ? swap_out(trainer) : swap_in(trainer);
    // Copies: a strategy's state dict may hold the parameters themselves (single_device, ddp).
    sdk::StateDict state;
    for (const auto& item : trainer.strategy().lightning_module_state_dict()) state.insert(item.key(), item.value().clone());
    holds_average ? swap_in(trainer) : swap_out(trainer);
    return core::to_ivalue(state);
  };
  const bool weights_only = checkpoint.contains(core::kWeightsOnlyKey) && checkpoint.at(core::kWeightsOnlyKey).toBool();
  if (!kept_.empty()) {  // saved during validation: "state_dict" is the average already
    if (!weights_only) checkpoint.insert_or_assign(core::kCurrentModelStateKey, other_weights());
    return;
  }
  // A weights-only file cannot resume, so it keeps the average alone.
  if (!weights_only) checkpoint.insert_or_assign(core::kCurrentModelStateKey, checkpoint.at("state_dict"));
  checkpoint.insert_or_assign("state_dict", other_weights());
}

void WeightAveraging::on_load_checkpoint(sdk::Trainer& trainer, const sdk::Checkpoint& checkpoint) {
  if (trainer.stage() != "fit") return;  // validate, test, predict: the model keeps the average
  // The trainer loaded "state_dict" (the average) into the model.
  const std::int64_t averaged = averaged_;
  start(trainer);
  if (!checkpoint.contains(core::kCurrentModelStateKey)) {
    trainer.print("weight averaging: the checkpoint holds no average (no current_model_state): the average starts "
                  "from its weights");
    return;
  }
  averaged_ = averaged;  // as saved (load_state_dict ran first)
  trainer.strategy().load_model_state_dict(
      core::state_dict_from(checkpoint.at(core::kCurrentModelStateKey), std::string("checkpoint [") + core::kCurrentModelStateKey + "]"),
      /*strict=*/true);
}

std::string WeightAveraging::state_key() const { return ema_ ? "EMAWeightAveraging" : "WeightAveraging"; }

sdk::Checkpoint WeightAveraging::state_dict() const {
  sdk::Checkpoint state = sdk::make_checkpoint();
  state.insert("latest_update_step", latest_update_step_);
  state.insert("latest_update_epoch", latest_update_epoch_);
  state.insert("n_averaged", averaged_);
  return state;
}

void WeightAveraging::load_state_dict(const sdk::Checkpoint& state) {
  latest_update_step_ = core::checkpoint_get(state, "latest_update_step").toInt();
  latest_update_epoch_ = core::checkpoint_get(state, "latest_update_epoch").toInt();
  averaged_ = core::checkpoint_get(state, "n_averaged").toInt();
}

std::shared_ptr<sdk::Callback> make_weight_averaging(const sdk::Options& options, bool ema) {
  return std::make_shared<WeightAveraging>(options, ema);
}

}  // namespace tessera::host
