// The callback interface's empty defaults live here, not inline in the header: inline code
// would be frozen into every built plugin.
#include "tessera/sdk/callback.hpp"

namespace tessera::sdk {

Trainer::~Trainer() = default;
Callback::~Callback() = default;

void Callback::setup(Trainer&, const std::string&) {}
void Callback::teardown(Trainer&, const std::string&) {}
void Callback::on_fit_start(Trainer&) {}
void Callback::on_fit_end(Trainer&) {}
void Callback::on_train_start(Trainer&) {}
void Callback::on_train_end(Trainer&) {}
void Callback::on_train_epoch_start(Trainer&) {}
void Callback::on_train_epoch_end(Trainer&) {}
void Callback::on_train_batch_start(Trainer&, const Batch&, std::int64_t) {}
void Callback::on_train_batch_end(Trainer&, const StepOutput&, const Batch&, std::int64_t) {}
void Callback::on_after_optimizer_step(Trainer&) {}
void Callback::on_validation_start(Trainer&) {}
void Callback::on_validation_end(Trainer&) {}
void Callback::on_test_start(Trainer&) {}
void Callback::on_test_end(Trainer&) {}
void Callback::on_save_checkpoint(Trainer&, Checkpoint&) {}
void Callback::on_load_checkpoint(Trainer&, const Checkpoint&) {}
void Callback::on_exception(Trainer&, const std::exception&) {}
std::string Callback::state_key() const { return ""; }
Checkpoint Callback::state_dict() const { return make_checkpoint(); }
void Callback::load_state_dict(const Checkpoint&) {}

}  // namespace tessera::sdk
