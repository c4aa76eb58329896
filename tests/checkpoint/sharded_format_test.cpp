// The sharded checkpoint format (safetensors per rank + manifest) through the `distributed`
// IO: round trips re-cut to other layouts, read by byte ranges; the commit protocol, `last`,
// the sweep and keep_last_k; and every damaged or mismatched input giving its own error.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <ATen/ATen.h>

#include "multiprocess.hpp"
#include "pieces_fixture.hpp"
#include "tessera/core/checkpoint_folder.hpp"
#include "plugin_loader.hpp"
#include "tessera/core/sharded_checkpoint.hpp"
#include "tessera/sdk/checkpoint_io.hpp"
#include "tessera/sdk/toml_options.hpp"

namespace {

namespace fs = std::filesystem;
using namespace tessera::testing;

void write_file(const fs::path& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

class ShardedFormat : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("tessera-sharded-" + std::to_string(::getpid()) + "-" +
                                             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    tessera::testing::remove_dir(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { tessera::testing::remove_dir(dir_); }

  std::shared_ptr<sdk::CheckpointIO> io(std::int64_t keep_last_k = 0, bool async = false) {
    toml::table table;
    if (keep_last_k > 0) table.insert("keep_last_k", keep_last_k);
    if (async) table.insert("async", true);
    return loader_.create_as<sdk::CheckpointIO>(sdk::PluginKind::checkpoint_io, "distributed",
                                                sdk::make_options("checkpoint_io", "test.toml", table));
  }
  /// A sharded save of `model` by `world` ranks in `layout`, committed by rank 0.
  std::string save(sdk::CheckpointIO& io, const std::string& name, const Model& model, std::int64_t world,
                   const std::function<std::map<std::string, TensorPiece>(std::int64_t, std::int64_t)>& layout,
                   std::int64_t step = 6, const std::string& save_id = "") {
    const std::string path = (dir_ / name).string(), id = save_id.empty() ? core::new_save_id() : save_id;
    for (std::int64_t r = 0; r < world; ++r) {
      sdk::Checkpoint shard = make_shard(model, layout(r, world), false, step);
      shard.insert("save_id", id);
      shard.insert("rng_state", at::full({4}, static_cast<std::uint8_t>(r), at::kByte));  // each rank its own
      io.save_checkpoint(shard, path, sdk::ShardInfo{r, world, true});
    }
    io.finalize_checkpoint(path, sdk::ShardInfo{0, world, true});
    return path;
  }
  static std::function<std::map<std::string, TensorPiece>(std::int64_t, std::int64_t)> flat(const Model& m) {
    return [&m](std::int64_t r, std::int64_t n) { return flat_layout(m, r, n); };
  }

  fs::path dir_;
  core::PluginLoader loader_{{tessera::testing::plugin_dir()}};
  Model model_;
};

TEST_F(ShardedFormat, SafetensorsRoundTripAndPythonReadsThem) {
  const std::string path = (dir_ / "t.safetensors").string();
  std::vector<std::pair<std::string, at::Tensor>> tensors{
      {"state_dict/w", at::arange(12, at::kFloat).view({3, 4})},
      {"h", at::linspace(-1, 1, 5).to(at::kBFloat16)},
      {"n", at::scalar_tensor(7, at::kLong)},
      {"strided", at::arange(6, at::kDouble).view({2, 3}).t()}};
  core::FileDigest digest = core::write_safetensors(path, tensors, {{"save_id", "abc"}});
  EXPECT_EQ(digest.size, static_cast<std::int64_t>(fs::file_size(path)));
  EXPECT_EQ(core::digest_file(path).xxh64, digest.xxh64);
  core::SafetensorsReader reader(path, &digest);
  EXPECT_EQ(reader.metadata().at("save_id"), "abc");
  for (const auto& [name, t] : tensors) EXPECT_TRUE(at::equal(reader.read(name), t.contiguous())) << name;
  EXPECT_TRUE(at::equal(reader.read_elements("state_dict/w", 5, 4), at::arange(5, 9, at::kFloat)));

  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "SKIPPED (the Python half): python3-torch is not installed";
  // An independent reader (tests/checkpoint/read_safetensors.py): json and the raw bytes.
  const std::string script = (dir_ / "read.py").string();
  std::ofstream(script) << R"(import sys, torch
sys.path.insert(0, ")" TESSERA_CHECKPOINT_TEST_DIR R"(")
from read_safetensors import load
t, meta = load(sys.argv[1])
assert meta["save_id"] == "abc"
assert torch.equal(t["state_dict/w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
assert torch.equal(t["h"], torch.linspace(-1, 1, 5).to(torch.bfloat16))
assert t["n"].item() == 7 and t["n"].shape == ()
assert torch.equal(t["strided"], torch.arange(6, dtype=torch.float64).reshape(2, 3).t())
print("ok")
)";
  const std::string out = (dir_ / "out.txt").string();
  EXPECT_EQ(std::system(("/usr/bin/python3 " + script + " " + path + " > " + out + " 2>&1").c_str()), 0)
      << read_file(out);
  EXPECT_EQ(read_file(out), "ok\n");
}

TEST_F(ShardedFormat, CommittedFolderHoldsOnlyEachRanksPiecesAndReshards) {
  auto dist = io();
  const std::string path = save(*dist, "step=6.ckpt", model_, 2, flat(model_));
  EXPECT_EQ(files_in(path), (std::vector<std::string>{"manifest.json", "rank-0-of-2.safetensors",
                                                      "rank-1-of-2.safetensors"}));
  EXPECT_EQ(files_in(dir_), (std::vector<std::string>{"last", "step=6.ckpt"}));  // nothing temporary left
  EXPECT_EQ(core::resolve_last(dir_.string()), path);
  core::Manifest m = core::read_manifest(path);
  EXPECT_EQ(m.world_size, 2);
  EXPECT_EQ(m.format_version, core::kShardedFormatVersion);
  EXPECT_EQ(m.tensors.at("state_dict/w").global_shape, (std::vector<std::int64_t>{4, 6}));
  ASSERT_EQ(m.tensors.at("optimizer/w/exp_avg").pieces.size(), 2u);
  EXPECT_EQ(m.tensors.at("optimizer/w/exp_avg").pieces[1].piece, TensorPiece::flat_range({4, 6}, 12, 12));
  EXPECT_NE(m.trainer_state.find("\"global_step\":6"), std::string::npos) << m.trainer_state;
  // Each file holds its rank's pieces only: 12 of w's 24 floats.
  core::SafetensorsReader rank1((fs::path(path) / "rank-1-of-2.safetensors").string());
  EXPECT_EQ(rank1.entry("state_dict/w").shape, (std::vector<std::int64_t>{12}));
  EXPECT_TRUE(dist->read_metadata(path).sharded);

  for (std::int64_t to : {1, 3})
    for (std::int64_t r = 0; r < to; ++r) {
      auto wanted = box_layout(model_, r, to, /*columns=*/true);
      sdk::Checkpoint out = core::load_sharded(path, wanted, r);
      sdk::StateDict state = core::state_dict_from(out.at("state_dict"), "out");
      for (const auto& [name, piece] : wanted)
        EXPECT_TRUE(at::equal(state[name], cut(model_.params.at(name), piece).view(piece.local_shape()))) << name;
      sdk::Checkpoint opt = out.at("optimizer_states").toListRef()[0].toGenericDict();
      auto moments = opt.at("state").toGenericDict().at(0).toGenericDict();  // "w"
      EXPECT_TRUE(at::equal(moments.at("exp_avg_sq").toTensor(),
                            cut(model_.moment("w", 2), wanted.at("w")).view(wanted.at("w").local_shape())));
      EXPECT_EQ(moments.at("step").toTensor().item<double>(), 3.0);
      // Per-rank entries: this rank's own where the save had it.
      EXPECT_EQ(out.at("rng_state").toTensor()[0].item<int>(), r < 2 ? r : 0);
      EXPECT_EQ(out.at("global_step").toInt(), 6);
    }
  // The pieces as saved, for a same-layout load; and the whole model through the generic reader.
  sdk::Checkpoint shard1 = dist->load_checkpoint(path, sdk::ShardInfo{1, 2, true});
  EXPECT_EQ(core::pieces_from_ivalue(shard1.at(core::kTensorPiecesKey), "p").at("w"),
            TensorPiece::flat_range({4, 6}, 12, 12));
  sdk::Checkpoint full = core::read_resharded_checkpoint(*dist, path, 2, model_.whole());
  EXPECT_TRUE(at::equal(core::state_dict_from(full.at("state_dict"), "s")["w"], model_.params.at("w")));
}

// `plugin` chooses how saves are written: a run that moves from sharded saves to full ones
// resumes from its sharded checkpoints through the `torch` IO.
TEST_F(ShardedFormat, TheTorchIOReadsWhatTheDistributedIOSaved) {
  const std::string path = save(*io(), "step=6.ckpt", model_, 2, flat(model_));
  auto torch_io = loader_.create_as<sdk::CheckpointIO>(sdk::PluginKind::checkpoint_io, "torch", sdk::Options());
  sdk::CheckpointMetadata meta = torch_io->read_metadata(path);
  EXPECT_TRUE(meta.sharded);
  EXPECT_EQ(meta.world_size, 2);
  EXPECT_EQ(meta.format, core::kShardedFormatName);
  sdk::Checkpoint full = core::read_resharded_checkpoint(*torch_io, path, 2, model_.whole());
  EXPECT_TRUE(at::equal(core::state_dict_from(full.at("state_dict"), "s")["w"], model_.params.at("w")));
  EXPECT_EQ(full.at("global_step").toInt(), 6);
}

TEST_F(ShardedFormat, ACrashedRankLeavesThePreviousCheckpointAndNoTemporaries) {
  auto dist = io();
  const std::string path = save(*dist, "last.ckpt", model_, 2, flat(model_), 2);
  // A 3-rank save where rank 2 died before writing: the commit refuses, the old one stays.
  const std::string id = core::new_save_id();
  for (std::int64_t r = 0; r < 2; ++r) {
    sdk::Checkpoint shard = make_shard(model_, flat_layout(model_, r, 3), false, 9);
    shard.insert("save_id", id);
    dist->save_checkpoint(shard, path, sdk::ShardInfo{r, 3, true});
  }
  std::string message = error_of([&] { dist->finalize_checkpoint(path, sdk::ShardInfo{0, 3, true}); });
  EXPECT_NE(message.find("rank 2 of 3 did not finish writing its part; the previous checkpoint is kept"),
            std::string::npos) << message;
  EXPECT_EQ(files_in(dir_), (std::vector<std::string>{"last", "last.ckpt"}));
  EXPECT_EQ(core::load_sharded(path, model_.whole(), 0).at("global_step").toInt(), 2);

  // A save killed before its commit leaves a hidden folder: never loaded, swept by the next
  // process's first save, and the replacement of an existing checkpoint is one exchange.
  fs::create_directories(dir_ / ".step=9.ckpt.tmp-dead");
  write_file(dir_ / ".step=9.ckpt.tmp-dead" / "rank-0-of-2.safetensors", "partial");
  write_file(dir_ / ".old.ckpt.tmp-123-0", "partial");
  auto fresh = io();
  save(*fresh, "last.ckpt", model_, 2, flat(model_), 12);
  EXPECT_EQ(files_in(dir_), (std::vector<std::string>{"last", "last.ckpt"}));
  EXPECT_EQ(core::load_sharded(path, model_.whole(), 0).at("global_step").toInt(), 12);
}

TEST_F(ShardedFormat, LastPointsAtTheNewestCommitAndKeepLastKPrunesOnlyCommitted) {
  auto dist = io(/*keep_last_k=*/2);
  for (int step : {1, 2, 3}) save(*dist, "step=" + std::to_string(step) + ".ckpt", model_, 2, flat(model_), step);
  fs::create_directories(dir_ / "notes");  // not a checkpoint: never counted or pruned
  EXPECT_EQ(files_in(dir_), (std::vector<std::string>{"last", "notes", "step=2.ckpt", "step=3.ckpt"}));
  EXPECT_EQ(core::resolve_last(dir_.string()), (dir_ / "step=3.ckpt").string());
  // A full checkpoint commits through the same protocol and becomes `last`.
  sdk::Checkpoint full = make_shard(model_, model_.whole(), false, 4);
  dist->save_checkpoint(full, (dir_ / "step=4.ckpt").string(), sdk::ShardInfo{});
  dist->finalize_checkpoint((dir_ / "step=4.ckpt").string(), sdk::ShardInfo{});
  EXPECT_EQ(core::resolve_last(dir_.string()), (dir_ / "step=4.ckpt").string());
  EXPECT_EQ(files_in(dir_), (std::vector<std::string>{"last", "notes", "step=3.ckpt", "step=4.ckpt"}));
  tessera::testing::remove_dir(dir_ / "step=4.ckpt");
  EXPECT_NE(error_of([&] { core::resolve_last(dir_.string()); }).find("which is not a committed checkpoint"),
            std::string::npos);
}

// remove_tree (what prunes and replaces checkpoints): a folder goes with what it holds, a link
// in it goes without what it points at, a file goes, a missing path is no error.
TEST_F(ShardedFormat, RemoveTreeRemovesFoldersAndLinksNotWhatLinksPointAt) {
  const fs::path outside = dir_ / "outside.bin", tree = dir_ / "step=4.ckpt";
  write_file(outside, "kept");
  fs::create_directories(tree / "nested" / "deeper");
  write_file(tree / "rank-0.safetensors", "data");
  write_file(tree / "nested" / "deeper" / "file", "data");
  fs::create_symlink(outside, tree / "nested" / "link");
  fs::create_directory_symlink(dir_, tree / "folder-link");
  std::error_code ec;
  tessera::core::remove_tree(tree.string(), ec);
  EXPECT_FALSE(ec) << ec.message();
  EXPECT_FALSE(fs::exists(fs::symlink_status(tree)));
  EXPECT_EQ(read_file(outside), "kept");
  tessera::core::remove_tree(outside.string(), ec);
  EXPECT_FALSE(ec) << ec.message();
  EXPECT_FALSE(fs::exists(outside));
  tessera::core::remove_tree((dir_ / "missing").string(), ec);
  EXPECT_FALSE(ec) << ec.message();
}

TEST_F(ShardedFormat, AsyncSavesCommitInTheBackgroundAndKeepTheNewestK) {
  auto dist = io(/*keep_last_k=*/1, /*async=*/true);
  for (int step : {1, 2}) save(*dist, "step=" + std::to_string(step) + ".ckpt", model_, 2, flat(model_), step);
  // Reading waits for the commit in flight.
  EXPECT_EQ(dist->read_metadata((dir_ / "step=2.ckpt").string()).world_size, 2);
  EXPECT_EQ(files_in(dir_), (std::vector<std::string>{"last", "step=2.ckpt"}));
  EXPECT_EQ(core::load_sharded((dir_ / "step=2.ckpt").string(), model_.whole(), 0).at("global_step").toInt(), 2);
}

// A full disk, as a file size limit (EFBIG rather than ENOSPC, the same code path), in a fresh
// process of its own.
TEST_F(ShardedFormat, AFailedWriteNamesThePathKeepsThePreviousCheckpointAndLeavesNoTemporaries) {
  const fs::path dir = dir_;
  tessera::testing::run_ranks(1, std::chrono::seconds(120), [&](const sdk::ClusterInfo&) {
    auto dist = io();
    const std::string path = save(*dist, "a.ckpt", model_, 2, flat(model_), 2);
    ::signal(SIGXFSZ, SIG_IGN);
    rlimit limit{512, 512};
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limit), 0);
    std::string message = error_of([&] { save(*dist, "a.ckpt", model_, 2, flat(model_), 3); });
    EXPECT_NE(message.find("cannot write " + dir.string() + "/.a.ckpt.tmp-"), std::string::npos) << message;
    EXPECT_NE(message.find("File too large"), std::string::npos) << message;
    EXPECT_EQ(files_in(dir), (std::vector<std::string>{"a.ckpt", "last"}));
    EXPECT_EQ(core::load_sharded(path, model_.whole(), 0).at("global_step").toInt(), 2);
  });
}

TEST_F(ShardedFormat, DamagedMismatchedAndForeignInputsEachGiveTheirError) {
  auto dist = io();
  const std::string path = save(*dist, "a.ckpt", model_, 2, flat(model_));
  const fs::path rank1 = fs::path(path) / "rank-1-of-2.safetensors";
  const std::string good = read_file(rank1);

  // A flipped byte inside a tensor: the block's checksum, naming the file.
  std::string flipped = good;
  flipped[flipped.size() - 5] ^= 0x40;
  write_file(rank1, flipped);
  std::string message = error_of([&] { core::load_sharded(path, model_.whole(), 0); });
  EXPECT_NE(message.find(rank1.string() + ": checksum mismatch in bytes"), std::string::npos) << message;
  message = error_of([&] { core::verify_sharded(path); });
  EXPECT_NE(message.find(rank1.string() + ": checksum mismatch"), std::string::npos) << message;
  // Truncated.
  write_file(rank1, good.substr(0, good.size() - 10));
  message = error_of([&] { core::load_sharded(path, model_.whole(), 0); });
  EXPECT_NE(message.find("has " + std::to_string(good.size() - 10) + " bytes but the manifest says"),
            std::string::npos) << message;
  // Missing.
  fs::remove(rank1);
  message = error_of([&] { core::load_sharded(path, model_.whole(), 0); });
  EXPECT_NE(message.find("is missing its file rank-1-of-2.safetensors"), std::string::npos) << message;
  // From another save of the same layout (same size): the save id.
  const std::string other = save(*dist, "b.ckpt", model_, 2, flat(model_));
  fs::copy_file(fs::path(other) / "rank-1-of-2.safetensors", rank1);
  message = error_of([&] { core::load_sharded(path, model_.whole(), 0); });
  EXPECT_NE(message.find("belongs to another save"), std::string::npos) << message;
  write_file(rank1, good);
  EXPECT_NO_THROW(core::verify_sharded(path));

  // Another model shape: refused from the manifest, before any file is opened.
  fs::rename(rank1, fs::path(path) / "aside");
  Model smaller;
  smaller.params["w"] = at::zeros({2, 6});
  message = error_of([&] { core::load_sharded(path, smaller.whole(), 0); });
  EXPECT_NE(message.find("'w' is [4, 6] in the checkpoint but [2, 6] in the model"), std::string::npos) << message;
  fs::rename(fs::path(path) / "aside", rank1);

  // A manifest of a newer format version.
  const fs::path manifest = fs::path(path) / core::kManifestName;
  std::string text = read_file(manifest);
  const std::string key = "\"format_version\": 1";
  ASSERT_NE(text.find(key), std::string::npos) << text.substr(0, 300);
  write_file(manifest, std::string(text).replace(text.find(key), key.size(), "\"format_version\": 7"));
  message = error_of([&] { dist->read_metadata(path); });
  EXPECT_NE(message.find("is format version 7"), std::string::npos) << message;
  EXPECT_NE(message.find("load it with a newer tessera"), std::string::npos) << message;
  // No manifest: not a committed checkpoint.
  fs::remove(manifest);
  message = error_of([&] { dist->read_metadata(path); });
  EXPECT_NE(message.find("is not a committed checkpoint"), std::string::npos) << message;
}

}  // namespace
