// Tensor parallelism (sdk/tensor_parallel.hpp, core::make_tensor_parallel_group, the gpt
// model's parallelize) against the same computation on one rank: real processes over Gloo
// (run_ranks), fp32, tight. Every rank computes the single-device reference itself (same seed,
// same batch) and compares its own pieces, and the pieces unsharded, with it.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "fake_communicator.hpp"
#include "multiprocess.hpp"
#include "tessera/sdk/autocast.hpp"
#include "tessera/core/comm.hpp"
#include "tessera/core/deferred_init.hpp"
#include "plugin_loader.hpp"
#include "tessera/core/tp_group.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/module.hpp"
#include "tessera/sdk/tensor_parallel.hpp"
#include "tessera/sdk/toml_options.hpp"
#include "tessera/toolkit/tensor_parallel.hpp"

namespace {

namespace sdk = tessera::sdk;
namespace toolkit = tessera::toolkit;
using sdk::TensorParallelPlacement;
using GroupPtr = std::shared_ptr<sdk::TensorParallelGroup>;

constexpr double kRtol = 1e-5, kAtol = 1e-6;

::testing::AssertionResult close(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  if (!actual.defined() || !expected.defined())
    return ::testing::AssertionFailure() << what << ": undefined (actual " << actual.defined() << ", expected "
                                         << expected.defined() << ")";
  if (actual.sizes() != expected.sizes())
    return ::testing::AssertionFailure() << what << ": shape " << actual.sizes() << " vs " << expected.sizes();
  if (!at::allclose(actual, expected, kRtol, kAtol))
    return ::testing::AssertionFailure() << what << ": max difference "
                                         << (actual - expected).abs().max().item<double>();
  return ::testing::AssertionSuccess();
}

GroupPtr gloo_group(const sdk::ClusterInfo& cluster) {
  return tessera::core::make_tensor_parallel_group(tessera::core::make_communicator(cluster, c10::kCPU));
}

/// A group that only knows its place: for construction and checks that must not communicate.
class PlaceOnlyGroup final : public sdk::TensorParallelGroup {
 public:
  PlaceOnlyGroup(std::int64_t rank, std::int64_t size) : rank_(rank), size_(size) {}
  std::int64_t rank() const override { return rank_; }
  std::int64_t size() const override { return size_; }
  void all_reduce_sum(at::Tensor&) override { ADD_FAILURE() << "unexpected all_reduce_sum"; }
  at::Tensor all_gather(const at::Tensor& t, std::int64_t) override {
    ADD_FAILURE() << "unexpected all_gather";
    return t;
  }

