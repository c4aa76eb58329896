// The `ddp` strategy plugin driven directly (core::PluginLoader, real Gloo ranks through
// run_ranks): ranks start from different weights and end equal to a serial full-batch
// reference (broadcast at setup, bucketed averaged all-reduce), no_sync micro-batches,
// and only rank 0 writing checkpoints. Whole-trainer parity on 1-4 ranks is in tests/parity.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "multiprocess.hpp"
#include "plugin_loader.hpp"
#include "tessera/sdk/checkpoint_io.hpp"
#include "tessera/sdk/module.hpp"
#include "tessera/sdk/precision.hpp"
#include "tessera/sdk/strategy.hpp"
#include "tessera/sdk/toml_options.hpp"

namespace {

namespace sdk = tessera::sdk;

constexpr std::int64_t kGlobalBatch = 12;  // divisible by 1, 2, 3 and 4 ranks
constexpr double kLr = 0.1;

/// Linear(5, 70) - Tanh - Linear(70, 3) with mean squared error: 1400, 280, 840 and 12 bytes.
torch::nn::Sequential make_network(std::uint64_t seed) {
  at::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(5, 70), torch::nn::Tanh(), torch::nn::Linear(70, 3));
}

class TinyModule final : public sdk::Module {
 public:
  explicit TinyModule(std::uint64_t seed) : seed_(seed) {}
  void configure_model() override { network_ = make_network(seed_); }
  std::shared_ptr<torch::nn::Module> network() override { return network_.ptr(); }
  sdk::StepOutput training_step(const sdk::Batch& batch, std::int64_t) override {
    sdk::StepOutput out;
    out.loss = (network_->forward(batch.input) - batch.target).pow(2).mean();
    out.items = batch.size();
    return out;
  }
  sdk::StepOutput validation_step(const sdk::Batch& batch, std::int64_t i) override { return training_step(batch, i); }
  sdk::StepOutput test_step(const sdk::Batch& batch, std::int64_t i) override { return training_step(batch, i); }
  at::Tensor predict_step(const sdk::Batch& batch, std::int64_t) override { return network_->forward(batch.input); }
  sdk::Checkpoint hyper_parameters() const override { return sdk::make_checkpoint(); }

 private:
  std::uint64_t seed_;
  torch::nn::Sequential network_{nullptr};
};

/// Records which ranks were asked to write.
class SpyCheckpointIO final : public sdk::CheckpointIO {
 public:
  explicit SpyCheckpointIO(std::int64_t rank) : rank_(rank) {}
  void save_checkpoint(const sdk::Checkpoint&, const std::string& path, const sdk::ShardInfo&) override {
    std::ofstream(path + ".written-by-rank-" + std::to_string(rank_)) << "x";
  }
  void finalize_checkpoint(const std::string&, const sdk::ShardInfo&) override {}
  sdk::Checkpoint load_checkpoint(const std::string&, const sdk::ShardInfo&) override { return sdk::make_checkpoint(); }
  sdk::CheckpointMetadata read_metadata(const std::string&) override { return {}; }
  void remove_checkpoint(const std::string&) override {}

 private:
  std::int64_t rank_;
};

/// The fixed global batch of micro-batch `step`.
sdk::Batch global_batch(std::int64_t step) {
  at::manual_seed(1000 + step);
  return {at::randn({kGlobalBatch, 5}), at::randn({kGlobalBatch, 3})};
}

sdk::Batch rank_slice(const sdk::Batch& batch, std::int64_t rank, std::int64_t world) {
  const std::int64_t n = kGlobalBatch / world;
  return {batch.input.narrow(0, rank * n, n), batch.target.narrow(0, rank * n, n)};
}

struct Reference {
  std::vector<double> losses;
  std::vector<at::Tensor> params;
};

