// fsdp2 through `tessera fit` on real ranks (Gloo): checkpoints written by fsdp2 resume under
// other meshes and strategies (and the reverse) exactly where an uninterrupted run is; the
// optimizer steps on N-D dim-0 shards under the original names; bad sizes fail before work.
#include <gtest/gtest.h>

#include <fstream>

#include <ATen/ATen.h>

#include "multiprocess.hpp"

namespace {

using tessera::testing::checkpoint_state;
using tessera::testing::metric_series;
using tessera::testing::run_dir;
using tessera::testing::run_tessera;

constexpr int kGlobalBatch = 12;

struct FitRun {
  std::map<std::int64_t, double> losses;
  std::string dir;  ///< the run folder
};

/// The gpt with 4 heads (tp 2 splits them) on fortunes; Adam unless `sgd` (SGD with momentum
/// for runs compared to 2e-5: Adam would turn rounding noise of reordered sums into steps).
std::string config(const std::string& dir, int max_steps, const std::string& extra = "", bool sgd = false) {
  std::ofstream(dir + "/run.toml") << "[trainer]\nmax_steps = " << max_steps << "\nlog_every_n_steps = 1\nseed = 5\n"
                                   << "checkpoint_every_n_steps = 3\ndefault_root_dir = \"" << dir
                                   << "\"\nenable_progress_bar = false\n"
                                   << (sgd ? "[optimizer]\nname = \"sgd\"\nlr = 0.05\nmomentum = 0.9\n"
                                           : "[optimizer]\nname = \"adamw\"\nlr = 0.003\n")
                                   << "schedule = \"constant\"\n"
                                   << "[model]\nplugin = \"gpt\"\nn_layer = 2\nn_head = 4\nn_embd = 36\nblock_size = 16\n"
                                   << "[data]\nplugin = \"text\"\nblock_size = 16\nstride = 61\n"
                                   << extra;
  return dir + "/run.toml";
}

/// `strategy`: "fsdp2", "fsdp" or "single_device" plus --set flags; `world` ranks of which
/// `tp` see the same batch (tensor_parallel_size).
FitRun fit(const std::string& name, const std::string& strategy, int world, int max_steps, const std::string& ckpt = "",
           const std::string& sets = "", int tp = 1, bool sgd = false) {
  std::string dir = tessera::testing::fresh_dir(name);
  auto result = run_tessera("fit --config " + config(dir, max_steps, "", sgd) + " --set launch.devices=" +
                                std::to_string(world) + " --set data.batch_size=" + std::to_string(kGlobalBatch * tp / world) +
                                (tp > 1 ? " --set strategy.tensor_parallel_size=" + std::to_string(tp) : "") +
                                " --set strategy.plugin=" + strategy + " " + sets +
                                (ckpt.empty() ? "" : " --ckpt-path " + ckpt),
                            "", 240);
  EXPECT_EQ(result.exit_code, 0) << result.output;
  return FitRun{metric_series(run_dir(dir) + "/metrics.csv", "train", "train_loss"), run_dir(dir)};
}

/// Steps 4-6 after a resume from step 3 match the uninterrupted run (Adam: only with the
/// right moments and step count); `weights`: the final full checkpoints match too (sharded
/// runs write folders, checked through their losses).
void expect_same_tail(const FitRun& reference, const FitRun& resumed, const std::string& what, bool weights) {
  for (std::int64_t step : {4, 5, 6}) {
    ASSERT_TRUE(resumed.losses.count(step)) << what << ": no loss at step " << step;
    EXPECT_NEAR(resumed.losses.at(step), reference.losses.at(step), 2e-5 * reference.losses.at(step))
        << what << " step " << step;
  }
  if (!weights) return;
  auto a = checkpoint_state(reference.dir + "/checkpoints/last.ckpt");
  auto b = checkpoint_state(resumed.dir + "/checkpoints/last.ckpt");
  ASSERT_EQ(a.size(), b.size()) << what;
  // Within a tenth of AdamW's lr (3e-3): a moment or step count left behind moves nearly every
  // element by ~lr, while an element whose first gradient all but cancels takes a rounding-noise
  // sized first step anywhere between -lr and lr (mhat / sqrt(vhat) = g / |g|): 6e-5 was seen.
  for (const auto& [name, tensor] : a)
    EXPECT_LE((b.at(name) - tensor).abs().max().item<double>(), 3e-4) << what << ": " << name;
}

// One reference run of 6 steps; a 3-step run under each source writes step=3.ckpt; each
// target resumes from it to step 6 and must land on the reference's losses and weights.
// Adam: the optimizer state (moments, step) must travel too, or step 4 differs.
TEST(Checkpoints, MoveBetweenMeshesAndStrategies) {
  FitRun reference = fit("reference", "single_device", 1, 6);
  struct Source {
    std::string name, strategy;
    int world;
    std::string sets;
    int tp = 1;
  };
  const std::vector<Source> sources = {
      {"fsdp2-dp2-full", "fsdp2", 2, ""},
      {"fsdp2-dp2-tp2-full", "fsdp2", 4, "", 2},
      {"single-full", "single_device", 1, ""},
      {"fsdp2-dp2-sharded", "fsdp2", 2, "--set strategy.state_dict_type=sharded --set checkpoint_io.plugin=distributed"},
      {"fsdp-2-sharded", "fsdp", 2, "--set strategy.state_dict_type=sharded --set checkpoint_io.plugin=distributed"},
  };
  for (const auto& source : sources) {
    FitRun first = fit(source.name, source.strategy, source.world, 3, "", source.sets, source.tp);
    const std::string ckpt = first.dir + "/checkpoints/step=3.ckpt";
    const bool sharded = source.sets.find("sharded") != std::string::npos;
    std::vector<Source> targets = {{"fsdp2-dp3", "fsdp2", 3, ""}, {"fsdp2-dp4", "fsdp2", 4, ""}};
    if (source.strategy == "fsdp2") {
      targets.push_back({"fsdp-2", "fsdp", 2, ""});
      if (!sharded) targets.push_back({"single", "single_device", 1, ""});
    }
    if (source.strategy == "single_device") targets.push_back({"fsdp2-dp2-tp2", "fsdp2", 4, "", 2});
    if (source.tp > 1) {
      targets = {{"fsdp2-dp4", "fsdp2", 4, ""}, {"fsdp2-dp3", "fsdp2", 3, ""}, {"single", "single_device", 1, ""},
                 {"fsdp-2", "fsdp", 2, ""}};
    }
    for (auto& target : targets) {
      if (sharded) target.sets += " --set strategy.state_dict_type=sharded --set checkpoint_io.plugin=distributed";
      SCOPED_TRACE(source.name + " -> " + target.name);
      FitRun resumed =
          fit(source.name + "-to-" + target.name, target.strategy, target.world, 6, ckpt, target.sets, target.tp);
      expect_same_tail(reference, resumed, source.name + " -> " + target.name, !sharded);
    }
  }
}

// Sharded checkpoints under tensor parallelism: each rank saves its dim-0 shard of its tp
// piece as boxes of the full tensors (a q/k/v piece: up to three), read back re-cut on another
// mesh or strategy, and a flat fsdp checkpoint loads into dp 2 x tp 2; training goes on where
// the uninterrupted run is (tests/checkpoint's ResumeMatrix checks the same loads bitwise).
TEST(Checkpoints, ShardedTensorParallelPiecesMoveBetweenMeshes) {
  const std::string sharded = "--set strategy.state_dict_type=sharded --set checkpoint_io.plugin=distributed";
  FitRun reference = fit("tp-sharded-reference", "single_device", 1, 6);
  FitRun tp = fit("tp-sharded-source", "fsdp2", 4, 3, "", sharded, 2);
  FitRun flat = fit("flat-sharded-source", "fsdp", 2, 3, "", sharded);
  struct Move {
    const FitRun* source;
    std::string name, strategy;
    int world, tp;
  };
  for (const Move& m : std::vector<Move>{{&tp, "tp-to-fsdp2-dp3", "fsdp2", 3, 1},
                                         {&tp, "tp-to-fsdp-2", "fsdp", 2, 1},
                                         {&tp, "tp-to-single", "single_device", 1, 1},
                                         {&flat, "flat-to-fsdp2-dp2-tp2", "fsdp2", 4, 2}}) {
    SCOPED_TRACE(m.name);
    FitRun resumed = fit(m.name, m.strategy, m.world, 6, m.source->dir + "/checkpoints/step=3.ckpt",
                         m.strategy == "single_device" ? "--set checkpoint_io.plugin=distributed" : sharded, m.tp);
    expect_same_tail(reference, resumed, m.name, false);
  }
}

/// Every step's loss within 2e-5 of the reference run's, and the final full checkpoints' tensors
/// (full shapes: tp pieces unsharded) within 2e-5.
void expect_tracks(const FitRun& reference, const FitRun& run) {
  ASSERT_EQ(run.losses.size(), reference.losses.size());
  for (const auto& [step, loss] : reference.losses) EXPECT_NEAR(run.losses.at(step), loss, 2e-5 * loss) << "step " << step;
  auto a = checkpoint_state(reference.dir + "/checkpoints/last.ckpt");
  auto b = checkpoint_state(run.dir + "/checkpoints/last.ckpt");
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, tensor] : a) {
    ASSERT_EQ(b.at(name).sizes(), tensor.sizes()) << name << ": full shapes in the checkpoint";
    EXPECT_TRUE(at::allclose(b.at(name), tensor, 2e-5, 2e-5)) << name;
  }
}