 private:
  std::int64_t rank_, size_;
};

// --- shard / unshard -----------------------------------------------------------------------

TEST(TensorParallelShard, StridedPiecesAndRoundTripOverThreeRanks) {
  const at::Tensor full = at::arange(18 * 4, at::kFloat).view({18, 4});
  const at::Tensor cube = at::arange(2 * 6 * 3, at::kFloat).view({2, 6, 3});
  tessera::testing::run_fake_ranks(3, [&](tessera::core::CommunicatorPtr world) {
    auto group = tessera::core::make_tensor_parallel_group(world);
    const std::int64_t r = group->rank();
    // stride 3: rows [6 part + 2 r, 6 part + 2 r + 2) of each of the 3 parts
    at::Tensor piece = sdk::tensor_parallel_shard(full, {0, 3}, r, 3);
    std::vector<at::Tensor> expected;
    for (std::int64_t part = 0; part < 3; ++part) expected.push_back(full.narrow(0, 6 * part + 2 * r, 2));
    EXPECT_TRUE(at::equal(piece, at::cat(expected, 0))) << "rank " << r;
    EXPECT_TRUE(at::equal(sdk::tensor_parallel_unshard(piece, {0, 3}, *group), full));
    for (TensorParallelPlacement p : {TensorParallelPlacement{0, 1}, TensorParallelPlacement{0, 2},
                                      TensorParallelPlacement{1, 1}, TensorParallelPlacement{-1, 1}}) {
      const at::Tensor& t = p.dim == 1 ? cube : full;
      at::Tensor local = sdk::tensor_parallel_shard(t, p, r, 3);
      if (p.dim >= 0) EXPECT_EQ(local.size(p.dim), t.size(p.dim) / 3) << "dim " << p.dim << " stride " << p.stride;
      EXPECT_TRUE(at::equal(sdk::tensor_parallel_unshard(local, p, *group), t))
          << "dim " << p.dim << " stride " << p.stride;
    }
  });
}

TEST(TensorParallelShard, PiecesDescribeWhereEachPartSits) {
  const at::Tensor full = at::arange(12 * 5, at::kFloat).view({12, 5});
  for (TensorParallelPlacement p : {TensorParallelPlacement{0, 3}, TensorParallelPlacement{1, 1},
                                    TensorParallelPlacement{0, 1}, TensorParallelPlacement{-1, 1}}) {
    const std::int64_t size = p.dim == 1 ? 5 : 2;
    at::Tensor rebuilt = at::zeros_like(full);
    std::int64_t copied = 0;
    for (std::int64_t r = 0; r < size; ++r) {
      const auto pieces = tessera::core::tensor_parallel_pieces(sdk::tensor_parallel_shard(full, p, r, size), p, r, size);
      EXPECT_EQ(pieces.size(), static_cast<std::size_t>(p.dim < 0 ? 1 : p.stride));
      for (const auto& [piece, local] : pieces) {
        EXPECT_EQ(piece.global_shape, full.sizes().vec());
        copied += tessera::core::copy_overlap(piece, local, tessera::core::TensorPiece::whole(full.sizes()), rebuilt);
      }
      if (p.dim < 0) break;  // replicated: one rank's whole copy is the tensor
    }
    EXPECT_EQ(copied, full.numel()) << "dim " << p.dim << " stride " << p.stride;
    EXPECT_TRUE(at::equal(rebuilt, full)) << "dim " << p.dim << " stride " << p.stride;
  }
}

TEST(TensorParallelShard, UnevenSplitIsRefused) {
  try {
    sdk::tensor_parallel_shard(at::zeros({10, 4}), {0, 3}, 0, 2);
    FAIL() << "10 rows split into 3 parts x 2 ranks";
  } catch (const sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not split into 3 part(s) x 2 rank(s)"), std::string::npos) << e.what();
  }
  auto group = std::make_shared<PlaceOnlyGroup>(0, 4);
  EXPECT_THROW(toolkit::ColumnParallelLinear(toolkit::ColumnParallelLinearOptions(4, 6), group), sdk::Error);
  EXPECT_THROW(toolkit::RowParallelLinear(toolkit::RowParallelLinearOptions(6, 4), group), sdk::Error);
}

// --- placements ----------------------------------------------------------------------------

struct MixedImpl : torch::nn::Module {
  explicit MixedImpl(const GroupPtr& g)
      : qkv(register_module("qkv", toolkit::ColumnParallelLinear(toolkit::ColumnParallelLinearOptions(8, 24).stride(3), g))),
        out(register_module("out", toolkit::RowParallelLinear(toolkit::RowParallelLinearOptions(8, 8), g))),
        head(register_module("head", torch::nn::Linear(8, 5))),
        nobias(register_module("nobias",
                               toolkit::ColumnParallelLinear(toolkit::ColumnParallelLinearOptions(8, 4).bias(false), g))) {}
  toolkit::ColumnParallelLinear qkv;
  toolkit::RowParallelLinear out;
  torch::nn::Linear head;
  toolkit::ColumnParallelLinear nobias;
};
TORCH_MODULE(Mixed);

TEST(TensorParallelPlacements, ListExactlyTheTensorParallelParameters) {
  Mixed net(std::make_shared<PlaceOnlyGroup>(1, 2));
  auto placements = sdk::tensor_parallel_placements(*net);
  std::map<std::string, std::pair<std::int64_t, std::int64_t>> got;
  for (const auto& [name, p] : placements) got[name] = {p.dim, p.stride};
  const std::map<std::string, std::pair<std::int64_t, std::int64_t>> expected{
      {"qkv.weight", {0, 3}}, {"qkv.bias", {0, 3}}, {"out.weight", {1, 1}}, {"nobias.weight", {0, 1}}};
  EXPECT_EQ(got, expected);
  // Names as named_parameters() gives them, local shapes, replicated ones full.
  std::map<std::string, std::vector<std::int64_t>> shapes;
  for (const auto& item : net->named_parameters()) shapes[item.key()] = item.value().sizes().vec();
  const std::map<std::string, std::vector<std::int64_t>> expected_shapes{
      {"qkv.weight", {12, 8}}, {"qkv.bias", {12}},   {"out.weight", {8, 4}}, {"out.bias", {8}},
      {"head.weight", {5, 8}}, {"head.bias", {5}},   {"nobias.weight", {2, 8}}};
  EXPECT_EQ(shapes, expected_shapes);
  // A fresh layer equals the same-seed torch::nn::Linear, cut.
  at::manual_seed(7);
  torch::nn::Linear full(torch::nn::LinearOptions(8, 24));
  at::manual_seed(7);
  toolkit::ColumnParallelLinear piece(toolkit::ColumnParallelLinearOptions(8, 24).stride(3), std::make_shared<PlaceOnlyGroup>(1, 2));
  EXPECT_TRUE(at::equal(piece->weight, sdk::tensor_parallel_shard(full->weight, {0, 3}, 1, 2)));
  EXPECT_TRUE(at::equal(piece->bias, sdk::tensor_parallel_shard(full->bias, {0, 3}, 1, 2)));
  // Under the placements, state-dict names are the plain model's.
  EXPECT_EQ(sdk::tensor_parallel_placements(*full).size(), 0u);
}

// --- the Linear pair -----------------------------------------------------------------------

class TensorParallelLinear : public ::testing::TestWithParam<int> {};

/// Column(5 -> 12) - GELU - Row(12 -> 7) on `size` ranks against the plain MLP, and a
/// stride-3 column layer (5 -> 18, a fused q/k/v) against its full layer cut by parts.
TEST_P(TensorParallelLinear, MatchesThePlainLayersOnOneRank) {
  tessera::testing::run_ranks(GetParam(), std::chrono::seconds(90), [](const sdk::ClusterInfo& cluster) {
    GroupPtr tp = gloo_group(cluster);
    const std::int64_t rank = tp->rank(), size = tp->size();
    at::manual_seed(3);
    torch::nn::Linear fc(5, 12), proj(12, 7), qkv(5, 18);
    const at::Tensor x_full = at::randn({4, 3, 5});
    const at::Tensor upstream = at::randn({4, 3, 7}), upstream_qkv = at::randn({4, 3, 18});

    at::Tensor x_ref = x_full.clone().requires_grad_(true);
    at::Tensor y_ref = proj(at::gelu(fc(x_ref)));
    (y_ref * upstream).sum().backward();

    toolkit::ColumnParallelLinear col(*fc, tp);
    toolkit::RowParallelLinear row(*proj, tp);
    at::Tensor x = x_full.clone().requires_grad_(true);
    at::Tensor y = row(at::gelu(col(x)));
    ASSERT_TRUE(close(y, y_ref, "output"));
    (y * upstream).sum().backward();
    EXPECT_TRUE(close(x.grad(), x_ref.grad(), "input gradient"));
    EXPECT_TRUE(close(sdk::tensor_parallel_unshard(col->weight.grad(), {0, 1}, *tp), fc->weight.grad(), "fc.weight"));
    EXPECT_TRUE(close(sdk::tensor_parallel_unshard(col->bias.grad(), {0, 1}, *tp), fc->bias.grad(), "fc.bias"));
    EXPECT_TRUE(close(sdk::tensor_parallel_unshard(row->weight.grad(), {1, 1}, *tp), proj->weight.grad(), "proj.weight"));
    EXPECT_TRUE(close(row->bias.grad(), proj->bias.grad(), "proj.bias (replicated)"));

    at::Tensor xq_ref = x_full.clone().requires_grad_(true);
    at::Tensor q_ref = qkv(xq_ref);
    (q_ref * upstream_qkv).sum().backward();
    toolkit::ColumnParallelLinear fused(*qkv, tp, /*stride=*/3);
    at::Tensor xq = x_full.clone().requires_grad_(true);
    at::Tensor q = fused(xq);
    ASSERT_TRUE(close(q, sdk::tensor_parallel_shard(q_ref, {2, 3}, rank, size), "fused output piece"));
    (q * sdk::tensor_parallel_shard(upstream_qkv, {2, 3}, rank, size)).sum().backward();
    EXPECT_TRUE(close(xq.grad(), xq_ref.grad(), "fused input gradient"));
    EXPECT_TRUE(close(sdk::tensor_parallel_unshard(fused->weight.grad(), {0, 3}, *tp), qkv->weight.grad(), "qkv.weight"));
    EXPECT_TRUE(close(sdk::tensor_parallel_unshard(fused->bias.grad(), {0, 3}, *tp), qkv->bias.grad(), "qkv.bias"));
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, TensorParallelLinear, ::testing::Values(2, 3));

// --- the gpt model -------------------------------------------------------------------------

tessera::core::PluginLoader& loader() {
  static tessera::core::PluginLoader instance({tessera::testing::plugin_dir()});
  return instance;
}

std::shared_ptr<sdk::Module> make_model(const std::string& name, const std::string& toml_text, std::uint64_t seed) {
  sdk::Options options = sdk::make_options("model", "test.toml", toml::parse(toml_text));
  auto model = loader().create_as<sdk::Module>(sdk::PluginKind::model, name, options);
  options.check_all_used();
  at::manual_seed(seed);
  model->configure_model();
  return model;
}

struct GptCase {
  int tp;
  const char* config;
  int steps;
};

// ctest lists a case by its tp size, not by GoogleTest's dump of the struct's bytes.
void PrintTo(const GptCase& c, std::ostream* os) { *os << "tp " << c.tp; }

class TensorParallelGpt : public ::testing::TestWithParam<GptCase> {};

/// Loss, every parameter's full gradient and a few SGD steps on the local pieces against the
/// unparallelized model (same seed, same batch, same generator state for dropout).
TEST_P(TensorParallelGpt, MatchesTheUnparallelizedModel) {
  const GptCase c = GetParam();
  tessera::testing::run_ranks(c.tp, std::chrono::seconds(120), [&](const sdk::ClusterInfo& cluster) {
    GroupPtr tp = gloo_group(cluster);
    auto reference = make_model("gpt", c.config, 11);
    auto parallel = make_model("gpt", c.config, 11);
    parallel->parallelize(sdk::ParallelContext{tp});
    parallel->parallelize(sdk::ParallelContext{tp});  // applied once: a second call changes nothing
    const auto placements = sdk::tensor_parallel_placements(*parallel->network());
    ASSERT_FALSE(placements.empty());
    EXPECT_EQ(placements.at("blocks.0.attn.weight").stride, 3);
    EXPECT_EQ(placements.at("blocks.0.fc_proj.weight").dim, 1);
    EXPECT_EQ(placements.count("lm_head.weight") + placements.count("wte.weight") + placements.count("blocks.0.ln_1.weight"), 0u);

    auto ref_params = reference->network()->named_parameters();
    auto tp_params = parallel->network()->named_parameters();
    ASSERT_EQ(ref_params.keys(), tp_params.keys());  // state-dict names do not change
    for (const auto& item : ref_params) {  // the tp run starts from the single-device weights
      auto it = placements.find(item.key());
      const TensorParallelPlacement p = it == placements.end() ? TensorParallelPlacement{} : it->second;
      ASSERT_TRUE(at::equal(tp_params[item.key()], sdk::tensor_parallel_shard(item.value(), p, tp->rank(), tp->size())))
          << item.key();
    }

    at::manual_seed(5);
    sdk::Batch batch{at::randint(256, {3, 8}, at::kLong), at::randint(256, {3, 8}, at::kLong)};
    for (int step = 0; step < c.steps; ++step) {
      auto generator = at::globalContext().defaultGenerator(c10::kCPU);
      const at::Tensor rng = generator.get_state();
      at::Tensor ref_loss = reference->training_step(batch, step).loss;
      ref_loss.backward();
      generator.set_state(rng);
      at::Tensor tp_loss = parallel->training_step(batch, step).loss;
      tp_loss.backward();
      EXPECT_TRUE(close(tp_loss, ref_loss, "loss at step " + std::to_string(step)));
      for (const auto& item : ref_params) {
        auto it = placements.find(item.key());
        at::Tensor grad = tp_params[item.key()].grad();
        if (it != placements.end()) grad = sdk::tensor_parallel_unshard(grad, it->second, *tp);
        EXPECT_TRUE(close(grad, item.value().grad(), item.key() + " gradient at step " + std::to_string(step)));
      }
      torch::NoGradGuard no_grad;
      for (auto* params : {&ref_params, &tp_params})
        for (auto& item : *params) {
          item.value().sub_(item.value().grad() * 0.5);
          item.value().mutable_grad().zero_();
        }
    }
    for (const auto& item : ref_params) {
      auto it = placements.find(item.key());
      at::Tensor value = tp_params[item.key()];
      if (it != placements.end()) value = sdk::tensor_parallel_unshard(value, it->second, *tp);
      EXPECT_TRUE(close(value, item.value(), item.key() + " after the steps"));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Plans, TensorParallelGpt,
    ::testing::Values(GptCase{2, "n_layer = 2\nn_head = 4\nn_embd = 16\nblock_size = 8\n", 3},
                      GptCase{3, "n_layer = 2\nn_head = 6\nn_embd = 24\nblock_size = 8\ntie_embeddings = false\n", 3},
                      GptCase{2, "n_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 8\ndropout = 0.2\nbias = false\n", 2}),
    [](const ::testing::TestParamInfo<GptCase>& info) {
      return "tp" + std::to_string(info.param.tp) + "_case" + std::to_string(info.index);
    });

/// bf16-mixed (CPU autocast): the collectives move bf16 activations; loose agreement.
TEST(TensorParallelGpt, Bf16AutocastStaysCloseToTheUnparallelizedModel) {
  tessera::testing::run_ranks(2, std::chrono::seconds(120), [&](const sdk::ClusterInfo& cluster) {
    GroupPtr tp = gloo_group(cluster);
    const char* config = "n_layer = 2\nn_head = 4\nn_embd = 16\nblock_size = 8\n";
    auto reference = make_model("gpt", config, 11);
    auto parallel = make_model("gpt", config, 11);
    parallel->parallelize(sdk::ParallelContext{tp});
    const auto placements = sdk::tensor_parallel_placements(*parallel->network());
    at::manual_seed(5);
    sdk::Batch batch{at::randint(256, {3, 8}, at::kLong), at::randint(256, {3, 8}, at::kLong)};
    tessera::sdk::set_autocast(/*cuda=*/false, true, at::kBFloat16);
    at::Tensor ref_loss = reference->training_step(batch, 0).loss;
    at::Tensor tp_loss = parallel->training_step(batch, 0).loss;
    tessera::sdk::set_autocast(/*cuda=*/false, false, at::kBFloat16);
    at::autocast::clear_cache();
    ref_loss.backward();
    tp_loss.backward();
    EXPECT_NEAR(tp_loss.item<double>(), ref_loss.item<double>(), 2e-2 * ref_loss.item<double>());
    for (const auto& item : reference->network()->named_parameters()) {
      auto it = placements.find(item.key());
      at::Tensor grad = parallel->network()->named_parameters()[item.key()].grad();
      if (it != placements.end()) grad = sdk::tensor_parallel_unshard(grad, it->second, *tp);
      const at::Tensor expected = item.value().grad();
      EXPECT_LE((grad - expected).norm().item<double>(), 0.05 * expected.norm().item<double>() + 1e-6) << item.key();
    }
  });
}

/// What `tessera plan` reads off one traced forward (toolkit::tensor_parallel_traffic) is what the
/// real group all-reduces in that forward and its backward, in fp32 and under bf16 autocast;
/// the planning group (no communication) yields the same graph as a real rank 0.
TEST(TensorParallelTraffic, TheGraphPredictsWhatTheGroupAllReduces) {
  const char* config = "n_layer = 3\nn_head = 4\nn_embd = 16\nblock_size = 8\n";
  tessera::testing::run_ranks(2, std::chrono::seconds(120), [&](const sdk::ClusterInfo& cluster) {
    auto comm = tessera::core::make_communicator(cluster, c10::kCPU);
    auto parallel = make_model("gpt", config, 11);
    parallel->parallelize(sdk::ParallelContext{tessera::core::make_tensor_parallel_group(comm)});
    auto planned = make_model("gpt", config, 11);
    planned->parallelize(sdk::ParallelContext{tessera::core::make_planning_tensor_parallel_group(2)});
    sdk::Batch batch{at::randint(256, {3, 8}, at::kLong), at::randint(256, {3, 8}, at::kLong)};
    for (const bool bf16 : {false, true}) {
      SCOPED_TRACE(bf16 ? "bf16 autocast" : "fp32");
      tessera::sdk::set_autocast(/*cuda=*/false, bf16, at::kBFloat16);
      const std::int64_t before = comm->stats().all_reduce_bytes;
      at::Tensor loss = parallel->training_step(batch, 0).loss;
      const std::int64_t forward = comm->stats().all_reduce_bytes - before;
      const toolkit::TensorParallelTraffic traffic = toolkit::tensor_parallel_traffic(loss);
      const toolkit::TensorParallelTraffic plan = toolkit::tensor_parallel_traffic(planned->training_step(batch, 0).loss);
      tessera::sdk::set_autocast(/*cuda=*/false, false, at::kBFloat16);
      at::autocast::clear_cache();
      loss.backward();
      const std::int64_t backward = comm->stats().all_reduce_bytes - before - forward;
      EXPECT_EQ(traffic.group_size, 2);
      EXPECT_EQ(traffic.forward_all_reduces, 2 * 3);  // attention and MLP output per layer
      EXPECT_EQ(traffic.backward_all_reduces, 2 * 3);  // attention and MLP input gradients
      // One (3, 8, 16) activation each, in the dtype it was computed in.
      EXPECT_EQ(traffic.forward_all_reduce_bytes, 6.0 * 3 * 8 * 16 * (bf16 ? 2 : 4));
      EXPECT_EQ(traffic.forward_all_reduce_bytes, static_cast<double>(forward));
      EXPECT_GT(backward, 0);
      EXPECT_EQ(traffic.backward_all_reduce_bytes, static_cast<double>(backward));
      EXPECT_EQ(plan.group_size, traffic.group_size);
      EXPECT_EQ(plan.forward_all_reduces, traffic.forward_all_reduces);
      EXPECT_EQ(plan.backward_all_reduce_bytes, traffic.backward_all_reduce_bytes);
      EXPECT_EQ(plan.forward_all_reduce_bytes, traffic.forward_all_reduce_bytes);
    }
    // Without tensor parallelism there is nothing to read.
    const toolkit::TensorParallelTraffic none = toolkit::tensor_parallel_traffic(make_model("gpt", config, 11)->training_step(batch, 0).loss);
    EXPECT_EQ(none.group_size, 1);
    EXPECT_EQ(none.forward_all_reduces + none.backward_all_reduces, 0);
    EXPECT_EQ(toolkit::tensor_parallel_traffic(at::Tensor()).forward_all_reduce_bytes, 0);
  });
}

TEST(TensorParallelGpt, TpNotDividingTheHeadsIsRefusedBeforeAnyChange) {
  auto model = make_model("gpt", "n_layer = 1\nn_head = 4\nn_embd = 16\nblock_size = 8\n", 1);
  const auto before = model->network()->named_parameters();
  try {
    model->parallelize(sdk::ParallelContext{std::make_shared<PlaceOnlyGroup>(0, 3)});
    FAIL() << "n_head 4 over tp 3";
  } catch (const sdk::Error& e) {
    const std::string message = e.what();
    for (const char* part : {"test.toml", "[model] n_head = 4", "tensor_parallel_size = 3",
                             "valid tensor_parallel_size: 1, 2, 4"})
      EXPECT_NE(message.find(part), std::string::npos) << "missing '" << part << "' in: " << message;
  }
  const auto after = model->network()->named_parameters();
  ASSERT_EQ(after.keys(), before.keys());
  for (const auto& item : before) EXPECT_TRUE(after[item.key()].is_same(item.value())) << item.key();
  EXPECT_TRUE(sdk::tensor_parallel_placements(*model->network()).empty());
  // tp 1 is no parallelism at all
  model->parallelize(sdk::ParallelContext{std::make_shared<PlaceOnlyGroup>(0, 1)});
  EXPECT_TRUE(sdk::tensor_parallel_placements(*model->network()).empty());
}

TEST(TensorParallelGpt, ModelsWithoutAPlanRefuseTensorParallelism) {
  auto mlp = make_model("mlp", "", 1);
  mlp->parallelize(sdk::ParallelContext{std::make_shared<PlaceOnlyGroup>(0, 1)});  // tp 1: nothing to do
  try {
    mlp->parallelize(sdk::ParallelContext{std::make_shared<PlaceOnlyGroup>(0, 2)});
    FAIL() << "mlp has no plan";
  } catch (const sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find("has no tensor-parallel plan"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("tensor_parallel_size = 2"), std::string::npos) << e.what();
  }
}

// --- deferred init -------------------------------------------------------------------------

namespace core = tessera::core;

/// Gives every deferred parameter of `net` real (zeroed) memory and initialises it as a
/// sharding strategy does under deferred init: the generator replayed, modules in order.
void materialise(torch::nn::Module& net, std::int64_t rank, std::int64_t size, const core::ParamInitFn& init) {
  core::replay_deferred_init_rng();
  std::set<const void*> impls;
  {
    torch::NoGradGuard no_grad;
    for (auto& item : net.named_parameters()) {
      EXPECT_TRUE(core::is_deferred(item.value())) << item.key() << " got memory before its unit";
      item.value().set_data(at::zeros(item.value().sizes(), item.value().options()));
      impls.insert(item.value().unsafeGetTensorImpl());
    }
  }
  core::initialize_modules(net, impls, c10::kCPU, init, rank, size);
  core::release_deferred_init_memory();
}

/// Plain Linear layers, and the plan that cuts them (as a model's parallelize does).
struct PlainImpl : torch::nn::Module {
  PlainImpl()
      : qkv(register_module("qkv", torch::nn::Linear(8, 24))),
        out(register_module("out", torch::nn::Linear(8, 8))),
        head(register_module("head", torch::nn::Linear(8, 5))),
        nobias(register_module("nobias", torch::nn::Linear(torch::nn::LinearOptions(8, 4).bias(false)))) {}
  void parallelize(const GroupPtr& g) {
    replace_module("qkv", toolkit::ColumnParallelLinear(*qkv, g, /*stride=*/3));
    replace_module("out", toolkit::RowParallelLinear(*out, g));
    replace_module("nobias", toolkit::ColumnParallelLinear(*nobias, g));
  }
  torch::nn::Linear qkv, out, head, nobias;
};
TORCH_MODULE(Plain);

std::map<std::string, at::Tensor> values_of(const torch::nn::Module& net) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : net.named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

/// `full` (an unsplit network's values) cut as `net`'s placements say for `rank` of `size`.
std::map<std::string, at::Tensor> cut(const std::map<std::string, at::Tensor>& full, const torch::nn::Module& net,
                                      std::int64_t rank, std::int64_t size) {
  const auto placements = sdk::tensor_parallel_placements(net);
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, value] : full) {
    auto it = placements.find(name);
    out[name] = it == placements.end() ? value : sdk::tensor_parallel_shard(value, it->second, rank, size);
  }
  return out;
}

void expect_equal(const std::map<std::string, at::Tensor>& actual, const std::map<std::string, at::Tensor>& expected,
                  const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (const auto& [name, value] : expected) {
    ASSERT_TRUE(actual.count(name)) << what << ": no " << name;
    EXPECT_TRUE(actual.at(name).sizes() == value.sizes() && at::equal(actual.at(name), value)) << what << ": " << name;
  }
}

// The SDK's layers have no model initialiser: under deferred init (a strategy's
// model_sharded_context) each rank's pieces get the values the eager layer holds, i.e.
// torch::nn::Linear's of the full size (kaiming with the full fan-in, one draw cut), whether
// built from options or cut by a plan from deferred Linear layers; the cut pieces stay deferred.
TEST(TensorParallelDeferredInit, LayersWithoutAModelInitialiserGetTheEagerValues) {
  for (std::int64_t rank : {0, 1}) {
    auto group = std::make_shared<PlaceOnlyGroup>(rank, 2);
    at::manual_seed(7);
    Mixed eager_layers(group);
    at::manual_seed(7);
    Mixed deferred_layers{nullptr};
    {
      sdk::GuardPtr deferred = core::deferred_init_guard();
      deferred_layers = Mixed(group);
    }
    materialise(*deferred_layers, rank, 2, nullptr);
    expect_equal(values_of(*deferred_layers), values_of(*eager_layers), "from options, rank " + std::to_string(rank));

    at::manual_seed(7);
    Plain eager_plan;
    eager_plan->parallelize(group);
    at::manual_seed(7);
    Plain deferred_plan{nullptr};
    {
      sdk::GuardPtr deferred = core::deferred_init_guard();
      deferred_plan = Plain();
    }
    {
      sdk::GuardPtr deferred = core::resume_deferred_init_guard();
      deferred_plan->parallelize(group);
    }
    materialise(*deferred_plan, rank, 2, nullptr);
    expect_equal(values_of(*deferred_plan), values_of(*eager_plan), "cut by the plan, rank " + std::to_string(rank));
  }
}

// A model's initialiser (sdk::Module::init_parameters) sees each split parameter at full
// shape (fan-in based scales, one draw for all ranks): the pieces are the tp = 1 values cut.
TEST(TensorParallelDeferredInit, ModelInitialiserSeesTheFullShapes) {
  const core::ParamInitFn init = [](const std::string&, torch::nn::Module& m) {
    for (auto& p : m.parameters(/*recurse=*/false)) {
      if (p.dim() == 2) torch::nn::init::normal_(p, 0.0, 1.0 / std::sqrt(static_cast<double>(p.size(1))));
      else p.fill_(static_cast<double>(p.size(0)));
    }
    return true;
  };
  at::manual_seed(9);
  Plain whole{nullptr};
  {
    sdk::GuardPtr deferred = core::deferred_init_guard();
    whole = Plain();
  }
  materialise(*whole, 0, 1, init);
  const auto full = values_of(*whole);
  for (std::int64_t rank : {0, 1}) {
    auto group = std::make_shared<PlaceOnlyGroup>(rank, 2);
    at::manual_seed(9);
    Plain split{nullptr};
    {
      sdk::GuardPtr deferred = core::deferred_init_guard();
      split = Plain();
    }
    {
      sdk::GuardPtr deferred = core::resume_deferred_init_guard();
      split->parallelize(group);
    }
    materialise(*split, rank, 2, init);
    expect_equal(values_of(*split), cut(full, *split, rank, 2), "rank " + std::to_string(rank));
  }
}

// The gpt's own init_parameters (N(0, 0.02), residual projections scaled) under deferred init
// with its tensor-parallel plan: every rank's pieces are the deferred tp = 1 model's values cut.
TEST(TensorParallelDeferredInit, GptPiecesAreTheUnsplitDeferredModelCut) {
  const std::string config = "n_layer = 2\nn_head = 4\nn_embd = 16\nblock_size = 8\ntie_embeddings = false\n";
  auto build = [&](std::int64_t rank, std::int64_t size) {
    sdk::Options options = sdk::make_options("model", "test.toml", toml::parse(config));
    auto model = loader().create_as<sdk::Module>(sdk::PluginKind::model, "gpt", options);
    at::manual_seed(13);
    {
      sdk::GuardPtr deferred = core::deferred_init_guard();
      model->configure_model();
    }
    if (size > 1) {
      sdk::GuardPtr deferred = core::resume_deferred_init_guard();
      model->parallelize(sdk::ParallelContext{std::make_shared<PlaceOnlyGroup>(rank, size)});
    }
    materialise(*model->network(), rank, size,
                [&](const std::string& path, torch::nn::Module& m) { return model->init_parameters(path, m); });
    return model;
  };
  auto whole = build(0, 1);
  const auto full = values_of(*whole->network());
  for (std::int64_t rank : {0, 1}) {
    auto split = build(rank, 2);
    EXPECT_EQ(sdk::tensor_parallel_placements(*split->network()).size(), 2u * 6u);  // attn, proj.w, fc, fc_proj.w
    expect_equal(values_of(*split->network()), cut(full, *split->network(), rank, 2), "rank " + std::to_string(rank));
  }
}

}  // namespace
