// core/checkpoint (state dicts, optimizer state in PyTorch's format, atomic torch.load files)
// and the `torch` and `distributed` checkpoint IO plugins.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <ATen/ATen.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "multiprocess.hpp"
#include "tessera/core/checkpoint.hpp"
#include "plugin_loader.hpp"
#include "tessera/sdk/checkpoint_io.hpp"
#include "tessera/sdk/error.hpp"
#include "errors.hpp"
#include "tessera/sdk/toml_options.hpp"

namespace {

namespace fs = std::filesystem;
namespace core = tessera::core;
namespace sdk = tessera::sdk;

using tessera::testing::error_of;

using tessera::testing::read_file;
using tessera::testing::files_in;

/// Two parameters, given gradients, stepped `steps` times.
struct Params {
  at::Tensor a = at::arange(6, at::kFloat).reshape({2, 3}).requires_grad_();
  at::Tensor b = at::linspace(-1, 1, 4).requires_grad_();
  void fill_grads(int step) {
    a.mutable_grad() = at::full_like(a, 0.1 * (step + 1)) + at::arange(6, at::kFloat).reshape({2, 3}) * 0.01;
    b.mutable_grad() = at::full_like(b, -0.2 * (step + 1));
  }
};

const at::Tensor& state_tensor(const torch::optim::Optimizer& optimizer, const at::Tensor& p, const char* key) {
  const auto* found = core::optimizer_param_state(optimizer, p);
  EXPECT_NE(found, nullptr);
  const auto& state = *found;
  if (std::string(key) == "momentum_buffer") return dynamic_cast<const torch::optim::SGDParamState&>(state).momentum_buffer();
  const auto& adam = dynamic_cast<const torch::optim::AdamWParamState&>(state);
  return std::string(key) == "exp_avg" ? adam.exp_avg() : adam.exp_avg_sq();
}

TEST(StateDict, RoundTripsInOrderThroughACheckpointValue) {
  sdk::StateDict state;
  state.insert("z.weight", at::ones({2, 2}));
  state.insert("a.bias", at::arange(3, at::kFloat));
  sdk::StateDict back = core::state_dict_from(core::to_ivalue(state), "test");
  ASSERT_EQ(back.keys(), (std::vector<std::string>{"z.weight", "a.bias"}));
  EXPECT_TRUE(at::equal(back["a.bias"], state["a.bias"]));
  EXPECT_NE(error_of([] { core::state_dict_from(c10::IValue(3), "checkpoint x [state_dict]"); })
                .find("checkpoint x [state_dict] is not a dictionary"),
            std::string::npos);
}

TEST(OptimizerState, AdamWInPyTorchsFormatWithNames) {
  Params p;
  torch::optim::AdamW optimizer({p.a, p.b}, torch::optim::AdamWOptions(0.01).betas({0.8, 0.9}).weight_decay(0.1));
  for (int step = 0; step < 2; ++step) {
    p.fill_grads(step);
    optimizer.step();
  }
  sdk::Checkpoint saved = core::optimizer_state_dict(optimizer, {"layer.a", "layer.b"});
  auto state = saved.at("state").toGenericDict();
  ASSERT_EQ(state.size(), 2u);
  sdk::Checkpoint first = state.at(0).toGenericDict();
  EXPECT_EQ(first.at("step").toTensor().item<double>(), 2.0);
  EXPECT_EQ(first.at("step").toTensor().scalar_type(), at::kFloat);  // Python's AdamW keeps a float tensor
  EXPECT_TRUE(at::equal(first.at("exp_avg").toTensor(), state_tensor(optimizer, p.a, "exp_avg")));
  EXPECT_TRUE(at::equal(state.at(1).toGenericDict().at("exp_avg_sq").toTensor(), state_tensor(optimizer, p.b, "exp_avg_sq")));
  auto groups = saved.at("param_groups").toListRef();
  ASSERT_EQ(groups.size(), 1u);
  sdk::Checkpoint group = groups[0].toGenericDict();
  EXPECT_DOUBLE_EQ(group.at("lr").toDouble(), 0.01);
  EXPECT_DOUBLE_EQ(group.at("betas").toTupleRef().elements()[0].toDouble(), 0.8);
  EXPECT_DOUBLE_EQ(group.at("weight_decay").toDouble(), 0.1);
  EXPECT_EQ(group.at("params").toIntVector(), (std::vector<std::int64_t>{0, 1}));
  auto names = saved.at("param_names").toListRef();
  EXPECT_EQ(names[1].toStringRef(), "layer.b");
}

TEST(OptimizerState, LoadsByNameIntoAReorderedOptimizerAndContinuesIdentically) {
  Params p;
  torch::optim::AdamW optimizer({p.a, p.b}, torch::optim::AdamWOptions(0.01).betas({0.8, 0.9}));
  for (int step = 0; step < 3; ++step) {
    p.fill_grads(step);
    optimizer.step();
  }
  sdk::Checkpoint saved = core::optimizer_state_dict(optimizer, {"a", "b"});

  Params q;  // a copy of the stepped parameters, given to the optimizer in the other order
  {
    torch::NoGradGuard no_grad;
    q.a.copy_(p.a);
    q.b.copy_(p.b);
  }
  torch::optim::AdamW restored({q.b, q.a}, torch::optim::AdamWOptions(0.5));
  core::load_optimizer_state_dict(restored, saved, {"b", "a"});
  EXPECT_TRUE(at::equal(state_tensor(restored, q.a, "exp_avg"), state_tensor(optimizer, p.a, "exp_avg")));
  EXPECT_DOUBLE_EQ(restored.param_groups()[0].options().get_lr(), 0.01);
  auto& options = static_cast<torch::optim::AdamWOptions&>(restored.param_groups()[0].options());
  EXPECT_DOUBLE_EQ(std::get<0>(options.betas()), 0.8);

  p.fill_grads(3);
  q.fill_grads(3);
  optimizer.step();
  restored.step();
  EXPECT_TRUE(at::allclose(p.a, q.a, 0, 0)) << p.a - q.a;
  EXPECT_TRUE(at::allclose(p.b, q.b, 0, 0)) << p.b - q.b;
}

TEST(OptimizerState, NamesFollowTheOptimizersOwnOrderOfParamGroups) {
  // configure_optimizers() got [a, b] but put b in the first group (no weight decay) and a in
  // the second: PyTorch numbers the state b = 0, a = 1, and so must the names.
  Params p;
  const std::vector<sdk::NamedParameter> given = {{"a", p.a}, {"b", p.b}};
  torch::optim::AdamW optimizer({p.b}, torch::optim::AdamWOptions(0.01).weight_decay(0.0));
  optimizer.add_param_group(torch::optim::OptimizerParamGroup(
      {p.a}, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(0.01).weight_decay(0.1))));
  const auto names = core::optimizer_order_names(optimizer, given);
  EXPECT_EQ(names, (std::vector<std::string>{"b", "a"}));
  for (int step = 0; step < 2; ++step) {
    p.fill_grads(step);
    optimizer.step();
  }
  sdk::Checkpoint saved = core::optimizer_state_dict(optimizer, names);
  auto state = saved.at("state").toGenericDict();
  EXPECT_EQ(state.at(0).toGenericDict().at("exp_avg").toTensor().sizes(), p.b.sizes());
  EXPECT_EQ(state.at(1).toGenericDict().at("exp_avg").toTensor().sizes(), p.a.sizes());
  // Into an optimizer grouped the other way round, by name: every moment lands on its parameter.
  torch::optim::AdamW regrouped({p.a, p.b}, torch::optim::AdamWOptions(0.01));
  core::load_optimizer_state_dict(regrouped, saved, core::optimizer_order_names(regrouped, given));
  EXPECT_TRUE(at::equal(state_tensor(regrouped, p.a, "exp_avg"), state_tensor(optimizer, p.a, "exp_avg")));
  EXPECT_TRUE(at::equal(state_tensor(regrouped, p.b, "exp_avg_sq"), state_tensor(optimizer, p.b, "exp_avg_sq")));

