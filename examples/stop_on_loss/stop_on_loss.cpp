// A callback plugin: stops fit once the training loss (the mean over ranks) is below
// `threshold`, and logs how many steps that took. Written only against the public SDK.
#include <tessera/sdk/callback.hpp>
#include <tessera/sdk/plugin.hpp>

namespace {

class StopOnLoss final : public tessera::sdk::Callback {
 public:
  explicit StopOnLoss(const tessera::sdk::Options& options)
      : threshold_(
            options.get_double({"threshold", "stop training once the training loss falls below this"}, 1.0, 0.0)) {}

  void on_train_batch_end(tessera::sdk::Trainer& trainer, const tessera::sdk::StepOutput&,
                          const tessera::sdk::Batch&, std::int64_t) override {
    double loss = trainer.callback_metrics().at("train_loss");  // the same on every rank
    if (loss >= threshold_ || trainer.should_stop()) return;
    trainer.print("stop_on_loss: train_loss " + std::to_string(loss) + " < " + std::to_string(threshold_) +
                  " at step " + std::to_string(trainer.global_step()));
    trainer.log_metrics({{"steps_to_threshold", static_cast<double>(trainer.global_step())}});
    trainer.request_stop("train_loss below " + std::to_string(threshold_));
  }

 private:
  double threshold_;
};

}  // namespace

TESSERA_PLUGIN(callback, "1.0.0",
               tessera::sdk::plugin_entry<StopOnLoss>("stop_on_loss", "stops fit once train_loss is below a threshold"));
