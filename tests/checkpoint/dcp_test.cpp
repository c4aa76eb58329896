// PyTorch Distributed Checkpoint (DCP) folders in (issue 64): fixtures that PyTorch 2.6 itself
// wrote (dcp/make_fixtures.py: a 2-rank Gloo FSDP2 job, saved with Hugging Face names and with
// torchtitan's) read by tessera at 1, 2 and 3 ranks under every strategy; the loss logged at the
// first resumed step and the weights after it against what PyTorch computed on the same row; the
// metadata reader on hostile and damaged pickles; refusals before any step.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "checkpoint/dcp.hpp"
#include "multiprocess.hpp"
#include "tessera/core/safetensors.hpp"
#include "tessera/core/sharded_checkpoint.hpp"
#include "tessera/sdk/error.hpp"

namespace {

namespace fs = std::filesystem;
namespace core = tessera::core;
namespace sdk = tessera::sdk;
using json = nlohmann::json;
using tessera::testing::run_dir;
using tessera::testing::run_tessera;

const std::string kFixtures = TESSERA_CHECKPOINT_TEST_DIR "/dcp/fixtures";

json expected() {
  std::ifstream in(kFixtures + "/expected.json");
  return json::parse(in);
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

/// The fixture's Llama on a text whose every window is the fixture's row (its period is the block).
std::string write_config(const std::string& dir, const std::string& extra = "") {
  const json e = expected();
  std::string text;
  for (int i = 0; i < 64; ++i) text += e.at("pattern").get<std::string>();
  std::ofstream(dir + "/rows.txt") << text;
  const json& c = e.at("config");
  std::ofstream(dir + "/run.toml")
      << "[trainer]\nmax_steps = 2\nlog_every_n_steps = 1\nseed = 7\ndefault_root_dir = \"" << dir
      << "\"\nenable_progress_bar = false\nnum_sanity_val_steps = 0\nlimit_val_batches = 0\n"
      << "[optimizer]\nname = \"adamw\"\nlr = " << e.at("adamw").at("lr").get<double>()
      << "\nweight_decay = 0.0\nschedule = \"constant\"\n"
      << "[model]\nplugin = \"llama\"\nvocab_size = " << c.at("vocab_size") << "\nhidden_size = " << c.at("hidden_size")
      << "\nintermediate_size = " << c.at("intermediate_size") << "\nnum_hidden_layers = " << c.at("num_hidden_layers")
      << "\nnum_attention_heads = " << c.at("num_attention_heads")
      << "\nnum_key_value_heads = " << c.at("num_key_value_heads") << "\nrms_norm_eps = " << c.at("rms_norm_eps")
      << "\nmax_position_embeddings = " << c.at("max_position_embeddings") << "\n"
      << "[data]\nplugin = \"text\"\npath = \"" << dir << "/rows.txt\"\nblock_size = " << e.at("block_size")
      << "\nbatch_size = 2\nval_fraction = 0.0\n"
      << "[checkpoint_io]\nplugin = \"torch\"\n"
      << extra;
  return dir + "/run.toml";
}

// ---- the metadata reader ---------------------------------------------------------------------

// Both folders, as PyTorch wrote them: every parameter with its global shape and one chunk per
// rank where FSDP2 sharded it, the AdamW moments beside it, and byte ranges inside the files.
TEST(DcpMetadata, ReadsTheFoldersPyTorchWrote) {
  const core::DcpMetadata fsdp2 = core::read_dcp_metadata(kFixtures + "/fsdp2");
  const core::DcpTensor& q = fsdp2.tensors.at("model.model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(q.size, (std::vector<std::int64_t>{32, 32}));
  EXPECT_EQ(q.dtype, at::kFloat);
  ASSERT_EQ(q.chunks.size(), 2u);  // FSDP2 on 2 ranks: dim-0 halves
  EXPECT_EQ(q.chunks[1].offsets, (std::vector<std::int64_t>{16, 0}));
  EXPECT_TRUE(fsdp2.tensors.count("optim.state.model.layers.0.self_attn.q_proj.weight.exp_avg_sq"));
  EXPECT_TRUE(core::is_dcp_checkpoint(kFixtures + "/fsdp2"));
  EXPECT_FALSE(core::is_dcp_checkpoint(kFixtures));

  const core::DcpMetadata titan = core::read_dcp_metadata(kFixtures + "/torchtitan");
  EXPECT_EQ(titan.tensors.at("layers.1.attention.wk.weight").size, (std::vector<std::int64_t>{16, 32}));
  EXPECT_EQ(titan.tensors.at("train_state.step").size, std::vector<std::int64_t>{});
  EXPECT_TRUE(titan.tensors.count("optimizer.state.layers.1.feed_forward.w2.weight.exp_avg"));
  auto count = [](const core::DcpMetadata& m, const std::string& prefix) {
    std::size_t n = 0;
    for (const auto& [key, t] : m.tensors) n += key.rfind(prefix, 0) == 0;
    return n;
  };
  EXPECT_EQ(count(fsdp2, "model."), 21u);  // 2 layers of 9, the embedding, the final norm, the head
  EXPECT_EQ(count(titan, "layers."), 18u);
  EXPECT_EQ(count(titan, "optimizer.state."), 3 * 21u);  // exp_avg, exp_avg_sq, step
}

/// What parse_dcp_metadata says of `pickle` (empty when it is accepted).
std::string refusal(const std::string& pickle) {
  try {
    (void)core::parse_dcp_metadata(pickle, "M");
  } catch (const sdk::Error& e) {
    return e.what();
  }
  return "";
}

// A pickle is code for Python: the reader only describes it, and refuses, naming the byte,
// anything a DCP metadata file does not hold.
TEST(DcpMetadata, RefusesHostileAndDamagedPicklesNamingTheByte) {
  // os.system("true"): STACK_GLOBAL at byte 23.
  const std::string evil("\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x8c\x06system\x93\x8c\x04true\x85R.", 32);
  EXPECT_NE(refusal(evil).find("byte 23: the pickle names the Python global os.system"), std::string::npos)
      << refusal(evil);
  const std::string real = read_bytes(kFixtures + "/fsdp2/.metadata");
  EXPECT_EQ(refusal(real), "");
  const std::string cut = refusal(real.substr(0, real.size() / 2));
  EXPECT_NE(cut.find("M: byte "), std::string::npos) << cut;
  EXPECT_NE(refusal("\x80\x04" + std::string("\xff", 1)).find("byte 2: opcode 0xff"), std::string::npos);
  EXPECT_NE(refusal(std::string("\x80\x04K\x01.", 5)).find("expected an object of .Metadata, found int"),
            std::string::npos);
  // A memo index past the next one is not followed (it would size the table by a damaged byte).
  EXPECT_NE(refusal(std::string("\x80\x04N\x72\xff\xff\xff\x7f.", 9)).find("memo index 2147483647"), std::string::npos);

  // A data file named outside the folder (same length: the pickle stays well-formed).
  std::string escaped = real;
  for (std::size_t at = 0; (at = escaped.find("__0_0.distcp", at)) != std::string::npos;)
    escaped.replace(at, 12, "../00.distcp");
  EXPECT_NE(refusal(escaped).find("data file \"../00.distcp\" is not a file name inside the checkpoint folder"),
            std::string::npos) << refusal(escaped);
}

// Byte ranges are checked against the files before anything is read.
TEST(DcpMetadata, RefusesAFolderWhoseDataFileIsShortOrMissing) {
  const std::string dir = tessera::testing::fresh_dir("dcp-short");
  fs::copy(kFixtures + "/fsdp2", dir + "/ckpt", fs::copy_options::recursive);
  fs::resize_file(dir + "/ckpt/__1_0.distcp", 100);
  try {
    (void)core::read_dcp_metadata(dir + "/ckpt");
    ADD_FAILURE() << "a truncated data file was accepted";
  } catch (const sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find("of __1_0.distcp, which has 100 bytes (truncated?)"), std::string::npos)
        << e.what();
  }
  fs::remove(dir + "/ckpt/__1_0.distcp");
  try {
    (void)core::read_dcp_metadata(dir + "/ckpt");
    ADD_FAILURE() << "a missing data file was accepted";
  } catch (const sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find("is stored in __1_0.distcp, which is missing"), std::string::npos) << e.what();
  }
}

// ---- through the binary --------------------------------------------------------------------

struct Resume {
  const char* fixture;
  const char* strategy;
  int devices;
};
void PrintTo(const Resume& r, std::ostream* os) { *os << r.fixture << "_" << r.strategy << "_" << r.devices; }

class DcpResume : public ::testing::TestWithParam<Resume> {};

// --ckpt-path DCP_FOLDER resumes weights, AdamW moments and step: the loss logged at the first
// resumed step is PyTorch's on the same row (1e-5), and the weights after that step equal
// PyTorch's second AdamW step (which needs the moments and the step count) within 1e-5.
TEST_P(DcpResume, ContinuesTrainingAsPyTorchDoes) {
  const Resume p = GetParam();
  const std::string dir = tessera::testing::fresh_dir(std::string("dcp-") + p.fixture + "-" + p.strategy +
                                                      std::to_string(p.devices));
  auto r = run_tessera("fit --config " + write_config(dir) + " --set launch.devices=" + std::to_string(p.devices) +
                           " --set strategy.plugin=" + p.strategy + " --ckpt-path " + kFixtures + "/" + p.fixture,
                       "", 240);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto losses = tessera::testing::metric_series(run_dir(dir) + "/metrics.csv", "train", "train_loss");
  ASSERT_EQ(losses.count(1), 0u) << "step 1 was trained again: the step was not resumed";
  ASSERT_EQ(losses.count(2), 1u) << r.output;
  const double want = expected().at("loss_before_step_2").get<double>();
  EXPECT_NEAR(losses.at(2), want, 1e-5 * std::abs(want)) << r.output;

  const auto trained = tessera::testing::checkpoint_state(run_dir(dir) + "/checkpoints/last.ckpt");
  core::SafetensorsReader reference(kFixtures + "/expected.safetensors");
  ASSERT_EQ(trained.size(), reference.tensors().size());
  for (const auto& [name, entry] : reference.tensors()) {
    ASSERT_TRUE(trained.count(name)) << name;
    const at::Tensor want_w = reference.read(name);
    EXPECT_TRUE(at::allclose(trained.at(name), want_w, 1e-5, 1e-6))
        << name << ": max difference " << (trained.at(name) - want_w).abs().max().item<double>();
  }
}

INSTANTIATE_TEST_SUITE_P(Folders, DcpResume,
                         ::testing::Values(Resume{"fsdp2", "fsdp2", 2}, Resume{"fsdp2", "fsdp2", 3},
                                           Resume{"fsdp2", "fsdp", 2}, Resume{"fsdp2", "single_device", 1},
                                           Resume{"torchtitan", "fsdp2", 1}, Resume{"torchtitan", "fsdp2", 3},
                                           Resume{"torchtitan", "ddp", 2}),
                         [](const auto& info) {
                           return std::string(info.param.fixture) + "_" + info.param.strategy + "_" +
                                  std::to_string(info.param.devices);
                         });

// [trainer] init_from = DCP_FOLDER takes the weights only (a fresh optimizer, step 1 trained):
// the first loss is PyTorch's at those weights.
TEST(DcpInitFrom, StartsFromTheWeights) {
  for (const char* fixture : {"fsdp2", "torchtitan"}) {
    const std::string dir = tessera::testing::fresh_dir(std::string("dcp-init-") + fixture);
    auto r = run_tessera("fit --config " + write_config(dir) + " --set launch.devices=2 --set strategy.plugin=fsdp2" +
                         " --set trainer.max_steps=1 --set trainer.init_from=" + kFixtures + "/" + fixture);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto losses = tessera::testing::metric_series(run_dir(dir) + "/metrics.csv", "train", "train_loss");
    ASSERT_EQ(losses.count(1), 1u) << r.output;
    const double want = expected().at("loss_before_step_2").get<double>();
    EXPECT_NEAR(losses.at(1), want, 1e-5 * std::abs(want)) << fixture;
  }
}

// A folder that does not fit the model is refused before any step, naming the tensor and both
// shapes; a weights-only use of a resume, and non-strict loading, are refused clearly.
TEST(DcpInitFrom, RefusesWhatDoesNotFitBeforeAnyStep) {
  const std::string dir = tessera::testing::fresh_dir("dcp-refuse");
  auto wide = run_tessera("fit --config " + write_config(dir) + " --set launch.devices=2 --set strategy.plugin=fsdp2" +
                          " --set model.intermediate_size=40 --set trainer.init_from=" + kFixtures + "/fsdp2");
  EXPECT_NE(wide.exit_code, 0);
  EXPECT_NE(wide.output.find("model.layers.0.mlp.gate_proj.weight"), std::string::npos) << wide.output;
  EXPECT_NE(wide.output.find("[48, 32]"), std::string::npos) << wide.output;
  auto loose = run_tessera("fit --config " + write_config(dir) + " --set trainer.init_from_strict=false" +
                           " --set trainer.init_from=" + kFixtures + "/torchtitan");
  EXPECT_NE(loose.exit_code, 0);
  EXPECT_NE(loose.output.find("is a PyTorch DCP folder, which loads by name and shape in full only"), std::string::npos)
      << loose.output;
  EXPECT_FALSE(fs::exists(run_dir(dir) + "/checkpoints/last.ckpt"));
}

// ---- out ------------------------------------------------------------------------------------

// What the writer's pickle says is what the reader reads; an export that does not commit
// leaves nothing that reads as a checkpoint (not even its hidden temporary folder).
TEST(DcpExport, AnUncommittedWriteLeavesNoFolder) {
  const std::string dir = tessera::testing::fresh_dir("dcp-writer");
  {
    core::DcpWriter writer(dir + "/out");
    writer.add("w", at::arange(6, at::kFloat).reshape({2, 3}));
    writer.add("optimizer.state.w.step", at::scalar_tensor(3.0));
  }
  EXPECT_TRUE(fs::is_empty(dir)) << "an abandoned export left files";
  core::DcpWriter writer(dir + "/out");
  writer.add("w", at::arange(6, at::kFloat).reshape({2, 3}));
  writer.add("i", at::arange(4, at::kLong));
  writer.commit();
  const core::DcpMetadata m = core::read_dcp_metadata(dir + "/out");
  ASSERT_EQ(m.tensors.size(), 2u);
  EXPECT_EQ(m.tensors.at("w").size, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(m.tensors.at("i").dtype, at::kLong);
  EXPECT_THROW(core::DcpWriter{dir + "/out"}, sdk::Error);  // an existing folder is never overwritten
}

/// A fit of the fixture's model from `ckpt` to `steps`; its run folder.
std::string fit_from(const std::string& name, const std::string& ckpt, int steps, const std::string& sets = "") {
  const std::string dir = tessera::testing::fresh_dir(name);
  auto r = run_tessera("fit --config " + write_config(dir) + " --set launch.devices=2 --set strategy.plugin=fsdp2" +
                           " --set trainer.max_steps=" + std::to_string(steps) + " " + sets + " --ckpt-path " + ckpt,
                       "", 240);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return run_dir(dir);
}

// `checkpoint export --format dcp` of a full and of a sharded (3-rank) checkpoint: resuming
// from either export goes on exactly as resuming from the checkpoint itself (the same loss,
// bitwise the same weights), and the two exports hold the same tensors.
TEST(DcpExport, ResumesAsTheCheckpointItselfDoes) {
  const std::string dir = tessera::testing::fresh_dir("dcp-export");
  const std::string full = fit_from("dcp-export-full", kFixtures + "/fsdp2", 2) + "/checkpoints/last.ckpt";
  const std::string sharded_run = fit_from("dcp-export-sharded", kFixtures + "/fsdp2", 2,
                                           "--set launch.devices=3 --set checkpoint_io.plugin=distributed");
  for (const auto& [source, to] : {std::pair{full, dir + "/from-full"}, std::pair{sharded_run, dir + "/from-sharded"}}) {
    auto r = run_tessera("checkpoint export " + source + " --to " + to + " --format dcp");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("a PyTorch DCP folder"), std::string::npos) << r.output;
  }
  const core::DcpMetadata a = core::read_dcp_metadata(dir + "/from-full");
  const core::DcpMetadata b = core::read_dcp_metadata(dir + "/from-sharded");
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  EXPECT_EQ(a.tensors.size(), 21u * 4 + 1);  // weights, exp_avg, exp_avg_sq, step; train_state.step
  EXPECT_TRUE(a.tensors.count("optimizer.state.model.layers.1.mlp.up_proj.weight.exp_avg_sq"));

  // Resumed from each export and from the checkpoint it came from: the same run, bitwise.
  for (const auto& [source, exported] : {std::pair{full, dir + "/from-full"},
                                         std::pair{sharded_run + "/checkpoints/last", dir + "/from-sharded"}}) {
    const std::string reference = fit_from("dcp-export-ref", source, 3);
    const std::string resumed = fit_from("dcp-export-resumed", exported, 3);
    const auto want = tessera::testing::metric_series(reference + "/metrics.csv", "train", "train_loss");
    const auto got = tessera::testing::metric_series(resumed + "/metrics.csv", "train", "train_loss");
    ASSERT_EQ(got.count(3), 1u) << exported;
    EXPECT_EQ(got.at(3), want.at(3)) << exported;
    const auto w = tessera::testing::checkpoint_state(reference + "/checkpoints/last.ckpt");
    const auto g = tessera::testing::checkpoint_state(resumed + "/checkpoints/last.ckpt");
    for (const auto& [name, t] : w)
      EXPECT_TRUE(g.at(name).equal(t)) << exported << " " << name << ": max difference "
                                       << (g.at(name) - t).abs().max().item<double>();
  }
}

// ---- saves during training ([trainer] checkpoint_format = "dcp", i.e. [checkpoint_io] plugin = "dcp") --

// Each rank writes its own chunks (fsdp's flat ranges as boxes, fsdp2's dim-0 slices), rank 0
// the .metadata: a run resumed from its step-2 save at the same layout goes on exactly as the
// uninterrupted run; another strategy and world size read it too; PyTorch's reader's checks
// (every tensor covered once) hold.
TEST(DcpSave, ResumesExactlyAndAcrossLayouts) {
  const std::string sets = " --unset checkpoint_io.plugin --set trainer.checkpoint_format=dcp"
                           " --set strategy.state_dict_type=sharded"
                           " --set trainer.checkpoint_every_n_steps=2 --set launch.devices=3";
  for (const char* strategy : {"fsdp", "fsdp2"}) {
    const std::string plugin = std::string(" --set strategy.plugin=") + strategy;
    const std::string whole = fit_from(std::string("dcp-save-") + strategy, kFixtures + "/fsdp2", 4, sets + plugin);
    const std::string step2 = whole + "/checkpoints/step=2.ckpt";
    ASSERT_TRUE(core::is_dcp_checkpoint(step2)) << step2;
    const core::DcpMetadata m = core::read_dcp_metadata(step2);
    EXPECT_EQ(m.bytes.size(), 3u);  // each rank's trainer state
    EXPECT_GE(m.tensors.at("model.layers.0.mlp.up_proj.weight").chunks.size(), 3u) << strategy;
    EXPECT_EQ(core::read_trainer_state(step2).at("global_step").toInt(), 2);
    auto inspect = run_tessera("checkpoint inspect " + step2);
    EXPECT_NE(inspect.output.find("PyTorch DCP checkpoint " + step2 + "\n  3 data files"), std::string::npos)
        << inspect.output;
    EXPECT_NE(inspect.output.find("saved by tessera at step 2"), std::string::npos) << inspect.output;

    const std::string resumed = fit_from(std::string("dcp-save-resumed-") + strategy, step2, 4, sets + plugin);
    const auto want = tessera::testing::metric_series(whole + "/metrics.csv", "train", "train_loss");
    const auto got = tessera::testing::metric_series(resumed + "/metrics.csv", "train", "train_loss");
    ASSERT_EQ(got.count(2), 0u) << "step 2 trained again";
    for (std::int64_t step : {3, 4}) EXPECT_EQ(got.at(step), want.at(step)) << strategy << " step " << step;

    const std::string other = fit_from(std::string("dcp-save-other-") + strategy, step2, 3,
                                       " --set strategy.plugin=ddp --set checkpoint_io.plugin=torch");
    const auto moved = tessera::testing::metric_series(other + "/metrics.csv", "train", "train_loss");
    EXPECT_NEAR(moved.at(3), want.at(3), 1e-5 * std::abs(want.at(3))) << strategy << " read by ddp on 2 ranks";
  }
}

}  // namespace
