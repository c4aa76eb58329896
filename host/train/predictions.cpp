// Prediction: `tessera predict` (and fit's predict_after_fit), and [trainer] predict_output,
// every rank's predictions written by rank 0 in dataset order.
#include <filesystem>
#include <sstream>

#include <ATen/ATen.h>

#include "tessera/core/checkpoint.hpp"
#include "data/data_loader.hpp"
#include "tessera/sdk/error.hpp"
#include "train/trainer_steps.hpp"

namespace tessera::host {

void Trainer::predict(const std::string& ckpt_path) {
  setup_with_weights("predict", ckpt_path);
  predict_batches(config_.trainer.limit_predict_batches, config_.trainer.predict_output);
}

void Trainer::predict_batches(const BatchLimit& limit, const std::string& output) {
  std::shared_ptr<sdk::Dataset> dataset = data_->predict_dataset();
  TESSERA_CHECK(dataset != nullptr, "data plugin '", config_.plugin_names.at("data"), "' has nothing to predict");
  sdk::DataLoaderSpec spec;
  spec.batch_size = config_.data.batch_size;
  core::DataLoader loader(dataset, strategy_->process_dataloader(spec));
  const std::int64_t batches = limit.of(loader.num_batches());
  model_->network()->train(false);
  at::manual_seed(static_cast<std::uint64_t>(config_.trainer.seed));
  std::vector<at::Tensor> rows;
  std::vector<std::int64_t> indices;
  for (std::int64_t i = 0; i < batches; ++i) {
    sdk::Batch batch = loader.batch(i);
    at::Tensor predicted = run_step("predict_step", [&] { return strategy_->predict_step(batch, i); }).to(at::kCPU);
    if (output.empty() || i == 0) log_.info(data_->describe_prediction(batch, predicted));
    if (output.empty()) continue;
    const std::int64_t first = i * spec.batch_size, samples = batch.size();
    TESSERA_CHECK(predicted.dim() > 0 && predicted.size(0) == samples, "[trainer] predict_output: predict_step of model '",
                  config_.plugin_names.at("model"), "' returned shape ", predicted.sizes(), " for a batch of ", samples,
                  " samples; written predictions need one row per sample");
    rows.push_back(predicted);
    indices.insert(indices.end(), loader.indices().begin() + first, loader.indices().begin() + first + samples);
  }
  model_->network()->train(true);
  if (!output.empty()) write_predictions(rows, indices, output);
}

void Trainer::write_predictions(const std::vector<at::Tensor>& rows, const std::vector<std::int64_t>& indices,
                                const std::string& path) {
  TESSERA_CHECK(!rows.empty(), "[trainer] predict_output: no batch was predicted (limit_predict_batches = 0)");
  at::Tensor local = at::cat(rows);
  // Every rank's rows must stack: the same shape per sample and dtype (predicted counts are equal,
  // the sampler pads the last rank's samples with the first ones).
  constexpr std::int64_t kMaxDims = 8;
  TESSERA_CHECK(local.dim() <= kMaxDims, "[trainer] predict_output: predictions of ", local.dim(), " dimensions; at most ",
                kMaxDims, " are written");
  at::Tensor layout = at::full({kMaxDims + 1}, -1, at::kLong);
  layout[0] = static_cast<std::int64_t>(local.scalar_type());
  for (std::int64_t d = 1; d < local.dim(); ++d) layout[d] = local.size(d);
  const c10::Device device = strategy_->root_device();
  at::Tensor layouts = strategy_->all_gather(layout.to(device)).cpu();
  auto described = [&](std::int64_t r) {
    std::ostringstream out;
    out << c10::IntArrayRef(layouts[r].data_ptr<std::int64_t>(), kMaxDims + 1);
    return out.str();
  };
  for (std::int64_t r = 1; r < layouts.size(0); ++r)
    TESSERA_CHECK(at::equal(layouts[r], layouts[0]), "[trainer] predict_output: rank ", r, "'s predictions are ",
                  described(r), " (dtype code, then each sample's sizes) and rank 0's ", described(0),
                  ": predict_step must return the same shape and dtype per sample on every rank");
  // Gloo gathers no bool: as bytes.
  const bool boolean = local.scalar_type() == at::kBool;
  at::Tensor all = strategy_->all_gather((boolean ? local.to(at::kByte) : local).to(device)).cpu().flatten(0, 1);
  at::Tensor all_indices = strategy_->all_gather(at::tensor(indices, at::kLong).to(device)).cpu().flatten();
  if (!is_global_zero()) return;
  // Dataset order, each sample once (the sampler's padding and tensor-parallel ranks repeat some).
  at::Tensor order = std::get<1>(all_indices.sort(/*stable=*/true, 0, false));
  at::Tensor sorted = all_indices.index_select(0, order);
  at::Tensor first = at::ones_like(sorted, at::kBool);
  first.slice(0, 1).copy_(sorted.slice(0, 1) != sorted.slice(0, 0, -1));
  order = order.masked_select(first);
  at::Tensor predictions = all.index_select(0, order);
  c10::impl::GenericDict file(c10::StringType::get(), c10::AnyType::get());
  file.insert("predictions", boolean ? predictions.to(at::kBool) : predictions);
  file.insert("indices", sorted.masked_select(first));
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  core::save_pickle(file, path);
  const std::int64_t samples = predictions.size(0);
  log_.info("predictions of " + std::to_string(samples) + (samples == 1 ? " sample" : " samples") + " written to " + path +
            " ([trainer] predict_output: {\"predictions\", \"indices\"}, torch.load reads it)");
}

}  // namespace tessera::host