  at::Tensor stranger = at::zeros({5}, at::kFloat).requires_grad_();
  torch::optim::AdamW foreign({p.a, p.b, stranger}, torch::optim::AdamWOptions(0.01));
  EXPECT_NE(error_of([&] { core::optimizer_order_names(foreign, given); })
                .find("steps on a tensor of shape [5] (param group 0) that is not one of the parameters it was given"),
            std::string::npos);
  torch::optim::AdamW twice({p.a, p.b, p.a}, torch::optim::AdamWOptions(0.01));
  EXPECT_NE(error_of([&] { core::optimizer_order_names(twice, given); }).find("steps on parameter 'a' twice"),
            std::string::npos);
  torch::optim::AdamW partial({p.a}, torch::optim::AdamWOptions(0.01));
  EXPECT_NE(error_of([&] { core::optimizer_order_names(partial, given); })
                .find("leaves out 1 of the parameters it was given (b)"),
            std::string::npos);
}

TEST(OptimizerState, SGDMomentumRoundTrips) {
  Params p;
  torch::optim::SGD optimizer({p.a, p.b}, torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true));
  p.fill_grads(0);
  optimizer.step();
  sdk::Checkpoint saved = core::optimizer_state_dict(optimizer, {"a", "b"});
  Params q;
  torch::optim::SGD restored({q.a, q.b}, torch::optim::SGDOptions(0.3).momentum(0.5));
  core::load_optimizer_state_dict(restored, saved, {"a", "b"});
  EXPECT_TRUE(at::equal(state_tensor(restored, q.b, "momentum_buffer"), state_tensor(optimizer, p.b, "momentum_buffer")));
  auto& options = static_cast<torch::optim::SGDOptions&>(restored.param_groups()[0].options());
  EXPECT_DOUBLE_EQ(options.momentum(), 0.9);
  EXPECT_TRUE(options.nesterov());
}