// Tensor parallelism composed with fully_shard: dp x tp = 1 x 2 and 2 x 2 (q, k, v split by
// head, MLP split; tp ranks see the same batch) track the single-device run, with clipping
// (the norm sums the tp pieces over tp, the replicated parameters once).
TEST(TensorParallel, DpTimesTpMatchesSingleDevice) {
  const std::string clip = "--set trainer.gradient_clip_val=0.05";
  FitRun reference = fit("tp-reference", "single_device", 1, 6, "", clip, 1, /*sgd=*/true);
  for (int world : {2, 4}) {
    SCOPED_TRACE("dp " + std::to_string(world / 2) + " x tp 2");
    expect_tracks(reference, fit("tp-" + std::to_string(world), "fsdp2", world, 6, "", clip, 2, /*sgd=*/true));
  }
}

// Clipping by value under tensor parallelism: each rank clamps its pieces and the replicated
// parameters element by element, as one device clamps the whole gradients.
TEST(TensorParallel, ClippingByValueMatchesSingleDevice) {
  const std::string clip = "--set trainer.gradient_clip_val=0.002 --set trainer.gradient_clip_algorithm=value";
  FitRun reference = fit("tp-value-reference", "single_device", 1, 6, "", clip, 1, /*sgd=*/true);
  FitRun unclipped = fit("tp-value-unclipped", "single_device", 1, 6, "", "", 1, /*sgd=*/true);
  double largest = 0;
  for (const auto& [step, loss] : reference.losses) largest = std::max(largest, std::abs(unclipped.losses.at(step) - loss));
  EXPECT_GT(largest, 1e-4) << "the clip value does not bite on this model: the comparison proves nothing";
  expect_tracks(reference, fit("tp-value-4", "fsdp2", 4, 6, "", clip, 2, /*sgd=*/true));
}

