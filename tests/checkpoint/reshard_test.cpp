// core::read_resharded_checkpoint: sharded checkpoints of any layout (flat ranges in the
// legacy fsdp format, boxes in tensor_pieces) re-cut to other pieces or to whole tensors,
// optimizer state included, bitwise; and the checks made before any tensor is copied.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>

#include <ATen/ATen.h>

#include "multiprocess.hpp"
#include "pieces_fixture.hpp"
#include "tessera/core/checkpoint.hpp"
#include "plugin_loader.hpp"
#include "tessera/sdk/checkpoint_io.hpp"
#include "tessera/sdk/error.hpp"

namespace {

namespace fs = std::filesystem;
using namespace tessera::testing;

/// Shards kept in memory; counts reads, so tests can tell what was read before an error.
class MemoryIO final : public sdk::CheckpointIO {
 public:
  std::vector<sdk::Checkpoint> shards;
  int reads = 0;
  void save_checkpoint(const sdk::Checkpoint&, const std::string&, const sdk::ShardInfo&) override {}
  void finalize_checkpoint(const std::string&, const sdk::ShardInfo&) override {}
  sdk::Checkpoint load_checkpoint(const std::string&, const sdk::ShardInfo& shard) override {
    ++reads;
    return shards.at(static_cast<std::size_t>(shard.rank));
  }
  sdk::CheckpointMetadata read_metadata(const std::string&) override {
    return {true, static_cast<std::int64_t>(shards.size()), "memory"};
  }
  void remove_checkpoint(const std::string&) override {}
};

void expect_recut(const sdk::Checkpoint& out, const Model& model, const std::map<std::string, TensorPiece>& wanted) {
  EXPECT_EQ(out.at("global_step").toInt(), 6);
  EXPECT_FALSE(out.contains(core::kTensorPiecesKey) || out.contains(core::kLegacyShardMetadataKey));
  sdk::StateDict state = core::state_dict_from(out.at("state_dict"), "out");
  ASSERT_EQ(state.size(), wanted.size());
  for (const auto& [name, piece] : wanted) {
    ASSERT_TRUE(state.contains(name)) << name;
    EXPECT_TRUE(at::equal(state[name], cut(model.params.at(name), piece).view(piece.local_shape())))
        << name << " wanted " << piece.to_string();
  }
  sdk::Checkpoint opt = out.at("optimizer_states").toListRef()[0].toGenericDict();
  auto opt_state = opt.at("state").toGenericDict();
  for (std::size_t i = 0; i < model.optimized.size(); ++i) {
    const std::string& name = model.optimized[i];
    sdk::Checkpoint entry = opt_state.at(static_cast<std::int64_t>(i)).toGenericDict();
    EXPECT_EQ(entry.at("step").toTensor().item<double>(), 3.0);
    for (int k : {1, 2})
      EXPECT_TRUE(at::equal(entry.at(k == 1 ? "exp_avg" : "exp_avg_sq").toTensor(),
                            cut(model.moment(name, k), wanted.at(name)).view(wanted.at(name).local_shape())))
          << name << " moment " << k;
  }
  EXPECT_EQ(opt.at("param_names").toListRef()[1].toStringRef(), "b");
}

TEST(Reshard, AnyLayoutToAnyLayoutBitwiseWithOptimizerState) {
  Model model;
  struct Source {
    const char* what;
    bool legacy;
    std::function<std::map<std::string, TensorPiece>(std::int64_t, std::int64_t)> layout;
  };
  std::vector<Source> sources{
      {"legacy flat", true, [&](std::int64_t r, std::int64_t n) { return flat_layout(model, r, n); }},
      {"flat", false, [&](std::int64_t r, std::int64_t n) { return flat_layout(model, r, n); }},
      {"dim-0 boxes", false, [&](std::int64_t r, std::int64_t n) { return box_layout(model, r, n, false); }},
      {"column boxes", false, [&](std::int64_t r, std::int64_t n) { return box_layout(model, r, n, true); }}};
  for (const Source& source : sources)
    for (std::int64_t from : {1, 2, 4}) {
      MemoryIO io;
      for (std::int64_t r = 0; r < from; ++r) io.shards.push_back(make_shard(model, source.layout(r, from), source.legacy, 6));
      SCOPED_TRACE(std::string(source.what) + " from " + std::to_string(from) + " shards");
      expect_recut(core::read_resharded_checkpoint(io, "mem", from, model.whole()), model, model.whole());
      for (std::int64_t to : {1, 2, 3})
        for (std::int64_t r = 0; r < to; ++r) {
          expect_recut(core::read_resharded_checkpoint(io, "mem", from, flat_layout(model, r, to)), model,
                       flat_layout(model, r, to));
          expect_recut(core::read_resharded_checkpoint(io, "mem", from, box_layout(model, r, to, true)), model,
                       box_layout(model, r, to, true));
        }
      EXPECT_EQ(io.reads, from * 13) << "each read goes through every shard once";
    }
}

TEST(Reshard, AnotherModelShapeIsRefusedBeforeTheOtherShardsAreRead) {
  Model saved;
  MemoryIO io;
  for (std::int64_t r = 0; r < 2; ++r) io.shards.push_back(make_shard(saved, flat_layout(saved, r, 2), true, 6));
  Model smaller;  // n_embd halved: the same names, other shapes
  smaller.params["w"] = at::zeros({2, 6});
  std::string message = error_of([&] { core::read_resharded_checkpoint(io, "ckpt/step=6", 2, smaller.whole()); });
  EXPECT_NE(message.find("sharded checkpoint ckpt/step=6 shard 0 does not match the model (it was written for a "
                         "different model configuration): 'w' is [4, 6] in the checkpoint but [2, 6] in the model"),
            std::string::npos)
      << message;
  EXPECT_EQ(io.reads, 1);

  Model fewer;  // n_layer 4 -> 2: tensors the model does not have
  fewer.params.erase("b");
  fewer.optimized = {"w"};
  message = error_of([&] { core::read_resharded_checkpoint(io, "p", 2, fewer.whole()); });
  EXPECT_NE(message.find("0 missing tensor(s) [], 1 unexpected tensor(s) [b]"), std::string::npos) << message;
  Model more;
  more.params["extra"] = at::zeros({3});
  message = error_of([&] { core::read_resharded_checkpoint(io, "p", 2, more.whole()); });
  EXPECT_NE(message.find("1 missing tensor(s) [extra], 0 unexpected tensor(s) []"), std::string::npos) << message;
}

TEST(Reshard, ShardsThatDoNotCoverTheWantedPiecesAreRefused) {
  Model model;
  MemoryIO io;
  // Shard 1 comes from a 3-way save: elements of the 2-way cut's second half are missing.
  io.shards.push_back(make_shard(model, flat_layout(model, 0, 2), false, 6));
  io.shards.push_back(make_shard(model, flat_layout(model, 2, 3), false, 6));
  std::string message = error_of([&] { core::read_resharded_checkpoint(io, "p", 2, model.whole()); });
  EXPECT_NE(message.find("sharded checkpoint p: the shards cover 4 of 5 wanted elements of 'b'; a shard file is "
                         "missing or from another save"),
            std::string::npos)
      << message;
  // What the first shard alone covers loads.
  EXPECT_NO_THROW(core::read_resharded_checkpoint(io, "p", 2, flat_layout(model, 0, 2)));

  sdk::Checkpoint bad = make_shard(model, flat_layout(model, 1, 2), false, 6);
  bad.insert_or_assign(core::kTensorPiecesKey, core::pieces_to_ivalue(flat_layout(model, 0, 3)));
  io.shards[1] = bad;
  message = error_of([&] { core::read_resharded_checkpoint(io, "p", 2, model.whole()); });
  EXPECT_NE(message.find("shard 1: tensor 'w' holds 12 elements but its piece flat [0, 8) of [4, 6] has 8"),
            std::string::npos) << message;
}

// A folder in the layout the `distributed` IO wrote before the manifest (metadata.json +
// shard-R-of-N.pt pickles, fsdp_shard_metadata) still loads through it, re-cut 2 -> 3.
TEST(Reshard, LegacyShardedFoldersOnDiskStillLoad) {
  const fs::path dir = fs::temp_directory_path() / ("tessera-reshard-" + std::to_string(::getpid()));
  tessera::testing::remove_dir(dir);
  core::PluginLoader loader{{tessera::testing::plugin_dir()}};
  auto io = loader.create_as<sdk::CheckpointIO>(sdk::PluginKind::checkpoint_io, "distributed", sdk::Options());
  Model model;
  const std::string path = (dir / "step=6").string();
  for (std::int64_t r = 0; r < 2; ++r)
    core::save_pickle(make_shard(model, flat_layout(model, r, 2), true, 6),
                      (fs::path(path) / ("shard-" + std::to_string(r) + "-of-2.pt")).string());
  std::ofstream(fs::path(path) / "metadata.json")
      << R"({"format": "tessera-sharded", "sharded": "true", "world_size": "2", "tessera_version": "0.1.0"})";
  EXPECT_EQ(io->read_metadata(path).world_size, 2);
  for (std::int64_t r = 0; r < 3; ++r)
    expect_recut(core::read_resharded_checkpoint(*io, path, 2, flat_layout(model, r, 3)), model,
                 flat_layout(model, r, 3));
  expect_recut(core::read_resharded_checkpoint(*io, path, 2, model.whole()), model, model.whole());
  tessera::testing::remove_dir(dir);
}

}  // namespace