TEST(OptimizerState, ShapeMismatchNamesTheParameterAndChangesNothing) {
  Params p;
  torch::optim::Adam optimizer({p.a, p.b}, torch::optim::AdamOptions(0.01));
  p.fill_grads(0);
  optimizer.step();
  sdk::Checkpoint saved = core::optimizer_state_dict(optimizer, {"a", "b"});
  at::Tensor a = at::zeros({2, 3}, at::kFloat).requires_grad_(), b = at::zeros({5}).requires_grad_();
  torch::optim::Adam other({a, b}, torch::optim::AdamOptions(0.2));
  std::string message = error_of([&] { core::load_optimizer_state_dict(other, saved, {"a", "b"}); });
  EXPECT_NE(message.find("parameter 'b' has shape [4] in the checkpoint but the parameter has shape [5]"),
            std::string::npos)
      << message;
  EXPECT_TRUE(other.state().empty());
  EXPECT_DOUBLE_EQ(other.param_groups()[0].options().get_lr(), 0.2);

  message = error_of([&] { core::load_optimizer_state_dict(other, saved, {"a", "c"}); });
  EXPECT_NE(message.find("no entry for parameter 'c'"), std::string::npos) << message;
}

// NeMo's deferred restore: staging checks everything and restores the hyper-parameters at
// once (a bad shape throws then); the moments arrive only when the returned step runs, and
// the next step then equals an uninterrupted one.
TEST(OptimizerState, StagedRestoreChecksAtOnceAndInstallsLater) {
  Params p;
  torch::optim::AdamW optimizer({p.a, p.b}, torch::optim::AdamWOptions(0.01).betas({0.8, 0.9}));
  p.fill_grads(0);
  optimizer.step();
  sdk::Checkpoint saved = core::optimizer_state_dict(optimizer, {"a", "b"});
  Params q;
  {
    torch::NoGradGuard no_grad;
    q.a.copy_(p.a);
    q.b.copy_(p.b);
  }
  torch::optim::AdamW restored({q.a, q.b}, torch::optim::AdamWOptions(0.5));
  std::function<void()> install = core::stage_optimizer_state_dict(restored, saved, {"a", "b"});
  EXPECT_TRUE(restored.state().empty()) << "nothing installed before the step";
  EXPECT_DOUBLE_EQ(restored.param_groups()[0].options().get_lr(), 0.01);
  install();
  EXPECT_TRUE(at::equal(state_tensor(restored, q.b, "exp_avg"), state_tensor(optimizer, p.b, "exp_avg")));
  p.fill_grads(2);
  q.fill_grads(2);
  optimizer.step();
  restored.step();
  EXPECT_TRUE(at::equal(p.a, q.a));
  EXPECT_TRUE(at::equal(p.b, q.b));

  at::Tensor a = at::zeros({2, 3}).requires_grad_(), b = at::zeros({5}).requires_grad_();
  torch::optim::AdamW other({a, b}, torch::optim::AdamWOptions(0.2));
  std::string message = error_of([&] { core::stage_optimizer_state_dict(other, saved, {"a", "b"}); });
  EXPECT_NE(message.find("parameter 'b' has shape [4] in the checkpoint"), std::string::npos) << message;
  EXPECT_DOUBLE_EQ(other.param_groups()[0].options().get_lr(), 0.2) << "a refused state changes nothing";
}