// NeMo's tensor_init_context with tensor parallelism (deferred_init = true, tp 2): no rank
// holds the model; each unit draws its full weights one layer at a time (the gpt's
// init_parameters at full shape) and keeps its pieces. The gpt's deferred values are other
// draws than its eager build's (units come in another order than construction), so the
// reference is the deferred run without tp: with lr = 0 the final checkpoints (the initial
// weights, unsharded over tp) are bitwise the same at dp 1 x tp 2 and dp 2 x tp 2, and the
// runs that train track it as the eager tp runs track single_device.
TEST(TensorParallel, DeferredInitStartsFromTheUnsplitDeferredModel) {
  const std::string deferred = "--set strategy.deferred_init=true";
  const std::string frozen = deferred + " --set optimizer.lr=0";
  FitRun initial = fit("tp-deferred-initial", "fsdp2", 2, 1, "", frozen, 1, /*sgd=*/true);
  auto initial_state = checkpoint_state(initial.dir + "/checkpoints/last.ckpt");
  ASSERT_FALSE(initial_state.empty());
  const std::string clip = deferred + " --set trainer.gradient_clip_val=0.05";
  FitRun reference = fit("tp-deferred-reference", "fsdp2", 2, 6, "", clip, 1, /*sgd=*/true);
  for (int world : {2, 4}) {
    const std::string what = "deferred dp " + std::to_string(world / 2) + " x tp 2";
    SCOPED_TRACE(what);
    FitRun start = fit("tp-deferred-initial-" + std::to_string(world), "fsdp2", world, 1, "", frozen, 2, /*sgd=*/true);
    auto state = checkpoint_state(start.dir + "/checkpoints/last.ckpt");
    ASSERT_EQ(state.size(), initial_state.size());
    for (const auto& [name, tensor] : initial_state) {
      ASSERT_TRUE(state.count(name)) << name;
      EXPECT_TRUE(state.at(name).sizes() == tensor.sizes() && at::equal(state.at(name), tensor))
          << name << ": the initial weights differ from the unsplit deferred model's";
    }
    expect_tracks(reference, fit("tp-deferred-" + std::to_string(world), "fsdp2", world, 6, "", clip, 2, /*sgd=*/true));
  }
}

