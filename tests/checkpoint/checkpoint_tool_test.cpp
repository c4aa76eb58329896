// `tessera checkpoint inspect|verify|export` on a sharded checkpoint written by a 2-rank FSDP
// run, and Python (python3-torch, an independent 20-line safetensors reader) checking that the
// exported safetensors file and the exported full .ckpt hold Tessera's own state dict.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "multiprocess.hpp"
#include "tessera/core/checkpoint.hpp"
#include "tessera/core/sharded_checkpoint.hpp"

namespace {

namespace fs = std::filesystem;
namespace core = tessera::core;
namespace sdk = tessera::sdk;
using tessera::testing::run_tessera;

TEST(CheckpointTool, InspectVerifyAndExportASharded2RankCheckpoint) {
  const std::string dir = tessera::testing::fresh_dir("ckpt-tool");
  std::ofstream(dir + "/run.toml") << "[trainer]\nmax_steps = 2\nseed = 3\ndefault_root_dir = \"" << dir
                                   << "\"\nenable_progress_bar = false\ncheckpoint_every_n_steps = 2\n"
                                   << "[optimizer]\nname = \"adamw\"\nlr = 0.003\n"
                                   << "[launch]\ndevices = 2\n"
                                   << "[strategy]\nplugin = \"fsdp\"\nstate_dict_type = \"sharded\"\n"
                                   << "[checkpoint_io]\nplugin = \"distributed\"\n"
                                   << "[model]\nplugin = \"gpt\"\nn_layer = 2\nn_head = 2\nn_embd = 32\nblock_size = 32\n"
                                   << "[data]\nplugin = \"text\"\nblock_size = 32\nbatch_size = 2\n";
  auto fit = run_tessera("fit --config " + dir + "/run.toml");
  ASSERT_EQ(fit.exit_code, 0) << fit.output;
  const std::string ckpt = tessera::testing::run_dir(dir) + "/checkpoints/step=2.ckpt";
  ASSERT_TRUE(core::is_sharded_checkpoint(ckpt)) << fit.output;

  auto inspect = run_tessera("checkpoint inspect " + tessera::testing::run_dir(dir) + "/checkpoints/last");
  EXPECT_EQ(inspect.exit_code, 0) << inspect.output;
  for (const char* text : {"sharded checkpoint", "world size 2", "state_dict/wte.weight  F32 [256, 32]  2 piece(s)",
                           "optimizer/wte.weight/exp_avg", "\"global_step\":2"})
    EXPECT_NE(inspect.output.find(text), std::string::npos) << text << "\n" << inspect.output;
  auto verify = run_tessera("checkpoint verify " + ckpt);
  EXPECT_EQ(verify.exit_code, 0) << verify.output;

  // Exports, and Tessera's own state dict (every tensor whole) for Python to compare them with.
  std::map<std::string, core::TensorPiece> whole;
  for (const auto& [name, t] : core::read_manifest(ckpt).tensors)
    if (name.rfind("state_dict/", 0) == 0) whole.emplace(name.substr(11), core::TensorPiece::whole(t.global_shape));
  sdk::Checkpoint own = core::load_sharded(ckpt, whole, 0);
  core::save_pickle(own, dir + "/own.pt");
  for (const char* to : {"/model.safetensors", "/model.ckpt"}) {
    auto r = run_tessera("checkpoint export " + ckpt + " --to " + dir + to);
    EXPECT_EQ(r.exit_code, 0) << r.output;
  }
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "SKIPPED (the Python half): python3-torch is not installed";
  } else {
    const std::string script = dir + "/check.py";
    std::ofstream(script) << "import sys, torch\n"
                             "sys.path.insert(0, '" TESSERA_CHECKPOINT_TEST_DIR "')\n"
                             "sys.path.insert(0, '" TESSERA_TEST_SUPPORT_DIR "')\n"
                             "from read_safetensors import load\n"
                             "from safe_torch_load import load as torch_load\n"
                             "own = torch_load(sys.argv[1] + '/own.pt')['state_dict']\n"
                             "st, meta = load(sys.argv[1] + '/model.safetensors')\n"
                             "full = torch_load(sys.argv[1] + '/model.ckpt')\n"
                             "assert sorted(st) == sorted(own) == sorted(full['state_dict']), (sorted(st), sorted(own))\n"
                             "for k in own:\n"
                             "    assert torch.equal(st[k], own[k]) and torch.equal(full['state_dict'][k], own[k]), k\n"
                             "assert full['global_step'] == 2\n"
                             "names = full['optimizer_states'][0]['param_names']\n"
                             "assert names == [k for k in full['state_dict'] if k in names], names\n"
                             "print('ok', len(own))\n";
    const std::string out = dir + "/py.txt";
    EXPECT_EQ(std::system(("/usr/bin/python3 " + script + " " + dir + " > " + out + " 2>&1").c_str()), 0);
    std::ifstream in(out);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(text.rfind("ok ", 0), 0u) << text;
  }