// Item 3 of the checkpoint issue: after a load every saved entry and moment went somewhere;
// state for a parameter the optimizer lacks, or a moment it does not keep, is refused by name.
TEST(OptimizerState, EverySavedEntryAndMomentMustBeConsumed) {
  Params p;
  torch::optim::AdamW optimizer({p.a, p.b}, torch::optim::AdamWOptions(0.01));
  p.fill_grads(0);
  optimizer.step();
  sdk::Checkpoint saved = core::optimizer_state_dict(optimizer, {"a", "b"});
  Params q;
  torch::optim::AdamW only_a({q.a}, torch::optim::AdamWOptions(0.5));
  std::string message = error_of([&] { core::load_optimizer_state_dict(only_a, saved, {"a"}); });
  EXPECT_NE(message.find("entry for parameter 'b', which this optimizer does not step on"), std::string::npos)
      << message;
  EXPECT_TRUE(only_a.state().empty());
  EXPECT_DOUBLE_EQ(only_a.param_groups()[0].options().get_lr(), 0.5) << "a refused state changes nothing";

  sdk::Checkpoint extra = saved.copy();
  sdk::Checkpoint entry = extra.at("state").toGenericDict().at(0).toGenericDict().copy();
  entry.insert("ema", at::zeros({2, 3}));
  auto state = extra.at("state").toGenericDict().copy();
  state.insert_or_assign(0, entry);
  extra.insert_or_assign("state", state);
  torch::optim::AdamW both({q.a, q.b}, torch::optim::AdamWOptions(0.5));
  message = error_of([&] { core::load_optimizer_state_dict(both, extra, {"a", "b"}); });
  EXPECT_NE(message.find("optimizer state 'ema' of parameter 'a'"), std::string::npos) << message;
  EXPECT_TRUE(both.state().empty());
  core::load_optimizer_state_dict(both, saved, {"a", "b"});  // the untouched state loads
  EXPECT_TRUE(at::equal(state_tensor(both, q.b, "exp_avg"), state_tensor(optimizer, p.b, "exp_avg")));
}

TEST(OptimizerState, StateOfAnotherOptimizerIsRefused) {
  Params p;
  torch::optim::SGD sgd({p.a, p.b}, torch::optim::SGDOptions(0.1).momentum(0.9));
  p.fill_grads(0);
  sgd.step();
  sdk::Checkpoint saved = core::optimizer_state_dict(sgd, {"a", "b"});
  Params q;
  torch::optim::AdamW adam({q.a, q.b}, torch::optim::AdamWOptions(0.1));
  std::string message = error_of([&] { core::load_optimizer_state_dict(adam, saved, {"a", "b"}); });
  EXPECT_NE(message.find("has no 'exp_avg'"), std::string::npos) << message;
  EXPECT_TRUE(adam.state().empty());
}

TEST(OptimizerState, RekeysBetweenParamIdAndParamName) {
  Params p;
  torch::optim::AdamW optimizer({p.a, p.b}, torch::optim::AdamWOptions(0.01));
  p.fill_grads(0);
  optimizer.step();
  sdk::Checkpoint by_id = core::optimizer_state_dict(optimizer, {"net.a", "net.b"});
  sdk::Checkpoint by_name = core::rekey_optim_state_dict(by_id, core::OptimStateKeyType::PARAM_NAME);
  auto state = by_name.at("state").toGenericDict();
  ASSERT_TRUE(state.contains("net.b"));
  EXPECT_TRUE(at::equal(state.at("net.b").toGenericDict().at("exp_avg").toTensor(), state_tensor(optimizer, p.b, "exp_avg")));
  auto params = by_name.at("param_groups").toListRef()[0].toGenericDict().at("params").toListRef();
  EXPECT_EQ(params[0].toStringRef(), "net.a");

  sdk::Checkpoint back = core::rekey_optim_state_dict(by_name, core::OptimStateKeyType::PARAM_ID);
  auto back_state = back.at("state").toGenericDict();
  EXPECT_TRUE(at::equal(back_state.at(1).toGenericDict().at("exp_avg").toTensor(), state_tensor(optimizer, p.b, "exp_avg")));
  EXPECT_EQ(back.at("param_groups").toListRef()[0].toGenericDict().at("params").toIntVector(),
            (std::vector<std::int64_t>{0, 1}));

  // A name-keyed dict loads directly.
  Params q;
  torch::optim::AdamW restored({q.b, q.a}, torch::optim::AdamWOptions(0.01));
  core::load_optimizer_state_dict(restored, by_name, {"net.b", "net.a"});
  EXPECT_TRUE(at::equal(state_tensor(restored, q.a, "exp_avg_sq"), state_tensor(optimizer, p.a, "exp_avg_sq")));
}

