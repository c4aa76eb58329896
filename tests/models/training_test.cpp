// Short real-data runs of the shipped plugins, driven directly (loader + a plain AdamW loop):
// the cnn on Debian's Fashion-MNIST and the gpt on Debian's fortunes corpus.
#include <chrono>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/optim/optimizer.h>

#include "tessera/core/plugin_loader.hpp"
#include "tessera/sdk/data.hpp"
#include "tessera/sdk/module.hpp"
#include "tessera/sdk/toml_options.hpp"

namespace {

namespace sdk = tessera::sdk;
using tessera::core::PluginLoader;

PluginLoader& loader() {
  static PluginLoader instance({PLUGIN_DIR});
  return instance;
}

template <typename T>
std::shared_ptr<T> make(sdk::PluginKind kind, const std::string& name, const std::string& toml_text) {
  sdk::Options options =
      sdk::make_options(kind == sdk::PluginKind::model ? "model" : "data", "test.toml", toml::parse(toml_text));
  auto object = loader().create_as<T>(kind, name, options);
  options.check_all_used();
  return object;
}

std::unique_ptr<torch::optim::Optimizer> adamw(sdk::Module& model, double lr) {
  std::vector<sdk::NamedParameter> params;
  for (const auto& item : model.network()->named_parameters()) params.push_back({item.key(), item.value()});
  sdk::OptimizerSettings settings;
  settings.lr = lr;
  settings.weight_decay = 0.01;
  return model.configure_optimizers(params, settings);
}

std::vector<std::int64_t> slice(const at::Tensor& order, std::int64_t start, std::int64_t n) {
  at::Tensor s = order.narrow(0, start, n).contiguous();
  return std::vector<std::int64_t>(s.data_ptr<std::int64_t>(), s.data_ptr<std::int64_t>() + n);
}

/// Mean of `metric` over the first `batches` batches of `dataset` in order, in eval mode.
double evaluate(sdk::Module& model, sdk::Dataset& dataset, std::int64_t batch_size, std::int64_t batches,
                const std::string& metric) {
  model.network()->train(false);
  torch::NoGradGuard no_grad;
  std::vector<std::int64_t> all(static_cast<std::size_t>(dataset.size()));
  std::iota(all.begin(), all.end(), 0);
  double sum = 0;
  std::int64_t seen = 0;
  for (std::int64_t b = 0; b < batches && b * batch_size < dataset.size(); ++b) {
    const std::int64_t n = std::min(batch_size, dataset.size() - b * batch_size);
    std::vector<std::int64_t> indices(all.begin() + b * batch_size, all.begin() + b * batch_size + n);
    sum += model.validation_step(dataset.get_batch(indices), b).metrics.at(metric).item<double>() * n;
    seen += n;
  }
  model.network()->train(true);
  return sum / static_cast<double>(seen);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

TEST(Training, CnnReaches85PercentOnFashionMNISTTestSet) {
  at::manual_seed(0);
  auto model = make<sdk::Module>(sdk::PluginKind::model, "cnn", "channels1 = 16\nchannels2 = 32\nhidden = 64\n");
  auto data = make<sdk::DataModule>(sdk::PluginKind::data, "fashion_mnist", "val_size = 5000\n");
  model->configure_model();
  data->setup("fit");
  auto optimizer = adamw(*model, 2e-3);
  auto train = data->train_dataset();

  const auto start = std::chrono::steady_clock::now();
  const std::int64_t batch_size = 64, steps = 700;
  at::Tensor order = at::randperm(train->size(), at::kLong);
  for (std::int64_t step = 0; step < steps; ++step) {
    sdk::StepOutput out = model->training_step(train->get_batch(slice(order, step * batch_size, batch_size)), step);
    optimizer->zero_grad();
    out.loss.backward();
    optimizer->step();
  }
  const double train_s = seconds_since(start);
  const double accuracy = evaluate(*model, *data->test_dataset(), 1000, 10, "acc");
  std::cout << "cnn: " << steps << " steps of " << batch_size << " in " << train_s << " s, test accuracy "
            << accuracy << "\n";
  EXPECT_GE(accuracy, 0.85);
}

TEST(Training, GptLowersValidationLossOnFortunes) {
  at::manual_seed(0);
  auto model = make<sdk::Module>(sdk::PluginKind::model, "gpt", "n_layer = 2\nn_head = 4\nn_embd = 64\nblock_size = 64\n");
  auto data = make<sdk::DataModule>(sdk::PluginKind::data, "text", "block_size = 64\n");
  model->configure_model();
  data->setup("fit");
  auto optimizer = adamw(*model, 3e-3);
  auto train = data->train_dataset();
  auto val = data->val_dataset();

  const double before = evaluate(*model, *val, 32, 16, "loss");
  const auto start = std::chrono::steady_clock::now();
  const std::int64_t batch_size = 16, steps = 300;
  at::Tensor order = at::randperm(train->size(), at::kLong);
  for (std::int64_t step = 0; step < steps; ++step) {
    sdk::StepOutput out = model->training_step(train->get_batch(slice(order, step * batch_size, batch_size)), step);
    optimizer->zero_grad();
    out.loss.backward();
    optimizer->step();
  }
  const double train_s = seconds_since(start);
  const double after = evaluate(*model, *val, 32, 16, "loss");
  std::cout << "gpt: " << steps << " steps in " << train_s << " s, validation loss " << before << " -> " << after
            << "\n";
  EXPECT_NEAR(before, std::log(256.0), 0.3);  // untrained: about uniform over bytes
  EXPECT_LT(after, before - 2.0);
}

}  // namespace