  // A damaged file: verify exits 1 naming it; so does a load.
  const fs::path rank1 = fs::path(ckpt) / "rank-1-of-2.safetensors";
  std::string bytes;
  {
    std::ifstream in(rank1, std::ios::binary);
    bytes.assign((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  bytes[bytes.size() / 2] ^= 0x01;
  std::ofstream(rank1, std::ios::binary) << bytes;
  verify = run_tessera("checkpoint verify " + ckpt);
  EXPECT_EQ(verify.exit_code, 1) << verify.output;
  EXPECT_NE(verify.output.find(rank1.string() + ": checksum mismatch"), std::string::npos) << verify.output;
  auto resume = run_tessera("fit --config " + dir + "/run.toml --ckpt-path " + ckpt + " --set trainer.max_steps=3");
  EXPECT_NE(resume.exit_code, 0);
  // The rank whose pieces lie in the damaged block says so (in its log; the launcher may name
  // the other rank, which then fails in a collective, as the first to fail).
  std::string logs = resume.output;
  for (const char* log : {"/logs/rank-0.log", "/logs/rank-1.log"}) {
    std::ifstream in(tessera::testing::run_dir(dir) + log);
    logs.append((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  EXPECT_NE(logs.find(rank1.string() + ": checksum mismatch"), std::string::npos) << logs;
}

// fsdp's state_dict_type = "local" keeps flat shards and no model tensors: export refuses it
// naming what to do (it failed with "map::at", or wrote an empty .safetensors), and writes nothing.
TEST(CheckpointTool, ExportRefusesRankLocalState) {
  const std::string dir = tessera::testing::fresh_dir("ckpt-tool-local");
  std::ofstream(dir + "/run.toml") << "[trainer]\nmax_steps = 1\ndefault_root_dir = \"" << dir
                                   << "\"\nenable_progress_bar = false\n[launch]\ndevices = 2\n"
                                   << "[strategy]\nplugin = \"fsdp\"\nstate_dict_type = \"local\"\n"
                                   << "[checkpoint_io]\nplugin = \"distributed\"\n"
                                   << "[model]\nplugin = \"mlp\"\nhidden_sizes = [8]\n"
                                   << "[data]\nplugin = \"fashion_mnist\"\ntrain_limit = 64\nval_size = 16\nbatch_size = 4\n";
  auto fit = run_tessera("fit --config " + dir + "/run.toml");
  ASSERT_EQ(fit.exit_code, 0) << fit.output;
  for (const char* to : {"/model.safetensors", "/model.ckpt"}) {
    auto r = run_tessera("checkpoint export " + tessera::testing::run_dir(dir) + "/checkpoints/last --to " + dir + to);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("holds rank-local state (fsdp state_dict_type = \"local\""), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("state_dict_type = \"sharded\" or \"full\""), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(dir + to)) << to;
  }
}

}  // namespace
