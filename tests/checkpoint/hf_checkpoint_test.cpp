// Hugging Face checkpoints in and out (issue 47, points 2 and 3): the safetensors header parser
// on malformed bytes; the exporter's files field by field and through an independent Python
// reader; Python-written folders (fp32, bf16, fp16; one file or an index of several) loaded by
// `[trainer] init_from` under fsdp and exported back bitwise; a trained sharded checkpoint
// exported and re-imported bitwise (bf16: the rounded weights); what a rank's load costs in
// memory on 1, 2 and 4 ranks; and the refusals. The model is tests' `hf_tiny` (Hugging Face's
// names and a config.json), so nothing here depends on a real architecture.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "multiprocess.hpp"
#include "tessera/core/checkpoint.hpp"
#include "checkpoint/dcp.hpp"
#include "checkpoint/huggingface.hpp"
#include "tessera/core/safetensors.hpp"
#include "tessera/core/sharded_checkpoint.hpp"
#include "tessera/sdk/error.hpp"

namespace {

namespace fs = std::filesystem;
namespace core = tessera::core;
namespace sdk = tessera::sdk;
using json = nlohmann::json;
using tessera::testing::run_command;
using tessera::testing::run_dir;
using tessera::testing::run_tessera;

using tessera::testing::read_file;

/// hf_folder.py (an independent writer, checker and comparer); its output, exit status checked.
std::string python(const std::string& arguments) {
  auto r = run_command("/usr/bin/python3 " TESSERA_CHECKPOINT_TEST_DIR "/hf_folder.py " + arguments + " 2>&1");
  EXPECT_EQ(r.exit_code, 0) << "hf_folder.py " << arguments << "\n" << r.output;
  return r.output;
}

/// A run of the hf_tiny model on the text data: `extra` is more TOML (sections last).
std::string write_config(const std::string& dir, const std::string& model, const std::string& extra = "") {
  std::ofstream(dir + "/run.toml") << "plugin_dirs = [\"" HF_TINY_PLUGIN_DIR "\"]\n"
                                   << "[trainer]\nmax_steps = 1\nlog_every_n_steps = 1\nseed = 7\n"
                                   << "default_root_dir = \"" << dir << "\"\nenable_progress_bar = false\n"
                                   << "checkpoint_every_n_steps = 1\nnum_sanity_val_steps = 0\n"
                                   << "[optimizer]\nname = \"adamw\"\nlr = 0.0\n"
                                   << "[model]\nplugin = \"hf_tiny\"\n" << model
                                   << "[data]\nplugin = \"text\"\nblock_size = 16\nbatch_size = 2\n"
                                   << "[checkpoint_io]\nplugin = \"distributed\"\n" << extra;
  return dir + "/run.toml";
}
const std::string kSmall = "hidden_size = 24\nintermediate_size = 40\nnum_hidden_layers = 3\n";
const std::string kSmallPy = "--hidden 24 --intermediate 40 --layers 3";

// ---- the safetensors header parser, a function over untrusted bytes ------------------------

std::string file_bytes(const std::string& header, std::size_t data_bytes, bool pad = true) {
  std::string h = header;
  if (pad) h.append((8 - h.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const std::uint64_t n = h.size();
  std::memcpy(out.data(), &n, 8);
  return out + h + std::string(data_bytes, '\0');
}

TEST(SafetensorsHeader, ParsesEveryField) {
  const std::string bytes = file_bytes(
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
      R"("b":{"dtype":"BF16","shape":[],"data_offsets":[24,26]},"c":{"dtype":"I64","shape":[0],"data_offsets":[26,26]}})",
      26);
  const core::SafetensorsHeader h = core::parse_safetensors_header(bytes, static_cast<std::int64_t>(bytes.size()), "f");
  EXPECT_EQ(h.data_start % 8, 0);
  EXPECT_EQ(h.metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ(h.tensors.size(), 3u);
  EXPECT_EQ(h.tensors.at("a").dtype, at::kFloat);
  EXPECT_EQ(h.tensors.at("a").shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(h.tensors.at("a").begin, h.data_start);
  EXPECT_EQ(h.tensors.at("a").end, h.data_start + 24);
  EXPECT_EQ(h.tensors.at("b").dtype, at::kBFloat16);
  EXPECT_TRUE(h.tensors.at("b").shape.empty());
  EXPECT_EQ(h.tensors.at("c").end - h.tensors.at("c").begin, 0);
}

TEST(SafetensorsHeader, RefusesMalformedBytesNamingWhat) {
  const std::string a = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  std::string huge(8, '\0');
  const std::uint64_t n = std::uint64_t{1} << 62;
  std::memcpy(huge.data(), &n, 8);
  const std::vector<std::pair<std::string, std::string>> cases{
      {std::string("\x05\0\0", 3), "only 3 bytes"},
      {huge + "{}", "does not fit"},
      {file_bytes("not json", 0), "not JSON"},
      {file_bytes("[1,2]", 0), "not a JSON object"},
      {file_bytes("{" + a + "}", 4), "do not hold"},                                                   // truncated
      {file_bytes("{" + a + "}", 12), "after the last tensor"},                                        // trailing bytes
      {file_bytes(R"({"a":{"dtype":"Q8","shape":[2],"data_offsets":[0,8]}})", 8), "Q8"},              // dtype
      {file_bytes(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), "non-negative"},  // dim
      {file_bytes(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8), "non-negative"},
      {file_bytes(R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}})", 8), "more bytes"},
      {file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), "0 <= begin <= end"},
      {file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8), "0 <= begin <= end"},
      {file_bytes(R"({"a":{"dtype":"F32","shape":[2]}})", 8), "malformed"},
      {file_bytes(R"({"a":7})", 8), "malformed"},
      {file_bytes("{" + a + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12), "share"},   // overlap
      {file_bytes("{" + a + R"(,"b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})", 16), "no tensor"},  // gap
      {file_bytes(R"({"__metadata__":{"format":1}})", 0), "not a string"},
      {file_bytes(R"({"__metadata__":[]})", 0), "not an object"},
  };
  for (const auto& [bytes, expected] : cases) {
    try {
      (void)core::parse_safetensors_header(bytes, static_cast<std::int64_t>(bytes.size()), "f.safetensors");
      ADD_FAILURE() << "accepted; expected an error with: " << expected;
    } catch (const sdk::Error& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("f.safetensors"), std::string::npos) << e.what();
    }
  }
  // A header length past what was handed in is refused, not read.
  const std::string ok = file_bytes("{" + a + "}", 8);
  EXPECT_THROW(core::parse_safetensors_header(std::string_view(ok).substr(0, 20), static_cast<std::int64_t>(ok.size()), "f"),
               sdk::Error);
}

TEST(HfFolder, ParsesSizesAsTransformersDoes) {
  EXPECT_EQ(core::parse_byte_size("5GB", "s"), 5'000'000'000);
  EXPECT_EQ(core::parse_byte_size("2GiB", "s"), std::int64_t{2} << 30);
  EXPECT_EQ(core::parse_byte_size("500MB", "s"), 500'000'000);
  EXPECT_EQ(core::parse_byte_size("64KiB", "s"), 65536);
  EXPECT_EQ(core::parse_byte_size("1000", "s"), 1000);
  for (const char* bad : {"", "GB", "-1GB", "5 XB", "0", "fiveGB"})
    EXPECT_THROW(core::parse_byte_size(bad, "--max-shard-size"), sdk::Error) << bad;
}

// ---- the exporter's files -------------------------------------------------------------------

TEST(HfFolder, WritesShardsAndIndexFieldByFieldReadByPython) {
  const std::string dir = tessera::testing::fresh_dir("hf-write");
  std::vector<std::pair<std::string, at::Tensor>> tensors{
      {"model.embed_tokens.weight", at::randn({50, 8})},                    // 1600 bytes: a shard of its own
      {"model.layers.0.w", at::randn({7, 3}).to(at::kBFloat16)},           // 42 bytes: 2-byte elements after 4-byte ones
      {"model.layers.0.b", at::randn({5})},
      {"model.layers.1.w", at::randn({10, 10})},
      {"lm_head.weight", at::randn({3, 3}).to(at::kHalf)},
      {"empty", at::empty({0, 4})}};
  std::vector<core::TensorSpec> specs;
  for (const auto& [name, t] : tensors) specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  std::size_t produced = 0;
  const core::HfExport out = core::write_hf_directory(
      dir + "/hf", specs, [&](std::size_t i) { return ++produced, tensors[i].second; }, R"({"model_type":"x"})",
      R"({"_from_model_config":true})", 430);
  EXPECT_EQ(produced, tensors.size());
  ASSERT_EQ(out.files.size(), 3u);
  EXPECT_EQ(out.files[0], "model-00001-of-00003.safetensors");
  EXPECT_EQ(json::parse(read_file(dir + "/hf/config.json")), json::parse(R"({"model_type":"x"})"));
  EXPECT_TRUE(fs::exists(dir + "/hf/generation_config.json"));
  EXPECT_FALSE(fs::exists(dir + "/hf/model.safetensors"));

  // Field by field, from the raw bytes (not Tessera's parser).
  const json index = json::parse(read_file(dir + "/hf/model.safetensors.index.json"));
  std::int64_t total = 0;
  std::set<std::string> seen;
  for (const std::string& file : out.files) {
    const std::string raw = read_file(dir + "/hf/" + file);
    std::uint64_t n = 0;
    std::memcpy(&n, raw.data(), 8);  // little-endian u64 (this machine is little-endian)
    ASSERT_LE(8 + n, raw.size());
    EXPECT_EQ((8 + n) % 8, 0u) << file << ": the data does not start 8-byte aligned";
    json header = json::parse(raw.substr(8, n));
    EXPECT_EQ(header.at("__metadata__"), json::parse(R"({"format":"pt"})")) << file;
    header.erase("__metadata__");
    std::int64_t end = 0, data = 0;
    for (const auto& [name, e] : header.items()) {
      EXPECT_EQ(e.size(), 3u) << name;
      const auto offsets = e.at("data_offsets").get<std::vector<std::int64_t>>();
      ASSERT_EQ(offsets.size(), 2u);
      auto it = std::find_if(tensors.begin(), tensors.end(), [&](const auto& t) { return t.first == name; });
      ASSERT_NE(it, tensors.end()) << name;
      EXPECT_EQ(e.at("dtype").get<std::string>(), core::safetensors_dtype(it->second.scalar_type())) << name;
      EXPECT_EQ(e.at("shape").get<std::vector<std::int64_t>>(), it->second.sizes().vec()) << name;
      EXPECT_EQ(offsets[1] - offsets[0], static_cast<std::int64_t>(it->second.nbytes())) << name;
      EXPECT_EQ(offsets[0] % static_cast<std::int64_t>(it->second.element_size()), 0) << name << ": misaligned";
      // An empty tensor has no data pointer to compare (memcmp with null is undefined even for 0 bytes).
      EXPECT_TRUE(it->second.nbytes() == 0 || std::memcmp(raw.data() + 8 + n + offsets[0],
                                                          it->second.contiguous().data_ptr(), it->second.nbytes()) == 0)
          << name;
      EXPECT_EQ(index.at("weight_map").at(name), file) << name;
      end = std::max(end, offsets[1]);
      data += offsets[1] - offsets[0];
      seen.insert(name);
    }
    EXPECT_EQ(end, data) << file << ": tensors overlap or leave gaps";
    EXPECT_EQ(8 + static_cast<std::int64_t>(n) + end, static_cast<std::int64_t>(raw.size())) << file;
    EXPECT_TRUE(data <= 430 || header.size() == 1) << file << " holds more than the largest shard size";
    total += data;
  }
  EXPECT_EQ(seen.size(), tensors.size());
  EXPECT_EQ(index.at("metadata").at("total_size").get<std::int64_t>(), total);
  EXPECT_EQ(out.total_bytes, total);

  // An independent reader (Python: json + struct + torch.frombuffer) gets the same tensors.
  EXPECT_NE(python("check " + dir + "/hf").find("ok 3 files 6 tensors"), std::string::npos);
  const std::string script = dir + "/save.py";
  std::ofstream(script) << "import sys, torch\nsys.path.insert(0, '" TESSERA_CHECKPOINT_TEST_DIR "')\n"
                           "import hf_folder\ntorch.save(hf_folder.load(sys.argv[1]), sys.argv[2])\n";
  auto r = run_command("/usr/bin/python3 " + script + " " + dir + "/hf " + dir + "/py.pt 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const sdk::StateDict back = core::state_dict_from(core::load_checkpoint_file(dir + "/py.pt").at("state_dict"), "py.pt");
  ASSERT_EQ(back.size(), tensors.size());
  for (const auto& [name, t] : tensors) EXPECT_TRUE(back[name].equal(t)) << name;

  // A second export into a folder that exists and is not empty is refused, nothing written.
  EXPECT_THROW(core::write_hf_directory(dir + "/hf", specs, [&](std::size_t i) { return tensors[i].second; }, "{}",
                                        "{}", 430),
               sdk::Error);
}

// ---- import through the binary, export back -------------------------------------------------

struct Source {
  const char* dtype;   // hf_folder.py's
  int shards;          // 1: model.safetensors
  const char* export_dtype;
};
// Else GoogleTest prints a Source as its bytes (pointers), different at each run of the binary,
// in the test names ctest lists and keys its cost data by.
void PrintTo(const Source& s, std::ostream* os) { *os << s.dtype; }

class HfRoundTrip : public ::testing::TestWithParam<Source> {};

// Python writes a Hugging Face folder; 2 fsdp ranks start from it (lr = 0: one step changes
// nothing) and save; the run exported in the source's dtype equals the source bitwise.
TEST_P(HfRoundTrip, PythonFolderThroughFsdpAndBackBitwise) {
  const Source s = GetParam();
  const std::string dir = tessera::testing::fresh_dir(std::string("hf-rt-") + s.dtype);
  python("write " + dir + "/src " + kSmallPy + " --dtype " + s.dtype + " --shards " + std::to_string(s.shards));
  // A source with its own generation config (a chat model's end-of-turn token) is exported with
  // it, as save_pretrained writes the one the model was loaded with; one without gets config.json's ids.
  const std::string own_generation = R"({"bos_token_id": 1, "eos_token_id": [2, 7], "do_sample": true, "top_p": 0.8})";
  const bool has_generation = std::string(s.dtype) == "bf16";
  if (has_generation) std::ofstream(dir + "/src/generation_config.json") << own_generation;
  auto fit = run_tessera("fit --config " + write_config(dir, kSmall) + " --set launch.devices=2 --set strategy.plugin=fsdp" +
                         " --set strategy.state_dict_type=sharded --set trainer.init_from=" + dir + "/src");
  ASSERT_EQ(fit.exit_code, 0) << fit.output;
  EXPECT_NE(fit.output.find("weights initialized from " + dir + "/src"), std::string::npos) << fit.output;
  auto exp = run_tessera("checkpoint export " + run_dir(dir) + " --to " + dir + "/out --format hf --dtype " +
                         s.export_dtype + " --max-shard-size 20KB");
  ASSERT_EQ(exp.exit_code, 0) << exp.output;
  python("check " + dir + "/out");
  EXPECT_NE(python("compare " + dir + "/out " + dir + "/src").find("equal 12 tensors"), std::string::npos);
  const json config = json::parse(read_file(dir + "/out/config.json"));
  EXPECT_EQ(config.at("model_type"), "tessera_hf_tiny");
  EXPECT_EQ(config.at("hidden_size"), 24);
  EXPECT_EQ(config.at("torch_dtype"), std::string(s.export_dtype) == "fp32"   ? "float32"
                                      : std::string(s.export_dtype) == "bf16" ? "bfloat16"
                                                                              : "float16");
  EXPECT_EQ(json::parse(read_file(dir + "/out/generation_config.json")),
            json::parse(has_generation ? own_generation
                                       : std::string(R"({"_from_model_config":true,"bos_token_id":1,"eos_token_id":2})")));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, HfRoundTrip,
                         ::testing::Values(Source{"f32", 3, "fp32"}, Source{"bf16", 1, "bf16"}, Source{"f16", 2, "fp16"}),
                         [](const auto& info) { return std::string(info.param.dtype); });

/// A full checkpoint's (or a sharded one's, exported whole) state dict.
sdk::StateDict trained_weights(const std::string& checkpoint, const std::string& dir) {
  std::string file = checkpoint;
  if (core::is_sharded_checkpoint(checkpoint)) {
    auto r = run_tessera("checkpoint export " + checkpoint + " --to " + dir + "/whole.ckpt");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    file = dir + "/whole.ckpt";
  }
  sdk::StateDict state = core::state_dict_from(core::load_checkpoint_file(file).at("state_dict"), file);
  sdk::StateDict out;
  for (const auto& item : state) out.insert(item.key(), item.value().clone());
  return out;
}

// Trained weights (fsdp2, 2 ranks, a sharded checkpoint) exported as fp32 in several files load
// into another strategy bitwise; exported as bf16 they load as the bf16-rounded weights.
TEST(HfExport, TrainedShardedCheckpointRoundTripsBitwise) {
  const std::string dir = tessera::testing::fresh_dir("hf-trained");
  const std::string src = dir + "/train";
  fs::create_directories(src);
  auto fit = run_tessera("fit --config " + write_config(src, kSmall) + " --set launch.devices=2 --set strategy.plugin=fsdp2" +
                         " --set strategy.state_dict_type=sharded --set optimizer.lr=0.01 --set trainer.max_steps=2");
  ASSERT_EQ(fit.exit_code, 0) << fit.output;
  const std::string ckpt = run_dir(src) + "/checkpoints/step=2.ckpt";
  ASSERT_TRUE(core::is_sharded_checkpoint(ckpt)) << fit.output;
  const sdk::StateDict trained = trained_weights(ckpt, dir);
  ASSERT_EQ(trained.size(), 12u);

  for (const char* dtype : {"fp32", "bf16"}) {
    const std::string out = dir + "/hf-" + dtype;
    auto exp = run_tessera("checkpoint export " + ckpt + " --to " + out + " --format hf --dtype " + dtype +
                           " --max-shard-size 10KiB");
    ASSERT_EQ(exp.exit_code, 0) << exp.output;
    EXPECT_TRUE(fs::exists(out + "/model.safetensors.index.json")) << exp.output;
    python("check " + out);
    const std::string run = dir + "/load-" + dtype;
    fs::create_directories(run);
    auto load = run_tessera("fit --config " + write_config(run, kSmall) + " --set strategy.plugin=single_device" +
                            " --set checkpoint_io.plugin=torch --set trainer.init_from=" + out);
    ASSERT_EQ(load.exit_code, 0) << load.output;
    const sdk::StateDict loaded = trained_weights(run_dir(run) + "/checkpoints/step=1.ckpt", run);
    for (const auto& item : trained) {
      const at::Tensor want = std::string(dtype) == "fp32" ? item.value() : item.value().to(at::kBFloat16).to(at::kFloat);
      ASSERT_TRUE(loaded.contains(item.key())) << item.key();
      EXPECT_TRUE(loaded[item.key()].equal(want)) << dtype << " " << item.key();
    }
  }
}

// ---- what a rank's load costs ---------------------------------------------------------------

// A ~270 MB fp32 folder (3 files) loaded under fsdp by 1, 2 and 4 ranks: each maps the files
// and copies out its flat range of each unit, so what the load adds to a rank's peak RSS is
// about model/N (plus, at most, one unit's worth where ranges cut pages), not the model. The
// same tensors as a PyTorch DCP folder (one chunk per tensor, in one data file) load the same
// way: each rank maps the data file and copies its part out of each chunk's mapped record.
TEST(HfImport, EachRankHoldsAboutItsShardWhileLoading) {
  const std::string dir = tessera::testing::fresh_dir("hf-memory");
  const std::string model = "hidden_size = 1024\nintermediate_size = 4096\nnum_hidden_layers = 8\n";
  python("write " + dir + "/src --hidden 1024 --intermediate 4096 --layers 8 --shards 3");
  {
    const core::HfDirectory hf = core::read_hf_directory(dir + "/src");
    core::DcpWriter dcp(dir + "/dcp");
    for (const auto& [name, t] : hf.tensors) dcp.add(name, core::SafetensorsReader(dir + "/src/" + t.file).read(name));
    dcp.commit();
  }
  double file_mb = 0;
  for (const auto& e : fs::directory_iterator(dir + "/src"))
    if (e.path().extension() == ".safetensors") file_mb += static_cast<double>(fs::file_size(e.path())) / 1048576.0;
  const double unit_mb = 2.0 * 1024 * 4096 * 4 / 1048576.0;  // one layer's up and down projections
  ASSERT_GT(file_mb, 250.0);
  for (const char* source : {"src", "dcp"}) {
    std::map<int, double> peak;
    for (int ranks : {1, 2, 4}) {
      const std::string run = dir + "/" + source + std::to_string(ranks);
      fs::create_directories(run);
      auto r = run_tessera("validate --config " + write_config(run, model) + " --set launch.devices=" +
                               std::to_string(ranks) + " --set strategy.plugin=fsdp --set trainer.limit_val_batches=1" +
                               " --set trainer.init_from=" + dir + "/" + source,
                           "", 180);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      std::smatch m;
      ASSERT_TRUE(std::regex_search(r.output, m, std::regex(R"(load peak \+([0-9]+) MB RSS per rank)")))
          << "the init_from line names no load peak (no /proc/self/clear_refs?)\n" << r.output;
      peak[ranks] = std::stod(m[1]);
    }
    std::cout << "[ " << (source == std::string("src") ? "hf" : "dcp") << " load ] " << file_mb << " MB, unit "
              << unit_mb << " MB: load peak per rank +" << peak[1] << " MB on 1 fsdp rank, +" << peak[2] << " on 2, +"
              << peak[4] << " on 4\n";
    for (int ranks : {1, 2, 4})
      EXPECT_LE(peak[ranks], 1.15 * (file_mb / ranks + unit_mb))
          << source << ", " << ranks << " ranks: a rank holds more than its shard";
  }
}

// ---- refusals, before any step ---------------------------------------------------------------

std::string init_from(const std::string& dir, const std::string& folder, const std::string& model = kSmall,
                      const std::string& extra = "") {
  fs::create_directories(dir);
  auto r = run_tessera("fit --config " + write_config(dir, model) + " --set launch.devices=2 --set strategy.plugin=fsdp" +
                       " --set trainer.init_from=" + folder + extra);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("weights initialized from"), std::string::npos) << r.output;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().rfind("step=", 0), std::string::npos)
        << "a step ran before the refusal: " << e.path() << "\n" << r.output;
  return r.output;
}

TEST(HfImport, RefusesWhatDoesNotFitNamingIt) {
  const std::string dir = tessera::testing::fresh_dir("hf-refuse");
  python("write " + dir + "/src " + kSmallPy + " --shards 3");

  // A shard the index names is missing: named with the index.
  fs::copy(dir + "/src", dir + "/missing", fs::copy_options::recursive);
  fs::remove(dir + "/missing/model-00002-of-00003.safetensors");
  std::string out = init_from(dir + "/r1", dir + "/missing");
  EXPECT_NE(out.find("model-00002-of-00003.safetensors, which is missing"), std::string::npos) << out;
  EXPECT_NE(out.find("model.safetensors.index.json"), std::string::npos) << out;

  // Another width: the tensor, its file and both shapes.
  out = init_from(dir + "/r2", dir + "/src", "hidden_size = 24\nintermediate_size = 48\nnum_hidden_layers = 3\n");
  EXPECT_TRUE(std::regex_search(out, std::regex(R"('model\.layers\.0\.mlp\.down_proj\.weight' in \S+/src/)"
                                                R"(model-0000[123]-of-00003\.safetensors has shape \[24, 40\], )"
                                                R"(the model's is \[24, 48\])")))
      << out;
  EXPECT_NE(out.find("init_from_strict = false"), std::string::npos) << out;

  // A config.json of another model_type.
  python("write " + dir + "/other " + kSmallPy + " --model-type llama");
  out = init_from(dir + "/r3", dir + "/other");
  EXPECT_NE(out.find("is a model of model_type \"llama\"; this model is \"tessera_hf_tiny\""), std::string::npos) << out;

  // A config.json that states another size than the model's (same shapes otherwise).
  python("write " + dir + "/cfg " + kSmallPy);
  json config = json::parse(read_file(dir + "/cfg/config.json"));
  config["rms_norm_eps"] = 1e-5;
  std::ofstream(dir + "/cfg/config.json") << config.dump();
  out = init_from(dir + "/r4", dir + "/cfg");
  EXPECT_NE(out.find("rms_norm_eps: the model's 1e-06, the file's 1e-05"), std::string::npos) << out;

  // A folder with weights but no config.json is not taken for a Hugging Face folder.
  fs::copy(dir + "/src", dir + "/noconfig", fs::copy_options::recursive);
  fs::remove(dir + "/noconfig/config.json");
  out = init_from(dir + "/r5", dir + "/noconfig");
  EXPECT_NE(out.find("not a Hugging Face model folder"), std::string::npos) << out;
}

// init_from_strict = false: the tensors that match by name and shape load, the rest are listed.
TEST(HfImport, NonStrictLoadsWhatMatchesAndListsTheRest) {
  const std::string dir = tessera::testing::fresh_dir("hf-nonstrict");
  python("write " + dir + "/src " + kSmallPy + " --shards 2 --drop lm_head.weight --extra model.rotary.inv_freq");
  const std::string run = dir + "/run";
  fs::create_directories(run);
  auto fit = run_tessera("fit --config " + write_config(run, kSmall) + " --set launch.devices=2 --set strategy.plugin=fsdp" +
                         " --set trainer.init_from=" + dir + "/src --set trainer.init_from_strict=false");
  ASSERT_EQ(fit.exit_code, 0) << fit.output;
  EXPECT_NE(fit.output.find("11 of the model's 12 tensors loaded"), std::string::npos) << fit.output;
  EXPECT_NE(fit.output.find("lm_head.weight (not in the file)"), std::string::npos) << fit.output;
  EXPECT_NE(fit.output.find("not used from the file: model.rotary.inv_freq"), std::string::npos) << fit.output;
}

TEST(HfExport, RefusesWhatItCannotWrite) {
  const std::string dir = tessera::testing::fresh_dir("hf-export-refuse");
  // A model without Hugging Face names (gpt): refused by name, nothing written.
  std::ofstream(dir + "/gpt.toml") << "[trainer]\nmax_steps = 1\ndefault_root_dir = \"" << dir
                                   << "/gpt\"\nenable_progress_bar = false\ncheckpoint_every_n_steps = 1\n"
                                   << "num_sanity_val_steps = 0\n[model]\nplugin = \"gpt\"\nn_layer = 1\nn_head = 2\n"
                                   << "n_embd = 16\nblock_size = 16\n[data]\nplugin = \"text\"\nblock_size = 16\n"
                                   << "batch_size = 2\n";
  auto fit = run_tessera("fit --config " + dir + "/gpt.toml");
  ASSERT_EQ(fit.exit_code, 0) << fit.output;
  auto r = run_tessera("checkpoint export " + run_dir(dir + "/gpt") + " --to " + dir + "/out --format hf");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("model 'gpt'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("does not implement sdk::HuggingFaceModel"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir + "/out"));
  // Options that would be ignored, unknown values: usage errors (exit 2).
  const std::string ckpt = run_dir(dir + "/gpt") + "/checkpoints/last";
  for (const std::string& args : {" --to " + dir + "/x --format onnx", " --to " + dir + "/x --dtype bf16",
                                  " --to " + dir + "/x --format hf --dtype int8",
                                  " --to " + dir + "/x --format hf --max-shard-size lots"}) {
    auto u = run_tessera("checkpoint export " + ckpt + args);
    EXPECT_EQ(u.exit_code, 2) << args << "\n" << u.output;
  }
  auto inspect = run_tessera("checkpoint inspect " + ckpt + " --format hf");
  EXPECT_EQ(inspect.exit_code, 2) << inspect.output;
}

}  // namespace
