// Token shards (toolkit), `tessera data prepare` and the `tokens` data plugin: windows, splits and
// blends on corpora written here; the sampler's global batches at every world size; exact
// mid-epoch resume; prepare killed and rerun; memory flat in the corpus size; every bad input.
#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "errors.hpp"
#include "multiprocess.hpp"
#include "data/data_loader.hpp"
#include "plugin_loader.hpp"
#include "tessera/sdk/data.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/token_data.hpp"
#include "tessera/sdk/toml_options.hpp"
#include "tessera/toolkit/token_shards.hpp"

namespace {

namespace fs = std::filesystem;
namespace sdk = tessera::sdk;
namespace toolkit = tessera::toolkit;
using tessera::core::DataLoader;
using tessera::core::PluginLoader;
using tessera::testing::error_of;
using tessera::testing::metric_series;
using tessera::testing::run_command;
using tessera::testing::run_dir;
using tessera::testing::run_tessera;

#define EXPECT_MENTIONS(text, part) EXPECT_NE((text).find(part), std::string::npos) << "missing '" << (part) << "' in: " << (text)

PluginLoader& loader() {
  static PluginLoader instance({PLUGIN_DIR});
  return instance;
}

std::shared_ptr<sdk::DataModule> make_data(const std::string& toml_text) {
  sdk::Options options = sdk::make_options("data", "test.toml", toml::parse(toml_text));
  auto data = loader().create_as<sdk::DataModule>(sdk::PluginKind::data, "tokens", options);
  options.check_all_used();
  return data;
}

/// A fresh directory, removed at the end of the test.
class TempDir {
 public:
  explicit TempDir(const std::string& name = "") {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            ("tessera_tokens_" + std::string(info->name()) + name + "_" + std::to_string(::getpid()));
    tessera::testing::remove_dir(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { tessera::testing::remove_dir(path_); }
  const fs::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

 private:
  fs::path path_;
};

using Docs = std::vector<std::vector<toolkit::TokenId>>;

/// A prepared directory written directly (no tokenizer): shard k holds shards[k]'s documents.
void write_corpus(const fs::path& dir, const std::vector<Docs>& shards, std::int64_t vocab, toolkit::TokenId eos = 0) {
  fs::create_directories(dir);
  toolkit::TokenManifest m;
  m.tokenizer_name = "made-up";
  m.tokenizer_kind = "sentencepiece";
  m.vocab_size = vocab;
  m.dtype = toolkit::dtype_for(vocab);
  m.eos_id = eos;
  for (std::size_t k = 0; k < shards.size(); ++k) {
    std::vector<toolkit::TokenId> tokens;
    std::vector<std::uint64_t> offsets{0};
    for (const auto& doc : shards[k]) {
      tokens.insert(tokens.end(), doc.begin(), doc.end());
      offsets.push_back(tokens.size());
    }
    char name[32];
    std::snprintf(name, sizeof name, "shard_%05zu", k);
    m.shards.push_back(toolkit::write_shard(dir, name, m.dtype, tokens, offsets));
  }
  toolkit::write_manifest(dir, m);
}

Docs iota_docs(std::vector<int> lengths, int start) {
  Docs docs;
  for (int n : lengths) {
    docs.emplace_back(n);
    std::iota(docs.back().begin(), docs.back().end(), start);
    start += n;
  }
  return docs;
}

/// Random ids below `vocab`, `documents` documents of `length` tokens per shard.
void write_random_corpus(const fs::path& dir, int shards, int documents, int length, std::int64_t vocab) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> id(0, static_cast<int>(vocab) - 1);
  std::vector<Docs> all(shards);
  for (auto& docs : all)
    for (int d = 0; d < documents; ++d) {
      docs.emplace_back(length);
      for (auto& t : docs.back()) t = id(rng);
    }
  write_corpus(dir, all, vocab);
}

std::vector<std::int64_t> row(const at::Tensor& t, std::int64_t i) {
  at::Tensor r = t[i].contiguous();
  return std::vector<std::int64_t>(r.data_ptr<std::int64_t>(), r.data_ptr<std::int64_t>() + r.numel());
}

std::vector<std::int64_t> range(std::int64_t from, std::int64_t n) {
  std::vector<std::int64_t> out(n);
  std::iota(out.begin(), out.end(), from);
  return out;
}

// ---------------------------------------------------------------- shards and windows

TEST(TokenShards, WrittenShardsReadBackWithTheirManifest) {
  TempDir dir;
  write_corpus(dir.path(), {iota_docs({10, 10}, 0), iota_docs({10}, 20)}, 1000, 7);
  toolkit::TokenShards shards(dir.path(), /*verify=*/true);
  const auto& m = shards.manifest();
  EXPECT_EQ(m.vocab_size, 1000);
  EXPECT_EQ(m.dtype, toolkit::TokenDtype::uint16);
  EXPECT_EQ(m.eos_id, 7);
  ASSERT_EQ(shards.shards(), 2);
  EXPECT_EQ(m.total_tokens(), 30);
  EXPECT_EQ(m.total_documents(), 3);
  EXPECT_EQ(shards.document_start(0, 1), 10);
  EXPECT_EQ(shards.document_start(0, 2), 20);
  std::vector<std::int64_t> out(5);
  shards.read(1, 3, 5, out.data());
  EXPECT_EQ(out, range(23, 5));
  EXPECT_EQ(fs::file_size(dir.path() / "shard_00000.bin"), 40u);  // uint16
  EXPECT_EQ(toolkit::dtype_for(70000), toolkit::TokenDtype::uint32);
}

TEST(Tokens, PackedWindowsRunAcrossDocumentsAndShards) {
  TempDir dir;
  write_corpus(dir.path(), {iota_docs({10, 10}, 0), iota_docs({10}, 20)}, 1000);
  auto data = make_data("path = \"" + dir.str() + "\"\nblock_size = 4\nval_fraction = 0\n");
  data->setup("fit");
  auto train = data->train_dataset();
  ASSERT_EQ(train->size(), (30 - 1) / 4);
  EXPECT_NE(dynamic_cast<const sdk::LargeDataset*>(train.get()), nullptr);
  sdk::Batch b = train->get_batch({0, 4, 6});
  EXPECT_EQ(row(b.input, 0), range(0, 4));
  EXPECT_EQ(row(b.target, 0), range(1, 4));
  EXPECT_EQ(row(b.input, 1), range(16, 4));   // tokens 16..20: shard 0 into shard 1
  EXPECT_EQ(row(b.target, 1), range(17, 4));
  EXPECT_EQ(row(b.target, 2), range(25, 4));  // the last window ends at token 28
  EXPECT_EQ(data->val_dataset(), nullptr);
  auto* vocabulary = dynamic_cast<sdk::TokenVocabulary*>(data.get());
  ASSERT_NE(vocabulary, nullptr);
  EXPECT_EQ(vocabulary->vocab_size(), 1000);
  EXPECT_MENTIONS(vocabulary->vocab_source(), "manifest.json");
}

// The test split (issue 60 (e)): the last test_fraction of each shard's documents, after the
// validation ones; a separate directory with test_path. None of it trains or validates.
TEST(Tokens, TestSplitTakesTheDocumentsAfterTheValidationOnes) {
  TempDir dir;
  write_corpus(dir.path(), {iota_docs({10, 10, 10, 10}, 0)}, 1000);
  auto data = make_data("path = \"" + dir.str() + "\"\nblock_size = 4\nval_fraction = 0.25\ntest_fraction = 0.25\n");
  data->setup("test");
  ASSERT_EQ(data->train_dataset()->size(), (20 - 1) / 4);  // documents 0 and 1
  auto val = data->val_dataset(), test = data->test_dataset();
  ASSERT_NE(test, nullptr);
  ASSERT_NE(test, val);
  EXPECT_EQ(row(val->get_batch({0}).input, 0), range(20, 4));  // document 2
  EXPECT_EQ(test->size(), (10 - 1) / 4);                        // document 3
  EXPECT_EQ(row(test->get_batch({0}).input, 0), range(30, 4));
  EXPECT_EQ(row(test->get_batch({1}).target, 0), range(35, 4));

  TempDir held_out("test");
  write_corpus(held_out.path(), {iota_docs({9}, 100)}, 1000);
  auto separate = make_data("path = \"" + dir.str() + "\"\ntest_path = \"" + held_out.str() + "\"\nblock_size = 4\nval_fraction = 0\n");
  separate->setup("test");
  EXPECT_EQ(row(separate->test_dataset()->get_batch({1}).target, 0), range(105, 4));
  EXPECT_MENTIONS(error_of([&] {
                    make_data("path = \"" + dir.str() + "\"\ntest_path = \"" + held_out.str() + "\"\ntest_fraction = 0.1\n");
                  }),
                  "both choose the test data");
  EXPECT_MENTIONS(error_of([&] { make_data("path = \"" + dir.str() + "\"\nval_fraction = 0.5\ntest_fraction = 0.5\n"); }),
                  "leave no document to train on");
}

TEST(Tokens, ValidationTakesWholeDocumentsFromTheEndOfEachShard) {
  TempDir dir;
  write_corpus(dir.path(), {iota_docs({10, 10}, 0), iota_docs({10}, 20)}, 1000);
  auto data = make_data("path = \"" + dir.str() + "\"\nblock_size = 4\nval_fraction = 0.5\n");
  data->setup("fit");
  // Shard 0's second document validates; shard 1's only one (0.5 x 1 rounds down) trains.
  auto train = data->train_dataset();
  ASSERT_EQ(train->size(), (20 - 1) / 4);
  EXPECT_EQ(row(train->get_batch({2}).input, 0), (std::vector<std::int64_t>{8, 9, 20, 21}));
  auto val = data->val_dataset();
  ASSERT_NE(val, nullptr);
  ASSERT_EQ(val->size(), (10 - 1) / 4);
  EXPECT_EQ(row(val->get_batch({1}).input, 0), range(14, 4));
  EXPECT_EQ(data->test_dataset(), nullptr) << "no test split: `tessera test` never reports the validation split";
  EXPECT_MENTIONS(error_of([&] { data->setup("test"); }), "[data] test_fraction");

  TempDir held_out("val");
  write_corpus(held_out.path(), {iota_docs({9}, 100)}, 1000);
  auto separate = make_data("path = \"" + dir.str() + "\"\nval_path = \"" + held_out.str() + "\"\nblock_size = 4\n");
  separate->setup("fit");
  EXPECT_EQ(separate->train_dataset()->size(), (30 - 1) / 4);  // all of it trains
  EXPECT_EQ(row(separate->val_dataset()->get_batch({1}).target, 0), range(105, 4));
}

TEST(Tokens, DocumentAlignedWindowsStartAtDocumentsAndPadShortOnes) {
  TempDir dir;
  write_corpus(dir.path(), {iota_docs({3, 8}, 10)}, 1000, /*eos=*/5);
  auto data = make_data("path = \"" + dir.str() + "\"\nblock_size = 4\ndocument_aligned = true\nval_fraction = 0\n");
  data->setup("fit");
  auto train = data->train_dataset();
  ASSERT_EQ(train->size(), 2);
  sdk::Batch b = train->get_batch({0, 1});
  EXPECT_EQ(row(b.input, 0), (std::vector<std::int64_t>{10, 11, 5, 5}));
  EXPECT_EQ(row(b.target, 0), (std::vector<std::int64_t>{11, 12, -100, -100}));  // ignored by cross-entropy
  EXPECT_EQ(row(b.input, 1), range(13, 4));
  EXPECT_EQ(row(b.target, 1), range(14, 4));
}

TEST(Tokens, BlendDrawsFromEachDirectoryInProportionToItsWeight) {
  TempDir a("a"), b("b");
  write_corpus(a.path(), {iota_docs({41}, 0)}, 2000);     // 40 windows of 1 + 1
  write_corpus(b.path(), {iota_docs({41}, 1000)}, 2000);  // 40 windows
  auto data = make_data("path = [\"" + a.str() + "\", \"" + b.str() + "\"]\nweights = [3, 1]\nblock_size = 1\n" +
                        "val_fraction = 0\n");
  data->setup("fit");
  auto train = data->train_dataset();
  ASSERT_EQ(train->size(), 80);
  // [0, 60) from a (upsampled: index mod 40), [60, 80) from b.
  EXPECT_EQ(row(train->get_batch({59}).input, 0), (std::vector<std::int64_t>{19}));
  EXPECT_EQ(row(train->get_batch({60}).input, 0), (std::vector<std::int64_t>{1000}));
  EXPECT_EQ(row(train->get_batch({79}).input, 0), (std::vector<std::int64_t>{1019}));
  EXPECT_MENTIONS(error_of([&] { make_data("path = [\"" + a.str() + "\", \"" + b.str() + "\"]\n"); }), "weights");
}

// ---------------------------------------------------------------- the sampler

TEST(TokenSampler, FeistelShuffleIsABijectionForAnySize) {
  for (std::int64_t n : {1, 2, 3, 17, 1000, 4097}) {
    std::set<std::int64_t> seen;
    for (std::int64_t p = 0; p < n; ++p) seen.insert(tessera::core::feistel_permute(p, n, tessera::core::feistel_key(3, 1)));
    EXPECT_EQ(static_cast<std::int64_t>(seen.size()), n);
    EXPECT_EQ(*seen.rbegin(), n - 1);
  }
  // Another epoch, another order.
  std::vector<std::int64_t> e0, e1;
  for (std::int64_t p = 0; p < 50; ++p) {
    e0.push_back(tessera::core::feistel_permute(p, 1000, tessera::core::feistel_key(3, 0)));
    e1.push_back(tessera::core::feistel_permute(p, 1000, tessera::core::feistel_key(3, 1)));
  }
  EXPECT_NE(e0, e1);
}

// N ranks with batch B see together exactly the global batch of one device with batch N x B, for
// N = 1..4; the batches a loader hands out (read ahead on its thread) are the dataset's samples.
TEST(TokenSampler, RanksTogetherSeeOneDevicesGlobalBatchAtEveryWorldSize) {
  TempDir dir;
  write_random_corpus(dir.path(), 3, 20, 50, 500);
  auto data = make_data("path = \"" + dir.str() + "\"\nblock_size = 8\nval_fraction = 0\n");
  data->setup("fit");
  auto dataset = data->train_dataset();
  auto spec = [](std::int64_t batch, std::int64_t replicas, std::int64_t rank) {
    sdk::DataLoaderSpec s;
    s.batch_size = batch;
    s.shuffle = true;
    s.drop_last = true;
    s.seed = 11;
    s.num_replicas = replicas;
    s.rank = rank;
    return s;
  };
  DataLoader single(dataset, spec(12, 1, 0));
  single.set_epoch(2);
  EXPECT_EQ(std::set<std::int64_t>(single.indices().begin(), single.indices().end()).size(), single.indices().size());
  for (std::int64_t world : {1, 2, 3, 4}) {
    std::vector<std::unique_ptr<DataLoader>> ranks;
    for (std::int64_t r = 0; r < world; ++r) {
      ranks.push_back(std::make_unique<DataLoader>(dataset, spec(12 / world, world, r)));
      ranks.back()->set_epoch(2);
      ASSERT_EQ(ranks.back()->num_batches(), single.num_batches()) << world;
    }
    for (std::int64_t i : {0, 5, 6, 7, 3}) {  // in and out of order: the read-ahead is dropped when unused
      std::vector<std::int64_t> together, expected(single.indices().begin() + i * 12, single.indices().begin() + (i + 1) * 12);
      std::vector<at::Tensor> inputs;
      for (auto& loader : ranks) {
        sdk::Batch b = loader->batch(i);
        inputs.push_back(b.input);
        for (std::int64_t k = 0; k < 12 / world; ++k) together.push_back(loader->index(i * (12 / world) + k));
      }
      std::sort(together.begin(), together.end());
      std::sort(expected.begin(), expected.end());
      EXPECT_EQ(together, expected) << "world size " << world << ", batch " << i;
      // Rank r's row k is position r + world * k of the global batch.
      at::Tensor global = single.batch(i).input;
      for (std::int64_t r = 0; r < world; ++r)
        for (std::int64_t k = 0; k < 12 / world; ++k)
          EXPECT_TRUE(at::equal(inputs[r][k], global[r + world * k])) << world << " " << i << " " << r << " " << k;
    }
  }
}

// ---------------------------------------------------------------- bad input (plugin side)

TEST(Tokens, DamagedCorporaAreErrorsNamingTheFile) {
  TempDir dir;
  auto fresh = [&] {
    tessera::testing::remove_dir(dir.path() / "c");
    write_corpus(dir.path() / "c", {iota_docs({10, 10}, 0), iota_docs({10}, 20)}, 100);
    return dir.path() / "c";
  };
  auto setup_error = [&](const std::string& extra = "") {
    return error_of([&] { make_data("path = \"" + (dir.path() / "c").string() + "\"\nblock_size = 4\n" + extra)->setup("fit"); });
  };
  fs::path c = fresh();
  fs::remove(c / "shard_00001.bin");
  std::string e = setup_error();
  EXPECT_MENTIONS(e, "shard_00001.bin");
  EXPECT_MENTIONS(e, "missing");

  c = fresh();
  fs::resize_file(c / "shard_00000.bin", 30);
  e = setup_error();
  EXPECT_MENTIONS(e, "shard_00000.bin");
  EXPECT_MENTIONS(e, "truncated");

  c = fresh();
  {
    std::fstream f(c / "shard_00001.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4);
    f.put(3);  // still an id below the vocabulary: only the checksum tells
  }
  e = setup_error();
  EXPECT_MENTIONS(e, "shard_00001.bin");
  EXPECT_MENTIONS(e, "checksum");
  EXPECT_MENTIONS(setup_error("verify = false\nval_fraction = 0\n"), "<no sdk::Error thrown>");  // verify = false trusts it

  // An id at or above the manifest's vocab_size: at setup with verify, at the read without.
  tessera::testing::remove_dir(c);
  write_corpus(c, {{{1, 2, 3, 150, 4, 5, 6, 7, 8, 9}}}, 200);
  toolkit::TokenManifest m = toolkit::read_manifest(c);
  m.vocab_size = 100;
  toolkit::write_manifest(c, m);
  e = setup_error();
  EXPECT_MENTIONS(e, "shard_00000.bin");
  EXPECT_MENTIONS(e, "token id 150 is out of range");
  auto lazy = make_data("path = \"" + c.string() + "\"\nblock_size = 4\nverify = false\nval_fraction = 0\n");
  lazy->setup("fit");
  e = error_of([&] { lazy->train_dataset()->get_batch({0}); });
  EXPECT_MENTIONS(e, "shard_00000.bin");
  EXPECT_MENTIONS(e, "token id 150");

  tessera::testing::remove_dir(c);
  write_corpus(c, {Docs{}}, 100);
  EXPECT_MENTIONS(setup_error(), "lists no tokens");

  tessera::testing::remove_dir(c);
  fs::create_directories(c);
  e = setup_error();
  EXPECT_MENTIONS(e, "manifest.json");
  EXPECT_MENTIONS(e, "tessera data prepare");
  EXPECT_MENTIONS(error_of([&] { make_data("block_size = 4\n"); }), "[data] path");
}

// ---------------------------------------------------------------- through the binary

std::string tessera_data(const std::string& arguments, const std::string& environment = "") {
  auto r = run_tessera("data " + arguments, environment, 120);
  return std::to_string(r.exit_code) + "\n" + r.output;
}

/// A small BPE SentencePiece model of the fortunes corpus (Debian's sentencepiece trainer).
fs::path train_tokenizer(const fs::path& dir) {
  std::string corpus;
  for (const char* name : {"fortunes", "computers", "science"}) {
    std::ifstream in(fs::path("/usr/share/games/fortunes") / name);
    corpus.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  std::ofstream(dir / "train.txt") << corpus;
  auto r = run_command("spm_train --input=" + (dir / "train.txt").string() + " --model_prefix=" +
                       (dir / "tok").string() + " --vocab_size=400 --model_type=bpe --minloglevel=2 2>&1");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return dir / "tok.model";
}

std::map<std::string, std::string> files_of(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::ifstream in(entry.path(), std::ios::binary);
    out[entry.path().filename().string()] = std::string(std::istreambuf_iterator<char>(in), {});
  }
  return out;
}

/// A run config: the gpt over a prepared corpus of vocabulary 512, SGD (so that world sizes,
/// whose sums round differently, are compared to 2e-5 as the parity tests do).
std::string fit_config(const fs::path& dir, const fs::path& corpus, const std::string& extra = "") {
  std::ofstream(dir / "run.toml") << "[trainer]\nlog_every_n_steps = 1\nseed = 5\ncheckpoint_every_n_steps = 3\n"
                                  << "default_root_dir = \"" << dir.string() << "\"\nenable_progress_bar = false\n"
                                  << "num_sanity_val_steps = 0\nlimit_val_batches = 0\n"
                                  << "[optimizer]\nname = \"sgd\"\nlr = 0.05\nmomentum = 0.9\nschedule = \"constant\"\n"
                                  << "[strategy]\nplugin = \"fsdp2\"\n"
                                  << "[model]\nplugin = \"gpt\"\nn_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 16\n"
                                  << "vocab_size = 512\n"
                                  << "[data]\nplugin = \"tokens\"\npath = \"" << corpus.string()
                                  << "\"\nblock_size = 16\nval_fraction = 0\n"
                                  << extra;
  return (dir / "run.toml").string();
}

// A prepare SIGKILLed while a shard is half written leaves nothing that loads; the same command
// again skips the finished shards and writes exactly what an uninterrupted prepare writes.
TEST(TokensPrepare, KilledMidwayThenRerunGivesByteIdenticalShards) {
  TempDir dir;
  const fs::path tokenizer = train_tokenizer(dir.path());
  const std::string args = "prepare --tokenizer " + tokenizer.string() +
                           " --input /usr/share/games/fortunes --split percent --shard-size 256K --jobs 2 --output ";
  std::string full = tessera_data(args + (dir.path() / "full").string());
  ASSERT_EQ(full.substr(0, 2), "0\n") << full;
  EXPECT_MENTIONS(full, "documents");
  auto expected = files_of(dir.path() / "full");
  ASSERT_GE(expected.size(), 2u * 4 + 2);  // several shards, a manifest and the plan

  const fs::path out = dir.path() / "resumed";
  std::string killed = tessera_data(args + out.string(), "TESSERA_FAULT_PREPARE=shard_00002");
  EXPECT_NE(killed.substr(0, 2), "0\n") << killed;
  EXPECT_FALSE(fs::exists(out / "manifest.json"));
  EXPECT_TRUE(fs::exists(out / "shard_00001.bin"));
  EXPECT_FALSE(fs::exists(out / "shard_00002.bin"));
  EXPECT_MENTIONS(error_of([&] { toolkit::TokenShards(out, true); }), "manifest.json");

  std::string rerun = tessera_data(args + out.string());
  ASSERT_EQ(rerun.substr(0, 2), "0\n") << rerun;
  EXPECT_MENTIONS(rerun, "2 already finished");
  EXPECT_EQ(files_of(out), expected);

  // Finished shards damaged since (same sizes) are checked against the checksums recorded when
  // they were written: the same command prepares them again, never records the damaged files'
  // checksums (issue 59.3), and the others stay finished.
  for (const char* name : {"shard_00001.bin", "shard_00002.idx"}) {
    std::fstream file(out / name, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(16);
    file.write("twenty damaged bytes", 20);
  }
  std::string repaired = tessera_data(args + out.string());
  ASSERT_EQ(repaired.substr(0, 2), "0\n") << repaired;
  EXPECT_MENTIONS(repaired, (out / "shard_00001.bin").string() + " does not match the checksum recorded when it was written");
  EXPECT_MENTIONS(repaired, (out / "shard_00002.idx").string() + " does not match the checksum recorded");
  EXPECT_MENTIONS(repaired, "prepared again");
  EXPECT_MENTIONS(repaired, std::to_string(expected.size() / 2 - 1 - 2) + " already finished");
  EXPECT_EQ(files_of(out), expected);

  // The prepared corpus loads and checks out, and the same tokenizer decodes a prompt.
  toolkit::TokenShards shards(out, /*verify=*/true);
  EXPECT_EQ(shards.manifest().tokenizer_kind, "sentencepiece");
  EXPECT_EQ(shards.manifest().vocab_size, 400);
  auto data = make_data("path = \"" + out.string() + "\"\ntokenizer = \"" + tokenizer.string() +
                        "\"\nblock_size = 16\nprompt = \"Q: What\"\n");
  data->setup("predict");
  sdk::Batch prompt = data->predict_dataset()->get_batch({0});
  EXPECT_EQ(data->describe_prediction(prompt, prompt.input), "Q: What");
  // fit's predict_after_fit sets the data up for predict first, as Lightning does (the prompt
  // dataset is made there): the sample starts with the prompt, decoded back to text.
  const fs::path run = dir.path() / "run";
  fs::create_directories(run);
  auto sampled = run_tessera("fit --config " +
                                 fit_config(run, out, "tokenizer = \"" + tokenizer.string() + "\"\nprompt = \"Q: What\"\n") +
                                 " --set model.vocab_size=400 --set trainer.max_steps=2 --set trainer.predict_after_fit=true"
                                 " --set launch.devices=1",
                             "", 120);
  ASSERT_EQ(sampled.exit_code, 0) << sampled.output;
  EXPECT_MENTIONS(sampled.output, "sample from the trained model:\nQ: What");

  // predict_after_fit without the prompt and tokenizer predict needs is refused before the run
  // starts, not after training (issue 59.9).
  const fs::path no_prompt = dir.path() / "no-prompt";
  fs::create_directories(no_prompt);
  auto early = run_tessera("fit --config " + fit_config(no_prompt, out) +
                               " --set model.vocab_size=400 --set trainer.max_steps=2 --set trainer.predict_after_fit=true"
                               " --set launch.devices=1",
                           "", 120);
  EXPECT_NE(early.exit_code, 0) << early.output;
  EXPECT_MENTIONS(early.output, "[trainer] predict_after_fit = true samples from the model after fit, but the data "
                                "cannot predict: " + (no_prompt / "run.toml").string() + ": [data] prompt is needed by predict");
  EXPECT_FALSE(fs::exists(no_prompt / "version_0")) << "a run started: " << early.output;

  // A tokenizer of the same kind and vocabulary size that is not the file manifest.json records
  // (its xxh64 differs: here the same model with an unknown protobuf field appended) is refused at
  // resume, before any step and with the checkpoints as they were (issue 59.5); an explicit key
  // accepts it.
  const fs::path other_tokenizer = dir.path() / "other.model";
  {
    std::ifstream in(tokenizer, std::ios::binary);
    std::ofstream copy(other_tokenizer, std::ios::binary);
    copy << in.rdbuf();
    copy.write("\xc0\x3e\x01", 3);  // field 1000 = 1, which protobuf parses past
  }
  const std::string checkpoints = run_dir(run.string()) + "/checkpoints";
  const auto saved = files_of(checkpoints);
  ASSERT_FALSE(saved.empty());
  auto refused = run_tessera("fit --config " + (run / "run.toml").string() + " --ckpt-path last --set data.tokenizer=" +
                                 other_tokenizer.string() + " --set model.vocab_size=400 --set trainer.max_steps=4"
                                 " --set launch.devices=1",
                             "", 120);
  EXPECT_NE(refused.exit_code, 0) << refused.output;
  EXPECT_MENTIONS(refused.output, "[data] tokenizer = \"" + other_tokenizer.string() + "\"");
  EXPECT_MENTIONS(refused.output, "but " + (out / "manifest.json").string() + " records " +
                                      shards.manifest().tokenizer_xxh64 + " for the tokenizer the data was prepared with");
  EXPECT_MENTIONS(refused.output, "[data] accept_other_tokenizer = true");
  EXPECT_EQ(files_of(checkpoints), saved) << refused.output;
  auto accepted = make_data("path = \"" + out.string() + "\"\ntokenizer = \"" + other_tokenizer.string() +
                            "\"\nblock_size = 16\naccept_other_tokenizer = true\n");
  EXPECT_NO_THROW(accepted->setup("fit"));

  // Another preparation into the same folder is refused, and nothing there changes.
  std::string other = tessera_data("prepare --tokenizer " + tokenizer.string() + " --input " +
                                   (dir.path() / "train.txt").string() + " --output " + out.string());
  EXPECT_EQ(other.substr(0, 2), "1\n") << other;
  EXPECT_MENTIONS(other, "prepare.json");
  EXPECT_EQ(files_of(out), expected);
}

TEST(TokensPrepare, BadInputsAreErrorsNamingTheFile) {
  TempDir dir;
  const fs::path tokenizer = train_tokenizer(dir.path());
  const std::string tok = " --tokenizer " + tokenizer.string();
  std::ofstream(dir.path() / "docs.jsonl") << "{\"text\": \"one\"}\n{\"text\": \"two\"}\n{\"body\": \"three\"}\n";
  std::string e = tessera_data("prepare" + tok + " --input " + (dir.path() / "docs.jsonl").string() + " --output " +
                               (dir.path() / "j").string());
  EXPECT_EQ(e.substr(0, 2), "1\n") << e;
  EXPECT_MENTIONS(e, "docs.jsonl:3");
  EXPECT_MENTIONS(e, "\"text\"");
  EXPECT_MENTIONS(e, "body");
  // --text-key picks another key (the first two lines then lack it: line 1 named).
  e = tessera_data("prepare" + tok + " --input " + (dir.path() / "docs.jsonl").string() + " --text-key body --output " +
                   (dir.path() / "j2").string());
  EXPECT_MENTIONS(e, "docs.jsonl:1");

  // A document the tokenizer refuses (invalid UTF-8) is named by its input file and line, not
  // only by the shard being written (issue 59.9).
  std::ofstream(dir.path() / "bad-utf8.txt") << "one\ntwo\nthree \xff\xfe bytes\n";
  e = tessera_data("prepare" + tok + " --split line --input " + (dir.path() / "bad-utf8.txt").string() + " --output " +
                   (dir.path() / "u").string());
  EXPECT_EQ(e.substr(0, 2), "1\n") << e;
  EXPECT_MENTIONS(e, (dir.path() / "bad-utf8.txt").string() + ":3 (the document starting there)");

  std::ofstream(dir.path() / "empty.txt") << "%\n%\n";
  e = tessera_data("prepare" + tok + " --split percent --input " + (dir.path() / "empty.txt").string() + " --output " +
                   (dir.path() / "e").string());
  EXPECT_EQ(e.substr(0, 2), "1\n") << e;
  EXPECT_MENTIONS(e, "no document");
  EXPECT_FALSE(fs::exists(dir.path() / "e" / "manifest.json"));

  std::ofstream(dir.path() / "not-a-tokenizer.model") << "hello";
  e = tessera_data("prepare --tokenizer " + (dir.path() / "not-a-tokenizer.model").string() + " --input " +
                   (dir.path() / "train.txt").string() + " --output " + (dir.path() / "t").string());
  EXPECT_EQ(e.substr(0, 2), "1\n") << e;
  EXPECT_MENTIONS(e, "not-a-tokenizer.model");

  e = tessera_data("prepare" + tok + " --input " + (dir.path() / "nothing*.txt").string() + " --output " +
                   (dir.path() / "n").string());
  EXPECT_MENTIONS(e, "matches no file");

  // A tokenizer other than the data's, given to the plugin.
  write_corpus(dir.path() / "c", {iota_docs({40}, 0)}, 1000);
  auto data = make_data("path = \"" + (dir.path() / "c").string() + "\"\ntokenizer = \"" + tokenizer.string() +
                        "\"\nblock_size = 4\nval_fraction = 0\n");
  e = error_of([&] { data->setup("fit"); });
  EXPECT_MENTIONS(e, tokenizer.string());
  EXPECT_MENTIONS(e, "1000");
}


struct FitRun {
  std::map<std::int64_t, double> losses;
  std::string dir, output;
};

FitRun fit(const fs::path& root, const std::string& name, const fs::path& corpus, int world, int global_batch,
           int max_steps, const std::string& ckpt = "") {
  const fs::path dir = root / name;
  fs::create_directories(dir);
  auto r = run_tessera("fit --config " + fit_config(dir, corpus) + " --set launch.devices=" + std::to_string(world) +
                           " --set data.batch_size=" + std::to_string(global_batch / world) +
                           " --set trainer.max_steps=" + std::to_string(max_steps) +
                           (ckpt.empty() ? "" : " --ckpt-path " + ckpt),
                       "", 240);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return FitRun{metric_series(run_dir(dir.string()) + "/metrics.csv", "train", "train_loss"), run_dir(dir.string()),
                r.output};
}

// World sizes 1-4 with the same global batch train on the same samples (the losses agree to
// rounding); a run resumed mid-epoch from step 3 continues with the uninterrupted run's batches:
// bitwise at the same world size, to rounding at another.
TEST(TokensFit, SameGlobalBatchesAtEveryWorldSizeAndExactMidEpochResume) {
  TempDir dir;
  const fs::path corpus = dir.path() / "corpus";
  write_random_corpus(corpus, 2, 40, 100, 512);  // 8,000 tokens: ~500 windows, ~40 steps an epoch
  FitRun two = fit(dir.path(), "w2", corpus, 2, 12, 6);
  ASSERT_EQ(two.losses.size(), 6u) << two.output;
  for (int world : {1, 3, 4}) {
    FitRun other = fit(dir.path(), "w" + std::to_string(world), corpus, world, 12, 3);
    for (std::int64_t step : {1, 2, 3}) {
      ASSERT_TRUE(other.losses.count(step)) << world << "\n" << other.output;
      EXPECT_NEAR(other.losses.at(step), two.losses.at(step), 2e-5 * two.losses.at(step)) << "world size " << world;
    }
  }
  const std::string ckpt = two.dir + "/checkpoints/step=3.ckpt";
  ASSERT_TRUE(fs::exists(ckpt)) << two.output;
  FitRun same = fit(dir.path(), "resumed2", corpus, 2, 12, 6, ckpt);
  FitRun wider = fit(dir.path(), "resumed4", corpus, 4, 12, 6, ckpt);
  for (std::int64_t step : {4, 5, 6}) {
    ASSERT_TRUE(same.losses.count(step) && wider.losses.count(step)) << same.output << wider.output;
    EXPECT_EQ(same.losses.at(step), two.losses.at(step)) << "step " << step;
    EXPECT_NEAR(wider.losses.at(step), two.losses.at(step), 2e-5 * two.losses.at(step)) << "step " << step;
  }
  // Another global batch resumes at the same sample when the position is a whole number of its batches.
  FitRun halves = fit(dir.path(), "resumed_halves", corpus, 2, 6, 4, ckpt);
  EXPECT_MENTIONS(halves.output, "resuming 36 samples into epoch 0 with batches of 6 samples");
  // Otherwise (an elastic restart at another world size) at the next whole batch, skipping the rest.
  FitRun eights = fit(dir.path(), "resumed_eights", corpus, 2, 8, 4, ckpt);
  EXPECT_MENTIONS(eights.output, "batch 5 of the epoch comes next, skipping the 4 samples before it");
  EXPECT_TRUE(eights.losses.count(4)) << eights.output;
}

TEST(TokensFit, AVocabularyLargerThanTheModelsIsRefusedBeforeAnyStep) {
  TempDir dir;
  const fs::path corpus = dir.path() / "corpus";
  write_random_corpus(corpus, 1, 10, 100, 512);
  auto r = run_tessera("fit --config " + fit_config(dir.path(), corpus) + " --set model.vocab_size=300 " +
                           "--set trainer.max_steps=2 --set launch.devices=1",
                       "", 120);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_MENTIONS(r.output, (corpus / "manifest.json").string());
  EXPECT_MENTIONS(r.output, "vocab_size = 512");
  EXPECT_EQ(r.output.find("train_loss"), std::string::npos) << r.output;
}

/// A prepared corpus of `tokens` ids in one sparse shard (no disk used for the zeros).
void write_sparse_corpus(const fs::path& dir, std::int64_t tokens) {
  fs::create_directories(dir);
  const int fd = ::open((dir / "shard_00000.bin").c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, tokens * 2), 0);
  ::close(fd);
  std::vector<std::uint64_t> offsets{0, static_cast<std::uint64_t>(tokens)};
  std::ofstream(dir / "shard_00000.idx", std::ios::binary)
      .write(reinterpret_cast<const char*>(offsets.data()), 16);
  toolkit::TokenManifest m;
  m.tokenizer_name = "made-up";
  m.tokenizer_kind = "sentencepiece";
  m.vocab_size = 512;
  m.eos_id = 0;
  m.shards.push_back({"shard_00000.bin", tokens, 1, "shard_00000.idx", "not-verified", "not-verified"});
  toolkit::write_manifest(dir, m);
}

double peak_rss_mb(const std::string& output) {
  std::smatch match;
  const std::regex pattern("peak RSS per rank \\(max over ranks\\): ([0-9.]+) MB");
  EXPECT_TRUE(std::regex_search(output, match, pattern)) << output;
  return match.empty() ? 0.0 : std::stod(match[1]);
}

// The peak RSS of a rank training on a 2 GB prepared corpus equals that on a 100 MB one (within
// 5%): nothing per sample or per document is held (a permutation array alone would add 130 MB).
TEST(TokensFit, PeakMemoryDoesNotGrowWithTheCorpus) {
  TempDir dir;
  std::map<std::string, double> peaks;
  for (const auto& [name, bytes] : {std::pair<std::string, std::int64_t>{"small", 100ll << 20}, {"large", 2ll << 30}}) {
    const fs::path corpus = dir.path() / name;
    write_sparse_corpus(corpus, bytes / 2);
    fs::create_directories(dir.path() / ("run_" + name));
    auto r = run_tessera("fit --config " + fit_config(dir.path() / ("run_" + name), corpus, "verify = false\n") +
                             " --set trainer.max_steps=3 --set launch.devices=1 --set data.batch_size=8",
                         "", 180);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    peaks[name] = peak_rss_mb(r.output);
  }
  EXPECT_LE(std::abs(peaks["large"] - peaks["small"]), 0.05 * peaks["small"])
      << "peak RSS " << peaks["small"] << " MB (100 MB corpus) vs " << peaks["large"] << " MB (2 GB corpus)";
}

}  // namespace