// [strategy.mp_policy] by effect, through the training it changes (SGD: a rounded gradient
// moves the step, where Adam's first step would hide it): param_dtype gathers the parameters in
// bf16, so the first forward already differs; reduce_dtype reduces the gradients in bf16, so the
// first forward is the same and the next one is not. Each within bf16's rounding of the fp32 run.
// (output_dtype and cast_forward_inputs: OneRank.MixedPrecisionDtypesAreWhatAUnitReturns.)
TEST(MixedPrecisionKeys, EachOverrideChangesTrainingWhereItActs) {
  auto run = [](const std::string& name, const std::string& key) {
    return fit("mp-" + name, "fsdp2", 2, 2, "", key.empty() ? "" : "--set strategy.mp_policy." + key + "=bfloat16", 1,
               /*sgd=*/true)
        .losses;
  };
  const auto fp32 = run("fp32", ""), params = run("param", "param_dtype"), reduced = run("reduce", "reduce_dtype");
  for (const auto* losses : {&fp32, &params, &reduced}) ASSERT_EQ(losses->size(), 2u);
  auto near = [&](const std::map<std::int64_t, double>& losses, std::int64_t step) {
    EXPECT_NEAR(losses.at(step), fp32.at(step), 2e-2 * fp32.at(step)) << "step " << step;
  };
  EXPECT_NE(params.at(1), fp32.at(1)) << "param_dtype = bfloat16 left the first forward in fp32";
  near(params, 1);
  EXPECT_EQ(reduced.at(1), fp32.at(1)) << "reduce_dtype changed the forward before any reduction";
  EXPECT_NE(reduced.at(2), fp32.at(2)) << "reduce_dtype = bfloat16 left the gradients' reduction in fp32";
  near(reduced, 2);
}

TEST(Errors, MeshSizesThatDoNotMakeTheWorldFailBeforeWork) {
  std::string dir = tessera::testing::fresh_dir("bad-sizes");
  auto result = run_tessera("fit --config " + config(dir, 2) +
                                " --set launch.devices=4 --set strategy.plugin=fsdp2 --set strategy.data_parallel_size=3",
                            "", 120);
  EXPECT_NE(result.exit_code, 0);
  EXPECT_NE(result.output.find("data_parallel_size"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("= 3 ranks, but the job has 4"), std::string::npos) << result.output;
  EXPECT_EQ(result.output.find("step 1"), std::string::npos) << "no training step may run: " << result.output;

  // reshard_after_forward = k must divide the shard size; the valid sizes are listed.
  auto bad_k = run_tessera("fit --config " + config(dir, 2) +
                               " --set launch.devices=4 --set strategy.plugin=fsdp2 --set strategy.reshard_after_forward=3",
                           "", 120);
  EXPECT_NE(bad_k.exit_code, 0);
  EXPECT_NE(bad_k.output.find("reshard_after_forward = 3 must divide the data-parallel shard size 4; valid: 1, 2, 4"),
            std::string::npos)
      << bad_k.output;
  EXPECT_EQ(bad_k.output.find("step 1"), std::string::npos) << "no training step may run: " << bad_k.output;
}

}  // namespace
