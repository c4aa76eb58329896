// Issue 60, the fine-tune path as docs/llama.md documents it, through the `tessera` binary and the
// shipped configs/llama-finetune-hf.toml: a Hugging Face Llama folder with its SentencePiece
// tokenizer (written by finetune_reference.py on llama_reference.py's transcription of Hugging
// Face's modeling code), its text prepared into token shards by the folder's own tokenizer,
// fine-tuned under bf16-mixed and 32-true with the default attention at T = 160 (two query blocks
// of the blocked kernel), exported with its tokenizer by naming the run root, and sampled: the
// tokens predict prints are those the reference generates from the exported folder. Then each of
// the issue's refusals, and --unset switching every shipped config to every strategy.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "multiprocess.hpp"
#include "tessera/core/checkpoint.hpp"

namespace {

namespace fs = std::filesystem;
using tessera::testing::run_command;
using tessera::testing::run_tessera;

const std::string kConfig = TESSERA_SOURCE_DIR "/configs/llama-finetune-hf.toml";
const std::string kReference = "/usr/bin/python3 " TESSERA_SOURCE_DIR "/tests/finetune/finetune_reference.py";
const std::string kPrompt = "The meaning of life is";  // the shipped config's [data] prompt

using tessera::testing::read_file;

/// The Hugging Face folder, its corpus prepared into token shards, and the --set flags that point
/// the shipped config at them (as docs/llama.md's commands do), made once per test process.
struct Folder {
  fs::path root, hf, data;
  std::string sets;  ///< the three HF_DIR keys, the data path, and a small, fast run
};

const Folder& folder() {
  static const Folder f = [] {
    Folder made;
    made.root = tessera::testing::fresh_dir("finetune");
    made.hf = made.root / "hf";
    made.data = made.root / "data";
    const fs::path corpus = made.root / "corpus.txt";
    fs::copy_file("/usr/share/games/fortunes/fortunes", corpus);  // 431 fortunes, 24 KB
    auto r = run_command(kReference + " folder " + made.hf.string() + " " + corpus.string() + " 2>&1");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    r = run_tessera("data prepare --tokenizer " + made.hf.string() + " --input " + corpus.string() +
                    " --split percent --output " + made.data.string() + " 2>&1");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    made.sets = " --set model.config=" + (made.hf / "config.json").string() + " --set trainer.init_from=" +
                made.hf.string() + " --set data.tokenizer=" + made.hf.string() + " --set data.path=" +
                made.data.string() +
                " --set data.block_size=160 --set data.batch_size=2 --set trainer.max_steps=2"
                " --set trainer.limit_val_batches=1 --set trainer.enable_progress_bar=false";
    return made;
  }();
  return f;
}

double metric(const std::string& output, const std::string& name) {
  std::smatch m;
  EXPECT_TRUE(std::regex_search(output, m, std::regex(name + " ([0-9.]+)"))) << output;
  return m.empty() ? NAN : std::stod(m[1]);
}

/// The ids `tessera predict` wrote to [trainer] predict_output.
std::vector<std::int64_t> predicted_ids(const std::string& path) {
  const auto file = tessera::core::checkpoint_dict(tessera::core::load_pickle(path), path);
  const at::Tensor t = tessera::core::checkpoint_get(file, "predictions").toTensor().to(at::kLong).contiguous();
  return std::vector<std::int64_t>(t.data_ptr<std::int64_t>(), t.data_ptr<std::int64_t>() + t.numel());
}

/// fit under `precision`, export by naming the run root, predict greedily from `last` in fp32,
/// and the reference's greedy generation from the exported folder: the same ids and text.
void fine_tune_export_and_predict(const std::string& precision) {
  const Folder& f = folder();
  const fs::path runs = f.root / ("runs-" + precision), out = f.root / ("export-" + precision);
  const std::string sets = f.sets + " --set trainer.default_root_dir=" + runs.string();
  const auto fit = run_tessera("fit --config " + kConfig + sets + " --set precision.precision=" + precision + " 2>&1",
                               "", 120);
  ASSERT_EQ(fit.exit_code, 0) << fit.output;
  EXPECT_NE(fit.output.find("precision " + precision + ", model llama"), std::string::npos) << fit.output;
  EXPECT_NE(fit.output.find("data tokens"), std::string::npos) << "trained on the folder's tokens\n" << fit.output;
  EXPECT_TRUE(std::isfinite(metric(fit.output, "epoch 0 step 2/2  loss"))) << fit.output;

  // (c) the run root, not a version_N: the newest run's last checkpoint. (d) the tokenizer too.
  const auto exported = run_tessera("checkpoint export " + runs.string() + " --to " + out.string() + " --format hf 2>&1");
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  EXPECT_NE(exported.output.find((runs / "version_0/checkpoints/").string()), std::string::npos) << exported.output;
  for (const char* name : {"tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"}) {
    ASSERT_TRUE(fs::exists(out / name)) << name << " not exported\n" << exported.output;
    EXPECT_EQ(read_file(out / name), read_file(f.hf / name)) << name;
  }
  EXPECT_TRUE(fs::exists(out / "config.json") && fs::exists(out / "model.safetensors")) << exported.output;

  const std::string predictions = (f.root / ("predictions-" + precision + ".pt")).string();
  const auto predict = run_tessera("predict --config " + kConfig + sets + " --ckpt-path last --set " +
                                       "precision.precision=32-true --set model.max_new_tokens=8 --set " +
                                       "trainer.predict_output=" + predictions + " 2>&1",
                                   "", 120);
  ASSERT_EQ(predict.exit_code, 0) << predict.output;
  EXPECT_EQ(predict.output.find("warning"), std::string::npos) << "the same tokenizer: no warning\n" << predict.output;
  const auto reference = run_command(kReference + " greedy " + out.string() + " '" + kPrompt + "' 8");
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  const nlohmann::json want = nlohmann::json::parse(reference.output);
  EXPECT_EQ(predicted_ids(predictions), want.at("ids").get<std::vector<std::int64_t>>()) << predict.output;
  EXPECT_NE(predict.output.find(want.at("text").get<std::string>()), std::string::npos)
      << "predict prints the reference's decoding of those ids\n" << predict.output << "\nreference: " << reference.output;
}

TEST(FineTuneHf, Bf16MixedTrainsOnTheFoldersTokensExportsAndPredictsAsTheReferenceDecodes) {
  fine_tune_export_and_predict("bf16-mixed");
  const Folder& f = folder();
  const std::string sets = f.sets + " --set trainer.default_root_dir=" + (f.root / "runs-bf16-mixed").string();
  // (b) predict on byte ids from weights trained on the tokenizer's: warned, naming both.
  const auto bytes = run_tessera("predict --config " + kConfig + sets + " --ckpt-path last --unset data " +
                                 "--set data.plugin=text --set 'data.prompt=\"The meaning\"' --set model.max_new_tokens=2 2>&1");
  EXPECT_EQ(bytes.exit_code, 0) << bytes.output;
  EXPECT_NE(bytes.output.find("tessera: warning: checkpoint "), std::string::npos) << bytes.output;
  EXPECT_NE(bytes.output.find("with the tokenizer " + (f.hf / "tokenizer.model").string() +
                              ", but this config's data is [data] plugin = \"text\" (byte ids, 0-255)"),
            std::string::npos)
      << bytes.output;
  // (e) `tessera test` evaluates the test split: other documents than validate's, so another loss.
  const auto test = run_tessera("test --config " + kConfig + sets + " --ckpt-path last 2>&1");
  const auto validate = run_tessera("validate --config " + kConfig + sets + " --ckpt-path last 2>&1");
  ASSERT_EQ(test.exit_code, 0) << test.output;
  ASSERT_EQ(validate.exit_code, 0) << validate.output;
  EXPECT_NE(metric(test.output, "test_loss"), metric(validate.output, "val_loss")) << test.output << validate.output;
}

TEST(FineTuneHf, ThirtyTwoTrueTrainsExportsAndPredictsAndExportTakesTheNewestRun) {
  fine_tune_export_and_predict("32-true");
  // (c) a second fit in the same root: exporting the root takes it, whichever run came first.
  const Folder& f = folder();
  const fs::path runs = f.root / "runs-32-true";
  const auto again = run_tessera("fit --config " + kConfig + f.sets + " --set trainer.default_root_dir=" +
                                 runs.string() + " --set precision.precision=32-true --set trainer.max_steps=1 2>&1");
  ASSERT_EQ(again.exit_code, 0) << again.output;
  const auto exported = run_tessera("checkpoint export " + runs.string() + " --to " + (f.root / "second").string() +
                                    " --format hf 2>&1");
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  EXPECT_NE(exported.output.find((runs / "version_1/checkpoints/").string()), std::string::npos) << exported.output;
}

/// Refused before any rank starts: the error, and no rank's log or run folder.
void expect_refused_before_launch(const tessera::testing::CommandResult& r, const fs::path& root,
                                  const std::vector<std::string>& parts) {
  EXPECT_EQ(r.exit_code, 1) << r.output;
  for (const std::string& part : parts) EXPECT_NE(r.output.find(part), std::string::npos) << part << "\n" << r.output;
  EXPECT_EQ(r.output.find("launched"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(root)) << root << " was created: the job started";
}

TEST(FineTuneHf, RefusalsComeBeforeAnyWork) {
  const Folder& f = folder();
  const fs::path root = f.root / "refused";
  const std::string sets = f.sets + " --set trainer.default_root_dir=" + root.string();
  // (f) block_size above max_position_embeddings (256 in the folder's config.json).
  expect_refused_before_launch(
      run_tessera("fit --config " + kConfig + sets + " --set data.block_size=300 2>&1"), root,
      {"--set data.block_size=300: [data] block_size = 300 is longer than the model's context, \"" +
           (f.hf / "config.json").string() + "\": max_position_embeddings = 256",
       "Set [data] block_size to at most 256"});
  // (g) predict without a prompt, found before the ranks launch.
  expect_refused_before_launch(run_tessera("predict --config " + kConfig + sets + " --unset data.prompt 2>&1"), root,
                               {"tessera predict generates from the data's prompt, but the data cannot predict: ",
                                "[data] prompt is needed by predict"});
  // --unset of what the config does not hold: named, with what it holds.
  expect_refused_before_launch(run_tessera("fit --config " + kConfig + sets + " --unset strategy.parallelize_fnn 2>&1"),
                               root,
                               {"--unset strategy.parallelize_fnn: [strategy] has no key parallelize_fnn (did you mean "
                                "'parallelize_fn'?); it holds: activation_checkpointing, deferred_init, "
                                "parallelize_fn, plugin"});
  // (e) `tessera test` with no test split: refused naming the keys that make one (at setup).
  const auto test = run_tessera("test --config " + kConfig + sets + " --unset data.test_fraction 2>&1");
  EXPECT_EQ(test.exit_code, 1) << test.output;
  EXPECT_NE(test.output.find("tessera test evaluates the data's test split, and the tokens plugin has none here: set "),
            std::string::npos)
      << test.output;
  EXPECT_NE(test.output.find("[data] test_fraction"), std::string::npos) << test.output;
  EXPECT_EQ(test.output.find("test_loss"), std::string::npos) << test.output;
}

// --unset: every shipped config switched to every strategy, checked by `tessera config` (every
// plugin created and its keys checked, the world size against the strategy), no training.
// (Without --unset the old strategy's keys are refused: BadInput.EveryShippedConfigSwitchesToEveryStrategy.)
TEST(UnsetSwitchesStrategy, EveryShippedConfigToEveryStrategy) {
  const Folder& f = folder();
  std::vector<fs::path> configs;
  for (const auto& entry : fs::directory_iterator(TESSERA_SOURCE_DIR "/configs"))
    if (entry.path().extension() == ".toml") configs.push_back(entry.path());
  std::sort(configs.begin(), configs.end());
  ASSERT_GE(configs.size(), 6u);
  for (const fs::path& config : configs) {
    // The configs that start from a Hugging Face folder take the test's.
    const bool from_folder = config.filename() == "llama-finetune-hf.toml" || config.filename() == "llama-sft.toml";
    const std::string needs = from_folder ? f.sets : "";
    for (const std::string strategy : {"single_device", "ddp", "fsdp", "fsdp2"}) {
      SCOPED_TRACE(config.filename().string() + " -> " + strategy);
      const std::string devices = strategy == "single_device" ? " --set launch.devices=1" : "";
      const auto r = run_tessera("config --config " + config.string() + needs + devices +
                                 " --unset strategy --set strategy.plugin=" + strategy + " 2>&1");
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_NE(r.output.find("[strategy]\nplugin = \"" + strategy + "\"  #"), std::string::npos) << r.output;
    }
  }
}

}  // namespace