/// Serial full-batch SGD from seed 0 with `accumulate` micro-batches per step (losses of
/// every micro-batch, each micro-batch loss divided by `accumulate` for the gradient).
Reference serial_reference(std::int64_t steps, std::int64_t accumulate) {
  auto network = make_network(0);
  torch::optim::SGD sgd(network->parameters(), torch::optim::SGDOptions(kLr));
  Reference ref;
  for (std::int64_t s = 0; s < steps; ++s) {
    for (std::int64_t m = 0; m < accumulate; ++m) {
      sdk::Batch b = global_batch(s * accumulate + m);
      at::Tensor loss = (network->forward(b.input) - b.target).pow(2).mean();
      ref.losses.push_back(loss.item<double>());
      (loss / static_cast<double>(accumulate)).backward();
    }
    sgd.step();
    sgd.zero_grad();
  }
  for (const auto& p : network->parameters()) ref.params.push_back(p.detach().clone());
  return ref;
}

struct Ddp {
  std::shared_ptr<sdk::Strategy> strategy;
  std::shared_ptr<TinyModule> module;
};

Ddp make_ddp(tessera::core::PluginLoader& loader, const sdk::ClusterInfo& cluster, const std::string& bucket_cap_mb) {
  sdk::Options options = sdk::make_options(
      "strategy", "ddp_test", toml::parse("accelerator = \"cpu\"\nbucket_cap_mb = " + bucket_cap_mb + "\n"));
  auto strategy = loader.create_as<sdk::Strategy>(sdk::PluginKind::strategy, "ddp", options);
  sdk::Options precision_options;
  auto precision = loader.create_as<sdk::Precision>(sdk::PluginKind::precision, "precision", precision_options);
  strategy->connect(precision, std::make_shared<SpyCheckpointIO>(cluster.global_rank));
  strategy->setup_environment(cluster);
  // Every rank starts from different weights: setup must broadcast rank 0's.
  auto module = std::make_shared<TinyModule>(cluster.global_rank == 0 ? 0 : 77 + cluster.global_rank);
  module->configure_model();
  sdk::OptimizerSettings settings;
  settings.name = "sgd";
  settings.lr = kLr;
  strategy->setup(module, settings);
  return {strategy, module};
}