class Files : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("tessera-ckpt-" + std::to_string(::getpid()) + "-" +
                                             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    tessera::testing::remove_dir(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { tessera::testing::remove_dir(dir_); }

  static sdk::Checkpoint sample(double value) {
    sdk::Checkpoint c = sdk::make_checkpoint();
    sdk::StateDict state;
    state.insert("w", at::full({3, 2}, value));
    state.insert("h", at::full({2}, value).to(at::kBFloat16));
    c.insert("state_dict", core::to_ivalue(state));
    c.insert("global_step", static_cast<std::int64_t>(value));
    c.insert("name", "tessera");
    c.insert("lrs", c10::List<double>({0.1, 0.2}));
    return c;
  }
  static double value_of(const sdk::Checkpoint& c) {
    return core::state_dict_from(c.at("state_dict"), "state_dict")["w"][0][0].item<double>();
  }

  fs::path dir_;
};

TEST_F(Files, AtomicWriteWithAThrowingWriterLeavesTheOldFileAndNoTemporary) {
  const fs::path path = dir_ / "last.ckpt";
  core::atomic_write(path.string(), [](std::ostream& out) { out << "old contents"; });
  EXPECT_THROW(core::atomic_write(path.string(),
                                  [](std::ostream& out) {
                                    out << "half of the new";
                                    throw std::runtime_error("killed mid-write");
                                  }),
               std::runtime_error);
  EXPECT_EQ(read_file(path), "old contents");
  EXPECT_EQ(files_in(dir_), std::vector<std::string>{"last.ckpt"});
}

TEST_F(Files, PickleRoundTripKeepsNestedValues) {
  const std::string path = (dir_ / "a.ckpt").string();
  core::save_pickle(sample(3), path);
  sdk::Checkpoint back = core::checkpoint_dict(core::load_pickle(path), path);
  EXPECT_EQ(value_of(back), 3.0);
  EXPECT_EQ(back.at("global_step").toInt(), 3);
  EXPECT_EQ(back.at("name").toStringRef(), "tessera");
  auto state = core::state_dict_from(back.at("state_dict"), "state_dict");
  EXPECT_EQ(state["h"].scalar_type(), at::kBFloat16);
}

TEST_F(Files, BrokenFilesGiveErrorsNamingThePathAndTheProblem) {
  const std::string missing = (dir_ / "missing.ckpt").string();
  EXPECT_NE(error_of([&] { core::load_pickle(missing); }).find(missing + " does not exist"), std::string::npos);

  const std::string empty = (dir_ / "empty.ckpt").string();
  std::ofstream(empty).close();
  EXPECT_NE(error_of([&] { core::load_pickle(empty); }).find(empty + " is empty"), std::string::npos);

  const std::string text = (dir_ / "notes.ckpt").string();
  std::ofstream(text) << "these are not the tensors you are looking for";
  EXPECT_NE(error_of([&] { core::load_pickle(text); }).find(text + " is not a checkpoint"), std::string::npos);

  const std::string good = (dir_ / "good.ckpt").string(), truncated = (dir_ / "truncated.ckpt").string();
  core::save_pickle(sample(1), good);
  std::string bytes = read_file(good);
  std::ofstream(truncated, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  std::string message = error_of([&] { core::load_pickle(truncated); });
  EXPECT_NE(message.find(truncated + " is not a readable checkpoint (truncated or damaged"), std::string::npos)
      << message;
}

TEST_F(Files, PythonTorchLoadReadsWhatWeWrite) {
  const char* python = "/usr/bin/python3";
  if (!fs::exists(python) || std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "SKIPPED: /usr/bin/python3 with torch (python3-torch) is not installed";
  const std::string path = (dir_ / "py.ckpt").string();
  core::save_pickle(sample(2), path);
  const std::string script = (dir_ / "check.py").string();
  std::ofstream(script) << "import sys, torch\n"
                           "sys.path.insert(0, '" TESSERA_TEST_SUPPORT_DIR "')\n"
                           "from safe_torch_load import load\n"
                           "c = load(sys.argv[1])\n"
                           "sd = c['state_dict']\n"
                           "assert list(sd.keys()) == ['w', 'h'], list(sd.keys())\n"
                           "assert torch.equal(sd['w'], torch.full((3, 2), 2.0))\n"
                           "assert sd['h'].dtype == torch.bfloat16\n"
                           "assert c['global_step'] == 2 and c['name'] == 'tessera' and c['lrs'] == [0.1, 0.2]\n"
                           "print('ok')\n";
  const std::string out = (dir_ / "out.txt").string();
  int rc = std::system(("/usr/bin/python3 " + script + " " + path + " > " + out + " 2>&1").c_str());
  EXPECT_EQ(rc, 0) << read_file(out);
  EXPECT_EQ(read_file(out), "ok\n");
}

TEST_F(Files, LoadsWhatPythonsTorchSaveWrites) {
  // Python's pickler adds a lone item with APPEND or SETITEM (which LibTorch 1.13 cannot
  // read), a batch of up to 1000 with APPENDS or SETITEMS: lists and dicts of 1, 1001 (a
  // batch, then a lone item), nested ones.
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "SKIPPED: /usr/bin/python3 with torch (python3-torch) is not installed";
  const std::string path = (dir_ / "python.pt").string();
  const std::string command =
      "/usr/bin/python3 -c \"import sys, torch; torch.save({'one': [7], 'many': list(range(1001)), "
      "'nested': [[[2.5]], ('t', [None])], 'tensors': [torch.arange(3.0)], 'empty': [], "
      "'groups': [{'params': [0], 'lr': 0.1}], 'lone': {'k': {'v': 1}}, "
      "'wide': {str(i): i for i in range(1001)}}, sys.argv[1])\" " + path;
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  sdk::Checkpoint c = core::checkpoint_dict(core::load_pickle(path), path);
  EXPECT_EQ(c.at("one").toIntVector(), std::vector<std::int64_t>{7});
  std::vector<std::int64_t> many = c.at("many").toIntVector();
  ASSERT_EQ(many.size(), 1001u);
  EXPECT_EQ(many.front(), 0);
  EXPECT_EQ(many.back(), 1000);
  auto nested = c.at("nested").toListRef();
  ASSERT_EQ(nested.size(), 2u);
  EXPECT_EQ(nested[0].toListRef()[0].toDoubleVector(), std::vector<double>{2.5});
  EXPECT_EQ(nested[1].toTupleRef().elements()[0].toStringRef(), "t");
  EXPECT_TRUE(nested[1].toTupleRef().elements()[1].toListRef()[0].isNone());
  EXPECT_TRUE(torch::equal(c.at("tensors").toListRef()[0].toTensor(), torch::arange(3.0)));
  EXPECT_TRUE(c.at("empty").toListRef().empty());
  auto group = core::checkpoint_dict(c.at("groups").toListRef()[0], "group");
  EXPECT_EQ(group.at("params").toIntVector(), std::vector<std::int64_t>{0});
  EXPECT_DOUBLE_EQ(group.at("lr").toDouble(), 0.1);
  EXPECT_EQ(core::checkpoint_dict(core::checkpoint_dict(c.at("lone"), "lone").at("k"), "k").at("v").toInt(), 1);
  auto wide = core::checkpoint_dict(c.at("wide"), "wide");
  ASSERT_EQ(wide.size(), 1001u);
  EXPECT_EQ(wide.at("1000").toInt(), 1000);
}

class CheckpointIO : public Files {
 protected:
  std::shared_ptr<sdk::CheckpointIO> io(const std::string& name) {
    return loader_.create_as<sdk::CheckpointIO>(sdk::PluginKind::checkpoint_io, name, sdk::Options());
  }
  core::PluginLoader loader_{{tessera::testing::plugin_dir()}};
};

TEST_F(CheckpointIO, TorchRoundTripMetadataAndRemove) {
  auto torch_io = io("torch");
  const std::string path = (dir_ / "epoch=0-step=5.ckpt").string();
  torch_io->save_checkpoint(sample(5), path, sdk::ShardInfo{});
  EXPECT_EQ(value_of(torch_io->load_checkpoint(path, sdk::ShardInfo{})), 5.0);
  sdk::CheckpointMetadata meta = torch_io->read_metadata(path);
  EXPECT_FALSE(meta.sharded);
  EXPECT_EQ(meta.format, "torch");
  torch_io->save_checkpoint(sample(6), path, sdk::ShardInfo{});  // overwrite in place
  EXPECT_EQ(value_of(torch_io->load_checkpoint(path, sdk::ShardInfo{})), 6.0);
  torch_io->remove_checkpoint(path);
  EXPECT_FALSE(fs::exists(path));
  EXPECT_NE(error_of([&] { torch_io->load_checkpoint(path, sdk::ShardInfo{}); }).find(path + " does not exist"),
            std::string::npos);
  EXPECT_NE(error_of([&] { torch_io->save_checkpoint(sample(1), path, sdk::ShardInfo{0, 2, true}); })
                .find("plugin = \"distributed\""),
            std::string::npos);
  const std::string text = (dir_ / "notes.txt").string();
  std::ofstream(text) << "hello";
  EXPECT_NE(error_of([&] { torch_io->read_metadata(text); }).find("not in torch.save's zip format"), std::string::npos);
}

TEST_F(CheckpointIO, FullSavesThroughDistributedAreTorchFilesAndBecomeLast) {
  auto dist = io("distributed");
  const std::string full = (dir_ / "full.ckpt").string();
  dist->save_checkpoint(sample(4), full, sdk::ShardInfo{});
  dist->finalize_checkpoint(full, sdk::ShardInfo{});
  EXPECT_EQ(value_of(io("torch")->load_checkpoint(full, sdk::ShardInfo{})), 4.0);
  EXPECT_FALSE(dist->read_metadata(full).sharded);
  EXPECT_EQ(files_in(dir_), (std::vector<std::string>{"full.ckpt", "last"}));
  EXPECT_EQ(fs::read_symlink(dir_ / "last"), "full.ckpt");
}

// torch.save's format carries no checksum LibTorch checks: ours are inside the file.
TEST_F(CheckpointIO, AFlippedByteInsideATensorOfAFullCheckpointIsCaught) {
  auto torch_io = io("torch");
  const std::string path = (dir_ / "a.ckpt").string();
  sdk::Checkpoint c = sample(1);
  sdk::StateDict state;
  state.insert("w", at::arange(4096, at::kFloat));  // a recognisable run of bytes
  c.insert_or_assign("state_dict", core::to_ivalue(state));
  torch_io->save_checkpoint(c, path, sdk::ShardInfo{});
  EXPECT_TRUE(torch_io->load_checkpoint(path, sdk::ShardInfo{}).contains(core::kTensorChecksumsKey));
  std::string bytes = read_file(path);
  const float marker = 1000.0f;  // element 1000 of w, somewhere in the zip's data record
  const std::size_t at = bytes.find(std::string(reinterpret_cast<const char*>(&marker), 4));
  ASSERT_NE(at, std::string::npos);
  bytes[at + 1] ^= 0x10;
  std::ofstream(path, std::ios::binary) << bytes;
  std::string message = error_of([&] { torch_io->load_checkpoint(path, sdk::ShardInfo{}); });
  EXPECT_NE(message.find(path + ": tensor state_dict/w does not match its checksum"), std::string::npos) << message;
}

// FSDP numbers its optimizer state unit by unit; a full checkpoint numbers it in the model's
// order, so Python's AdamW(model.parameters()) puts every moment on its own parameter.
TEST_F(CheckpointIO, PythonAdamWLoadsTheFullOptimizerStateOntoTheRightParameters) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "SKIPPED: /usr/bin/python3 with torch (python3-torch) is not installed";
  Params p;
  torch::optim::AdamW optimizer({p.b, p.a}, torch::optim::AdamWOptions(0.01));  // b first, as a later unit
  for (int step = 0; step < 2; ++step) {
    p.fill_grads(step);
    optimizer.step();
  }
  sdk::Checkpoint c = sdk::make_checkpoint();
  sdk::StateDict state;  // the model's order: a, then b
  state.insert("a", p.a.detach());
  state.insert("b", p.b.detach());
  c.insert("state_dict", core::to_ivalue(state));
  c10::impl::GenericList states(c10::AnyType::get());
  states.push_back(core::optimizer_state_dict(optimizer, {"b", "a"}));
  c.insert("optimizer_states", states);
  const std::string path = (dir_ / "opt.ckpt").string();
  io("torch")->save_checkpoint(c, path, sdk::ShardInfo{});
  sdk::Checkpoint expected = sdk::make_checkpoint();  // what each parameter's moments must be
  expected.insert("a_sq", state_tensor(optimizer, p.a, "exp_avg_sq"));
  expected.insert("b_avg", state_tensor(optimizer, p.b, "exp_avg"));
  core::save_pickle(expected, (dir_ / "expected.pt").string());
  const std::string script = (dir_ / "adamw.py").string();
  std::ofstream(script) << "import sys, torch\n"
                           "sys.path.insert(0, '" TESSERA_TEST_SUPPORT_DIR "')\n"
                           "from safe_torch_load import load\n"
                           "c = load(sys.argv[1] + '/opt.ckpt')\n"
                           "sd = c['state_dict']\n"
                           "a, b = torch.nn.Parameter(sd['a'].clone()), torch.nn.Parameter(sd['b'].clone())\n"
                           "opt = torch.optim.AdamW([a, b], lr=0.01)\n"
                           "opt.load_state_dict(c['optimizer_states'][0])\n"
                           "assert c['optimizer_states'][0]['param_names'] == ['a', 'b']\n"
                           "e = load(sys.argv[1] + '/expected.pt')\n"
                           "assert torch.equal(opt.state[a]['exp_avg_sq'], e['a_sq'])\n"
                           "assert torch.equal(opt.state[b]['exp_avg'], e['b_avg'])\n"
                           "assert opt.state[a]['exp_avg'].shape == (2, 3) and float(opt.state[b]['step']) == 2\n"
                           "print('ok')\n";
  const std::string out = (dir_ / "out.txt").string();
  EXPECT_EQ(std::system(("/usr/bin/python3 " + script + " " + dir_.string() + " > " + out + " 2>&1").c_str()), 0)
      << read_file(out);
  EXPECT_EQ(read_file(out), "ok\n");
}

TEST_F(CheckpointIO, AsyncSavesCommitInTheBackgroundAndPruneOnlyAfterACommit) {
  for (const char* plugin : {"torch", "distributed"}) {
    SCOPED_TRACE(plugin);
    tessera::testing::remove_dir(dir_);
    fs::create_directories(dir_);
    toml::table table;
    table.insert("async", true);
    table.insert("keep_last_k", 2);
    auto async_io = loader_.create_as<sdk::CheckpointIO>(sdk::PluginKind::checkpoint_io, plugin,
                                                         sdk::make_options("checkpoint_io", "test.toml", table));
    for (int step = 1; step <= 3; ++step) {
      sdk::Checkpoint c = sample(step);
      at::Tensor live = core::state_dict_from(c.at("state_dict"), "s")["w"];
      const std::string path = (dir_ / ("step=" + std::to_string(step) + ".ckpt")).string();
      async_io->save_checkpoint(c, path, sdk::ShardInfo{});
      live.fill_(-1.0);  // training goes on: the save holds a snapshot
      async_io->finalize_checkpoint(path, sdk::ShardInfo{});
    }
    // Reads and removals wait for the saves in flight.
    EXPECT_EQ(value_of(async_io->load_checkpoint((dir_ / "step=3.ckpt").string(), sdk::ShardInfo{})), 3.0);
    EXPECT_EQ(files_in(dir_), (std::vector<std::string>{"last", "step=2.ckpt", "step=3.ckpt"}));
    EXPECT_EQ(fs::read_symlink(dir_ / "last"), "step=3.ckpt");
    // A failed background save is reported by the next call; the previous checkpoint stays `last`.
    std::ofstream(dir_ / "file") << "not a folder";
    const std::string bad = (dir_ / "file" / "step=4.ckpt").string();
    async_io->save_checkpoint(sample(4), bad, sdk::ShardInfo{});
    async_io->finalize_checkpoint(bad, sdk::ShardInfo{});
    std::string message = error_of([&] { async_io->remove_checkpoint((dir_ / "step=2.ckpt").string()); });
    EXPECT_NE(message.find("file"), std::string::npos) << message;
    EXPECT_TRUE(fs::exists(dir_ / "step=2.ckpt")) << "nothing is removed after a failed save";
    EXPECT_EQ(fs::read_symlink(dir_ / "last"), "step=3.ckpt");
    EXPECT_EQ(value_of(async_io->load_checkpoint((dir_ / "last").string(), sdk::ShardInfo{})), 3.0);
  }
}

TEST_F(CheckpointIO, BrokenShardedCheckpointsAreNamed) {
  auto dist = io("distributed");
  const std::string path = (dir_ / "broken").string();
  fs::create_directories(path);
  EXPECT_NE(error_of([&] { dist->read_metadata(path); }).find("has no manifest.json: it is not a committed checkpoint"),
            std::string::npos);
  std::ofstream(fs::path(path) / "metadata.json") << "{\"format\": \"other\"}";
  EXPECT_NE(error_of([&] { dist->read_metadata(path); }).find("has format \"other\""), std::string::npos);
  std::ofstream(fs::path(path) / "metadata.json") << "{not json";
  EXPECT_NE(error_of([&] { dist->read_metadata(path); }).find("is not valid JSON"), std::string::npos);
  EXPECT_NE(error_of([&] { io("torch")->load_checkpoint(path, sdk::ShardInfo{}); }).find("is not valid JSON"),
            std::string::npos);  // either IO reads (and names) a sharded folder
}

}  // namespace