/// Runs `steps` optimizer steps of `accumulate` micro-batches on this rank's slices and
/// compares losses (averaged over ranks) and final parameters with the serial reference.
void check_against_reference(const sdk::ClusterInfo& cluster, const std::string& bucket_cap_mb,
                             std::int64_t accumulate) {
  const std::int64_t steps = 3;
  Reference ref = serial_reference(steps, accumulate);
  tessera::core::PluginLoader loader({tessera::testing::plugin_dir()});
  Ddp ddp = make_ddp(loader, cluster, bucket_cap_mb);
  const std::int64_t rank = cluster.global_rank, world = cluster.world_size;
  std::size_t micro = 0;
  for (std::int64_t s = 0; s < steps; ++s) {
    for (std::int64_t m = 0; m < accumulate; ++m, ++micro) {
      sdk::Batch b = rank_slice(global_batch(s * accumulate + m), rank, world);
      sdk::StepOutput out = ddp.strategy->training_step(b, static_cast<std::int64_t>(micro));
      double mean_loss = ddp.strategy->reduce(out.loss.detach(), sdk::ReduceOp::mean).item<double>();
      EXPECT_NEAR(mean_loss, ref.losses[micro], 1e-6) << "micro-batch " << micro;
      const bool last = m + 1 == accumulate;
      ddp.strategy->backward(out.loss / static_cast<double>(accumulate), /*sync_gradients=*/last);
      if (!last && world > 1) {
        // no_sync: this rank's gradient is its own, not yet the average.
        at::Tensor g = ddp.module->network()->parameters()[0].grad().reshape({1, -1});
        at::Tensor all = ddp.strategy->all_gather(g).reshape({world, -1});
        EXPECT_FALSE(at::allclose(all[0], all[1])) << "gradients were reduced on a no_sync micro-batch";
      }
    }
    ddp.strategy->optimizer_step(0.0, 2.0);
  }
  auto params = ddp.module->network()->parameters();
  ASSERT_EQ(params.size(), ref.params.size());
  for (std::size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(at::allclose(params[i], ref.params[i], 1e-6, 1e-6))
        << "parameter " << i << " on rank " << rank << " differs by "
        << (params[i] - ref.params[i]).abs().max().item<double>();
}

class DDP : public ::testing::TestWithParam<int> {};

TEST_P(DDP, MatchesSerialFullBatchWithManyBuckets) {
  // 0.001 MB = 1048 bytes: three buckets (12 + 840, 280, 1400 bytes in gradient order).
  tessera::testing::run_ranks(GetParam(), std::chrono::seconds(90), [](const sdk::ClusterInfo& cluster) {
    check_against_reference(cluster, "0.001", 1);
  });
}

TEST_P(DDP, MatchesSerialFullBatchWithOneBucket) {
  tessera::testing::run_ranks(GetParam(), std::chrono::seconds(90), [](const sdk::ClusterInfo& cluster) {
    check_against_reference(cluster, "25.0", 1);
  });
}

TEST_P(DDP, NoSyncAccumulatesLocallyThenAverages) {
  tessera::testing::run_ranks(GetParam(), std::chrono::seconds(90), [](const sdk::ClusterInfo& cluster) {
    check_against_reference(cluster, "0.001", 3);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, DDP, ::testing::Values(1, 2, 3, 4));

TEST(DDPPlan, RanksThatBucketDifferentlyFailBeforeTheFirstCollectiveNamingTheBucket) {
  // Rank 0 buckets by 1 kB (three buckets), rank 1 by 25 MB (one): their all-reduces would not match.
  tessera::testing::run_ranks(2, std::chrono::seconds(60), [](const sdk::ClusterInfo& cluster) {
    tessera::core::PluginLoader loader({tessera::testing::plugin_dir()});
    try {
      make_ddp(loader, cluster, cluster.global_rank == 0 ? "0.001" : "25.0");
      ADD_FAILURE() << "rank " << cluster.global_rank << ": no error";
    } catch (const sdk::Error& e) {
      const std::string text = e.what();
      EXPECT_NE(text.find("DDP: the ranks planned different gradient buckets; the first difference is gradient "
                          "bucket #0"),
                std::string::npos)
          << text;
      // This rank's first bucket, by its parameters (gradient order: the last layer first).
      EXPECT_NE(text.find(cluster.global_rank == 0 ? "'Float: 2.bias[3] 2.weight[210]'"
                                                   : "'Float: 2.bias[3] 2.weight[210] 0.bias[70] 0.weight[350]'"),
                std::string::npos)
          << text;
    }
  });
}

TEST(DDPCheckpoint, OnlyRankZeroWrites) {
  // The ranks re-run this body in child processes: name the directory after the parent.
  const bool child = std::getenv("TESSERA_TEST_RANK") != nullptr;
  std::string dir = ::testing::TempDir() + "tessera-ddp-ckpt-" + std::to_string(child ? ::getppid() : ::getpid());
  if (!child) {
    tessera::testing::remove_dir(dir);
    std::filesystem::create_directories(dir);
  }
  tessera::testing::run_ranks(3, std::chrono::seconds(90), [&](const sdk::ClusterInfo& cluster) {
    tessera::core::PluginLoader loader({tessera::testing::plugin_dir()});
    Ddp ddp = make_ddp(loader, cluster, "1.0");
    ddp.strategy->save_checkpoint(sdk::make_checkpoint(), dir + "/last.ckpt");
    // save_checkpoint returns after a barrier: rank 0's file is there for every rank.
    EXPECT_TRUE(std::filesystem::exists(dir + "/last.ckpt.written-by-rank-0"));
    EXPECT_FALSE(std::filesystem::exists(dir + "/last.ckpt.written-by-rank-" + std::to_string(cluster.global_rank)) &&
                 cluster.global_rank != 0)
        << "rank " << cluster.global_rank << " wrote a full checkpoint";
  });
  EXPECT_TRUE(std::filesystem::exists(dir + "/last.ckpt.written-by-rank-0"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/last.ckpt.written-by-rank-1"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/last.ckpt.written-by-rank-2"));
}

}  // namespace
