// Supervised fine-tuning's data (issue 62, parts 2, 3 and 5): conversations prepared through a real
// chat template (Qwen2.5-Instruct's, tests/chat_template/models) into token shards with a loss
// mask found by rendering; the `tokens` plugin's targets honouring it; packed rows whose samples'
// losses equal each sample run alone through the llama and gpt plugins (fp32, 1e-5); predict's
// chat prompt and its reply cut at the end of the turn.

#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "multiprocess.hpp"
#include "plugin_loader.hpp"
#include "tessera/sdk/data.hpp"
#include "tessera/sdk/module.hpp"
#include "tessera/sdk/toml_options.hpp"
#include "tessera/toolkit/chat_data.hpp"
#include "tessera/toolkit/chat_template.hpp"
#include "tessera/toolkit/token_shards.hpp"
#include "tessera/toolkit/tokenizer.hpp"

namespace {

namespace fs = std::filesystem;
namespace sdk = tessera::sdk;
namespace toolkit = tessera::toolkit;
using json = nlohmann::json;
using tessera::core::PluginLoader;
using tessera::testing::fresh_dir;
using tessera::testing::remove_dir;
using tessera::testing::run_tessera;

#define EXPECT_MENTIONS(text, part) EXPECT_NE((text).find(part), std::string::npos) << "missing '" << (part) << "' in: " << (text)

PluginLoader& loader() {
  static PluginLoader instance({PLUGIN_DIR});
  return instance;
}

template <typename T>
std::shared_ptr<T> make_plugin(sdk::PluginKind kind, const std::string& section, const std::string& name,
                               const std::string& toml_text) {
  sdk::Options options = sdk::make_options(section, "test.toml", toml::parse(toml_text));
  auto plugin = loader().create_as<T>(kind, name, options);
  options.check_all_used();
  return plugin;
}


void write(const fs::path& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

/// GPT-2's bytes_to_unicode: the printable stand-in of each byte in a byte-level vocabulary.
std::string byte_symbol(int byte) {
  int code = byte;
  const bool printable = (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || (byte >= 0xAE && byte <= 0xFF);
  if (!printable) {
    int n = 0;
    for (int b = 0; b < byte; ++b)
      if (!((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF))) ++n;
    code = 256 + n;
  }
  std::string utf8;
  if (code < 0x80) utf8 += static_cast<char>(code);
  else {
    utf8 += static_cast<char>(0xC0 | (code >> 6));
    utf8 += static_cast<char>(0x80 | (code & 0x3F));
  }
  return utf8;
}

/// A Hugging Face tokenizer folder: a byte-level BPE tokenizer.json (the 256 bytes, a few merges,
/// Qwen2's added tokens) beside Qwen2.5-7B-Instruct's real tokenizer_config.json and chat template.
fs::path qwen_style_tokenizer(const fs::path& dir) {
  fs::create_directories(dir);
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_symbol(b)] = b;
  vocab["\u0120t"] = 256;
  vocab["he"] = 257;
  vocab["\u0120the"] = 258;
  json added = json::array();
  int id = 259;
  for (const char* token : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"})
    added.push_back({{"id", id++}, {"content", token}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                     {"normalized", false}, {"special", true}});
  for (const char* token : {"<tool_call>", "</tool_call>"})
    added.push_back({{"id", id++}, {"content", token}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                     {"normalized", false}, {"special", false}});
  const json tokenizer = {
      {"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr}, {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
                 {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false}, {"vocab", vocab},
                 {"merges", {"\u0120 t", "h e", "\u0120t he"}}}}};
  write(dir / "tokenizer.json", tokenizer.dump());
  fs::copy_file(TESSERA_SOURCE_DIR "/tests/chat_template/models/qwen2.5-7b-instruct/tokenizer_config.json",
                dir / "tokenizer_config.json", fs::copy_options::overwrite_existing);
  return dir;
}

json message(const std::string& role, const std::string& content) { return {{"role", role}, {"content", content}}; }

/// Conversations: two turns with a system prompt, one with a tool call and its result, one with
/// no assistant message (nothing to train: dropped), one too long for --max-length (truncated).
std::vector<json> conversations() {
  std::vector<json> out;
  out.push_back({{"messages", {message("system", "You shard the model."), message("user", "What is FSDP?"),
                               message("assistant", "Fully sharded data parallel: the parameters are split."),
                               message("user", "And the gradients?"),
                               message("assistant", "They are reduce-scattered to the shards.")}}});
  json call = message("assistant", "");
  call["tool_calls"] = {{{"type", "function"},
                         {"function", {{"name", "get_weather"}, {"arguments", {{"city", "Oslo"}}}}}}};
  out.push_back({{"messages", {message("user", "Weather in Oslo?"), call, message("tool", "4 degrees, rain"),
                               message("assistant", "It is 4 degrees and raining in Oslo.")}},
                 {"tools", {{{"type", "function"},
                             {"function", {{"name", "get_weather"}, {"description", "the weather in a city"},
                                           {"parameters", {{"type", "object"},
                                                           {"properties", {{"city", {{"type", "string"}}}}}}}}}}}}});
  out.push_back({{"messages", {message("user", "Only a question, no answer")}}});
  out.push_back({{"messages", {message("user", "Say the longest thing you can."),
                               message("assistant", std::string(1500, 'x'))}}});
  return out;
}

fs::path write_conversations(const fs::path& dir) {
  std::string lines;
  for (const auto& c : conversations()) lines += c.dump() + "\n";
  write(dir / "chat.jsonl", lines);
  return dir / "chat.jsonl";
}

/// The runs of consecutive labelled tokens of one document, decoded.
std::vector<std::string> labelled_spans(const toolkit::Tokenizer& tokenizer, const std::vector<std::int64_t>& ids,
                                        const std::vector<std::uint8_t>& mask) {
  std::vector<std::string> spans;
  for (std::size_t t = 0; t < ids.size();) {
    if (!mask[t]) {
      ++t;
      continue;
    }
    std::vector<toolkit::TokenId> run;
    for (; t < ids.size() && mask[t]; ++t) run.push_back(static_cast<toolkit::TokenId>(ids[t]));
    spans.push_back(tokenizer.decode(run));
  }
  return spans;
}

TEST(ChatData, PrepareMasksWhatEachAssistantMessageAddsFoundByRendering) {
  const fs::path dir = fresh_dir("sft_prepare");
  const fs::path tokenizer_dir = qwen_style_tokenizer(dir / "tokenizer");
  const fs::path input = write_conversations(dir);
  const auto r = run_tessera("data prepare --format chat --tokenizer " + tokenizer_dir.string() + " --input " +
                             input.string() + " --output " + (dir / "out").string() + " --max-length 1000 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_MENTIONS(r.output, "1 truncated to --max-length, 0 dropped as longer than it, 1 dropped with no token to train on");

  const toolkit::TokenShards shards(dir / "out", /*verify=*/true);
  ASSERT_TRUE(shards.manifest().has_mask());
  EXPECT_EQ(shards.manifest().content, "chat");
  ASSERT_EQ(shards.shards(), 1);
  ASSERT_EQ(shards.documents(0), 3);  // the unanswered question left out
  const auto tokenizer = toolkit::load_tokenizer(tokenizer_dir);
  const auto chat_template = toolkit::ChatTemplate::load(tokenizer_dir);
  const std::vector<json> all = conversations();
  const std::vector<json> kept{all[0], all[1], all[3]};
  for (std::int64_t d = 0; d < 3; ++d) {
    const std::int64_t begin = shards.document_start(0, d), count = shards.document_start(0, d + 1) - begin;
    std::vector<std::int64_t> ids(static_cast<std::size_t>(count));
    std::vector<std::uint8_t> mask(ids.size());
    shards.read(0, begin, count, ids.data());
    shards.read_mask(0, begin, count, mask.data());
    // The ids are transformers' apply_chat_template(tokenize=True): the whole rendering tokenized.
    std::vector<toolkit::TokenId> expected =
        tokenizer->encode(chat_template.apply(kept[d].dump(), false), /*add_special_tokens=*/false);
    if (d == 2) expected.resize(1000);  // --max-length
    EXPECT_EQ(std::vector<toolkit::TokenId>(ids.begin(), ids.end()), expected) << "conversation " << d;
    // Labels: each assistant message's content and its end-of-turn markup, nothing of the prompt.
    const auto spans = labelled_spans(*tokenizer, ids, mask);
    if (d == 0) {
      EXPECT_EQ(spans, (std::vector<std::string>{"Fully sharded data parallel: the parameters are split.<|im_end|>\n",
                                                 "They are reduce-scattered to the shards.<|im_end|>\n"}));
    } else if (d == 1) {
      ASSERT_EQ(spans.size(), 2u);
      EXPECT_EQ(spans[0], "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call><|im_end|>\n");
      EXPECT_EQ(spans[1], "It is 4 degrees and raining in Oslo.<|im_end|>\n");
    } else {
      ASSERT_EQ(spans.size(), 1u);  // truncated inside the answer: its first part trains
      EXPECT_EQ(spans[0].find_first_not_of('x'), std::string::npos) << spans[0];
    }
  }

  // --loss-on all labels every token (the unanswered question too); --overflow drop leaves the
  // long conversation out.
  const auto all_tokens = run_tessera("data prepare --format chat --loss-on all --overflow drop --max-length 1000 "
                                      "--tokenizer " + tokenizer_dir.string() + " --input " + input.string() +
                                      " --output " + (dir / "all").string() + " 2>&1");
  ASSERT_EQ(all_tokens.exit_code, 0) << all_tokens.output;
  EXPECT_MENTIONS(all_tokens.output, "0 truncated to --max-length, 1 dropped as longer than it, 0 dropped with no");
  const toolkit::TokenShards every(dir / "all", true);
  ASSERT_EQ(every.documents(0), 3);
  std::vector<std::uint8_t> mask(static_cast<std::size_t>(every.tokens(0)));
  every.read_mask(0, 0, every.tokens(0), mask.data());
  EXPECT_EQ(std::accumulate(mask.begin(), mask.end(), 0), every.tokens(0));

  // What cannot be prepared is refused naming the input's line.
  write(dir / "bad.jsonl", all[0].dump() + "\n{\"messages\": 3}\n");
  const auto bad = run_tessera("data prepare --format chat --tokenizer " + tokenizer_dir.string() + " --input " +
                               (dir / "bad.jsonl").string() + " --output " + (dir / "bad").string() + " 2>&1");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_MENTIONS(bad.output, "bad.jsonl:2");
  EXPECT_MENTIONS(bad.output, "a conversation is {\"messages\"");
  const auto wrong_flag = run_tessera("data prepare --loss-on all --tokenizer " + tokenizer_dir.string() + " --input " +
                                      input.string() + " --output " + (dir / "x").string() + " 2>&1");
  EXPECT_NE(wrong_flag.exit_code, 0);
  EXPECT_MENTIONS(wrong_flag.output, "--loss-on applies to --format chat only");
  remove_dir(dir);
}

TEST(ChatData, TheTokensPluginTrainsOnlyTheLabelsAndReadsVersion1Manifests) {
  const fs::path dir = fresh_dir("sft_plugin");
  const fs::path tokenizer_dir = qwen_style_tokenizer(dir / "tokenizer");
  const fs::path input = write_conversations(dir);
  ASSERT_EQ(run_tessera("data prepare --format chat --tokenizer " + tokenizer_dir.string() + " --input " +
                        input.string() + " --output " + (dir / "out").string() + " 2>&1")
                .exit_code,
            0);
  const toolkit::TokenShards shards(dir / "out", true);
  auto data = make_plugin<sdk::DataModule>(sdk::PluginKind::data, "data", "tokens",
                                           "path = \"" + (dir / "out").string() +
                                               "\"\nblock_size = 512\ndocument_aligned = true\nval_fraction = 0\n");
  data->setup("fit");
  const sdk::Batch batch = data->train_dataset()->get_batch({0});
  const std::int64_t count = shards.document_start(0, 1);
  std::vector<std::int64_t> ids(static_cast<std::size_t>(count));
  std::vector<std::uint8_t> mask(ids.size());
  shards.read(0, 0, count, ids.data());
  shards.read_mask(0, 0, count, mask.data());
  for (std::int64_t t = 0; t + 1 < count; ++t)
    EXPECT_EQ(batch.target[0][t].item<std::int64_t>(), mask[t + 1] ? ids[t + 1] : -100) << "position " << t;
  EXPECT_EQ(batch.input[0][0].item<std::int64_t>(), ids[0]);

  // A damaged mask is refused naming the file; rerunning the prepare prepares that shard again
  // (its mask checked against the checksum recorded when it was written, never re-recorded).
  {
    std::fstream mask_file(dir / "out" / "shard_00000.mask", std::ios::in | std::ios::out | std::ios::binary);
    mask_file.seekp(3);
    mask_file.put(static_cast<char>(mask[3] ? 0 : 1));
  }
  try {
    toolkit::TokenShards damaged(dir / "out", true);
    ADD_FAILURE() << "a damaged mask was read";
  } catch (const std::exception& e) {
    EXPECT_MENTIONS(std::string(e.what()), "shard_00000.mask\": checksum");
  }
  const auto rerun = run_tessera("data prepare --format chat --tokenizer " + tokenizer_dir.string() + " --input " +
                                 input.string() + " --output " + (dir / "out").string() + " 2>&1");
  ASSERT_EQ(rerun.exit_code, 0) << rerun.output;
  EXPECT_MENTIONS(rerun.output, "shard_00000.mask does not match the checksum recorded when it was written");
  EXPECT_NO_THROW(toolkit::TokenShards(dir / "out", true));

  // A version 1 manifest (no "content", no masks) still reads, as text.
  {
    std::ifstream in(dir / "out" / toolkit::kManifestName);
    json m = json::parse(in);
    m["version"] = 1;
    m.erase("content");
    for (auto& s : m["shards"]) {
      s.erase("mask");
      s.erase("mask_xxh64");
    }
    write(dir / "out" / toolkit::kManifestName, m.dump(2));
  }
  const toolkit::TokenShards old(dir / "out", true);
  EXPECT_FALSE(old.manifest().has_mask());
  EXPECT_EQ(old.manifest().content, "text");
  remove_dir(dir);
}

/// A corpus written directly: documents of the given lengths, ids counting up from 1.
fs::path write_documents(const fs::path& dir, const std::vector<int>& lengths, std::int64_t vocab) {
  fs::create_directories(dir);
  toolkit::TokenManifest m;
  m.tokenizer_name = "made-up";
  m.tokenizer_kind = "sentencepiece";
  m.vocab_size = vocab;
  m.dtype = toolkit::dtype_for(vocab);
  m.eos_id = 0;
  std::vector<toolkit::TokenId> tokens;
  std::vector<std::uint64_t> offsets{0};
  for (int n : lengths) {
    for (int t = 0; t < n; ++t) tokens.push_back(1 + static_cast<toolkit::TokenId>(tokens.size() % (vocab - 1)));
    offsets.push_back(tokens.size());
  }
  m.shards.push_back(toolkit::write_shard(dir, "shard_00000", m.dtype, tokens, offsets));
  toolkit::write_manifest(dir, m);
  return dir;
}

TEST(Packing, RowsHoldWholeDocumentsWithPositionsRestartingAtEach) {
  const fs::path dir = write_documents(fresh_dir("sft_rows"), {5, 3, 9, 2, 4, 1, 12}, 64);
  auto data = make_plugin<sdk::DataModule>(sdk::PluginKind::data, "data", "tokens",
                                           "path = \"" + dir.string() + "\"\nblock_size = 8\npacking = true\nval_fraction = 0\n");
  data->setup("fit");
  // Positions trained (length - 1): 4, 2, 8, 1, 3, 0 (left out), 8 (12 cut to block_size + 1 = 9
  // tokens). Rows of at most 8: [4 2], [8], [1 3], [8].
  auto rows = data->train_dataset();
  ASSERT_EQ(rows->size(), 4);
  // A batch is its rows end to end in one row, padding-free: 6 + 8 + 4 + 8 positions.
  const sdk::Batch b = rows->get_batch({0, 1, 2, 3});
  ASSERT_TRUE(b.position_ids.defined());
  ASSERT_EQ(b.input.sizes(), (std::vector<std::int64_t>{1, 26}));
  ASSERT_EQ(b.target.sizes(), b.input.sizes());
  ASSERT_EQ(b.position_ids.sizes(), b.input.sizes());
  const std::vector<std::int64_t> positions{0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7};
  for (std::int64_t t = 0; t < 26; ++t) EXPECT_EQ(b.position_ids[0][t].item<std::int64_t>(), positions[t]) << "position " << t;
  EXPECT_EQ(b.target.eq(-100).sum().item<std::int64_t>(), 0) << "a pad position";
  // Row 0: document 0 (ids 1..5) then document 1 (ids 6..8), each predicting only its own tokens.
  const std::vector<std::int64_t> input0{1, 2, 3, 4, 6, 7}, target0{2, 3, 4, 5, 7, 8};
  for (std::int64_t t = 0; t < 6; ++t) {
    EXPECT_EQ(b.input[0][t].item<std::int64_t>(), input0[t]);
    EXPECT_EQ(b.target[0][t].item<std::int64_t>(), target0[t]);
  }
  EXPECT_EQ(rows->get_batch({2}).input.size(1), 4);
  EXPECT_EQ(rows->get_batch({0, 2}).position_ids.size(1), 10);
  // A blend's rows, flattened alike, go end to end.
  const fs::path other = write_documents(fresh_dir("sft_rows_other"), {3, 3}, 64);
  auto blend = make_plugin<sdk::DataModule>(sdk::PluginKind::data, "data", "tokens",
                                            "path = [\"" + dir.string() + "\", \"" + other.string() +
                                                "\"]\nweights = [1.0, 1.0]\nblock_size = 8\npacking = true\nval_fraction = 0\n");
  blend->setup("fit");
  const std::int64_t blended = blend->train_dataset()->size();
  std::vector<std::int64_t> every(static_cast<std::size_t>(blended));
  std::iota(every.begin(), every.end(), 0);
  std::int64_t expected = 0;
  for (std::int64_t i : every) expected += blend->train_dataset()->get_batch({i}).input.size(1);
  const sdk::Batch mixed = blend->train_dataset()->get_batch(every);
  EXPECT_EQ(mixed.input.size(0), 1);
  EXPECT_EQ(mixed.input.size(1), expected);
  EXPECT_EQ(mixed.position_ids.sizes(), mixed.target.sizes());
  remove_dir(other);
  auto refused = [&](const std::string& toml_text) {
    try {
      make_plugin<sdk::DataModule>(sdk::PluginKind::data, "data", "tokens", toml_text);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("<accepted>");
  };
  EXPECT_MENTIONS(refused("path = \"" + dir.string() + "\"\npacking = true\ndocument_aligned = true\n"),
                  "both choose how documents become samples");
  remove_dir(dir);
}

/// Mean loss over the positions [begin, end) of `row` of a batch, every other target ignored.
double loss_over(sdk::Module& model, const sdk::Batch& batch, std::int64_t begin, std::int64_t end) {
  at::Tensor target = at::full_like(batch.target, -100);
  target.narrow(1, begin, end - begin).copy_(batch.target.narrow(1, begin, end - begin));
  return model.training_step(sdk::Batch{batch.input, target, batch.position_ids}, 0).loss.item<double>();
}

struct PackedCase {
  std::string plugin, model_toml;
};

class PackedLosses : public ::testing::TestWithParam<PackedCase> {};

// Three documents packed into one row of 48 positions (blocks of 16 queries for the blocked kernel):
// each one's loss in the row equals its loss alone, and so do the gradients of their sum.
TEST_P(PackedLosses, EqualEachSampleRunAlone) {
  const fs::path dir = write_documents(fresh_dir("sft_loss_" + GetParam().plugin), {21, 14, 11}, 96);
  auto data = make_plugin<sdk::DataModule>(sdk::PluginKind::data, "data", "tokens",
                                           "path = \"" + dir.string() + "\"\nblock_size = 48\npacking = true\nval_fraction = 0\n");
  data->setup("fit");
  ASSERT_EQ(data->train_dataset()->size(), 1);
  const sdk::Batch packed = data->train_dataset()->get_batch({0});
  at::manual_seed(3);
  auto model = make_plugin<sdk::Module>(sdk::PluginKind::model, "model", GetParam().plugin, GetParam().model_toml);
  model->configure_model();
  const auto network = model->network();
  std::int64_t at = 0;
  for (std::int64_t length : {21, 14, 11}) {
    const std::int64_t n = length - 1;  // positions trained
    const sdk::Batch alone{packed.input.narrow(1, at, n).contiguous(), packed.target.narrow(1, at, n).contiguous()};
    const double in_row = loss_over(*model, packed, at, at + n);
    const double by_itself = model->training_step(alone, 0).loss.item<double>();
    EXPECT_NEAR(in_row, by_itself, 1e-5 * std::max(1.0, std::abs(by_itself))) << "sample at " << at;
    if (at > 0) {  // the check can fail: without its position ids the row attends across samples
      const double unpacked = loss_over(*model, sdk::Batch{packed.input, packed.target}, at, at + n);
      EXPECT_GT(std::abs(unpacked - by_itself), 1e-3) << "sample at " << at;
    }
    at += n;
  }
  // Gradients: the packed row's summed per-sample losses vs each sample's, summed.
  auto grads_of = [&](const std::function<at::Tensor()>& loss) {
    for (auto& p : network->parameters()) p.mutable_grad() = at::Tensor();
    loss().backward();
    std::vector<at::Tensor> g;
    for (auto& p : network->parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : at::zeros_like(p));
    return g;
  };
  const auto packed_grads = grads_of([&] {
    at::Tensor total = at::zeros({});
    std::int64_t begin = 0;
    for (std::int64_t length : {21, 14, 11}) {
      at::Tensor target = at::full_like(packed.target, -100);
      target.narrow(1, begin, length - 1).copy_(packed.target.narrow(1, begin, length - 1));
      total = total + model->training_step(sdk::Batch{packed.input, target, packed.position_ids}, 0).loss;
      begin += length - 1;
    }
    return total;
  });
  const auto separate_grads = grads_of([&] {
    at::Tensor total = at::zeros({});
    std::int64_t begin = 0;
    for (std::int64_t length : {21, 14, 11}) {
      total = total + model->training_step(sdk::Batch{packed.input.narrow(1, begin, length - 1).contiguous(),
                                                      packed.target.narrow(1, begin, length - 1).contiguous()},
                                           0)
                          .loss;
      begin += length - 1;
    }
    return total;
  });
  for (std::size_t i = 0; i < packed_grads.size(); ++i)
    EXPECT_LT((packed_grads[i] - separate_grads[i]).abs().max().item<double>(), 1e-5) << "parameter " << i;
  remove_dir(dir);
}

const std::string kLlama =
    "vocab_size = 96\nhidden_size = 32\nintermediate_size = 64\nnum_hidden_layers = 2\nnum_attention_heads = 4\n"
    "num_key_value_heads = 2\nmax_position_embeddings = 64\n";

INSTANTIATE_TEST_SUITE_P(
    Models, PackedLosses,
    ::testing::Values(PackedCase{"llama", kLlama + "attention = \"math\"\n"},
                      PackedCase{"llama", kLlama + "attention = \"blocked\"\nattention_query_block = 16\nfused_rotary = true\n"},
                      PackedCase{"gpt", "vocab_size = 96\nn_layer = 2\nn_head = 4\nn_embd = 32\nblock_size = 48\ndropout = 0.0\n"}),
    [](const auto& info) { return info.param.plugin + std::to_string(info.index); });

// --- the loss over the global batch's labels, through the binary ---------------------------------

/// 24 conversations whose answers differ in length, prepared with their loss masks: windows and
/// packed rows hold different numbers of labels, rank by rank and micro-batch by micro-batch.
fs::path prepared_chat(const fs::path& dir) {
  const fs::path tokenizer_dir = qwen_style_tokenizer(dir / "tokenizer");
  std::string lines;
  for (int i = 0; i < 24; ++i)
    lines += json{{"messages", {message("system", "S"), message("user", "q" + std::to_string(i)),
                                message("assistant", std::string(static_cast<std::size_t>(1 + (i * 7) % 29), 'a' + i % 5))}}}
                 .dump() +
             "\n";
  write(dir / "chat.jsonl", lines);
  const auto r = run_tessera("data prepare --format chat --tokenizer " + tokenizer_dir.string() + " --input " +
                             (dir / "chat.jsonl").string() + " --output " + (dir / "data").string() + " 2>&1");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return dir / "data";
}

struct LabelRun {
  std::map<std::int64_t, double> losses;
  std::map<std::string, at::Tensor> state;
};

/// Three SGD steps of a small llama from one seed; `world` ranks of `batch` samples each.
LabelRun fit_labels(const fs::path& data, const std::string& name, int world, int batch, const std::string& sets) {
  const std::string dir = fresh_dir("sft_labels_" + name);
  std::ofstream(dir + "/run.toml") << "[trainer]\nmax_steps = 3\nlog_every_n_steps = 1\nseed = 11\n"
                                   << "default_root_dir = \"" << dir << "\"\nenable_progress_bar = false\n"
                                   << "[optimizer]\nname = \"sgd\"\nlr = 1.0\nschedule = \"constant\"\n"
                                   << "[model]\nplugin = \"llama\"\nvocab_size = 264\nhidden_size = 32\n"
                                   << "intermediate_size = 64\nnum_hidden_layers = 1\nnum_attention_heads = 4\n"
                                   << "num_key_value_heads = 2\nmax_position_embeddings = 128\n"
                                   << "[data]\nplugin = \"tokens\"\npath = \"" << data.string()
                                   << "\"\nblock_size = 64\nval_fraction = 0\n";
  const auto r = run_tessera("fit --config " + dir + "/run.toml --set launch.devices=" + std::to_string(world) +
                                 " --set data.batch_size=" + std::to_string(batch) + " " + sets + " 2>&1",
                             "", 180);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  LabelRun run;
  if (r.exit_code != 0) return run;
  const std::string folder = tessera::testing::run_dir(dir);
  run.losses = tessera::testing::metric_series(folder + "/metrics.csv", "train", "train_loss");
  run.state = tessera::testing::checkpoint_state(folder + "/checkpoints/last.ckpt");
  remove_dir(dir);
  return run;
}

/// The largest difference between two runs' weights (infinity if they do not compare).
double weight_difference(const LabelRun& a, const LabelRun& b) {
  if (a.state.empty() || a.state.size() != b.state.size()) return std::numeric_limits<double>::infinity();
  double worst = 0;
  for (const auto& [name, t] : a.state) worst = std::max(worst, (t - b.state.at(name)).abs().max().item<double>());
  return worst;
}

// Masked chat rows hold different numbers of labels, so the mean of each rank's (or micro-batch's)
// mean is not the global batch's mean: [trainer] loss_average = "labels" (the default) weighs each
// micro-batch by its labels over the global batch's, so ddp and fsdp2 on 2 ranks and 2 accumulated
// micro-batches train what one device does on the whole batch, unpacked and packed (padding-free
// rows of different lengths); "micro_batches" (DDP's mean of means) is seen to differ.
TEST(LabelAverage, RanksAndMicroBatchesTrainWhatOneDeviceDoesOnTheGlobalBatch) {
  const fs::path dir = fresh_dir("sft_labels");
  const fs::path data = prepared_chat(dir);
  for (const std::string packing : {"false", "true"}) {
    SCOPED_TRACE("packing = " + packing);
    const std::string packed = " --set data.packing=" + packing;
    const LabelRun one = fit_labels(data, "one", 1, 4, "--set strategy.plugin=single_device" + packed);
    const LabelRun ddp = fit_labels(data, "ddp", 2, 2, "--set strategy.plugin=ddp" + packed);
    const LabelRun fsdp2 = fit_labels(data, "fsdp2", 2, 2, "--set strategy.plugin=fsdp2" + packed);
    const LabelRun accumulated =
        fit_labels(data, "accumulated", 1, 2, "--set strategy.plugin=single_device --set trainer.accumulate_grad_batches=2" + packed);
    ASSERT_EQ(one.losses.size(), 3u);
    for (const LabelRun* run : {&ddp, &fsdp2, &accumulated}) {
      ASSERT_EQ(run->losses.size(), 3u);
      for (const auto& [step, loss] : one.losses) EXPECT_NEAR(run->losses.at(step), loss, 1e-5) << "step " << step;
      EXPECT_LT(weight_difference(one, *run), 1e-5);
    }
    const LabelRun means = fit_labels(data, "means", 2, 2, "--set strategy.plugin=ddp --set trainer.loss_average=micro_batches" + packed);
    EXPECT_GT(weight_difference(one, means), 1e-4) << "the check above could not fail: every micro-batch holds as many labels";
  }
  remove_dir(dir);
}

TEST(ChatPredict, TheConversationIsRenderedWithTheGenerationPromptAndTheReplyEndsWithTheTurn) {
  const fs::path dir = fresh_dir("sft_predict");
  const fs::path tokenizer_dir = qwen_style_tokenizer(dir / "tokenizer");
  const json conversation = {{"messages", {message("user", "What is FSDP?")}}};
  write(dir / "conversation.json", conversation.dump());
  auto data = make_plugin<sdk::DataModule>(
      sdk::PluginKind::data, "data", "tokens",
      "path = \"" + (dir / "none").string() + "\"\ntokenizer = \"" + tokenizer_dir.string() +
          "\"\nprompt_messages = \"" + (dir / "conversation.json").string() + "\"\n");
  data->setup("predict");
  const sdk::Batch prompt = data->predict_dataset()->get_batch({0});
  const auto tokenizer = toolkit::load_tokenizer(tokenizer_dir);
  const std::string rendered = toolkit::ChatTemplate::load(tokenizer_dir).apply(conversation.dump(), true);
  EXPECT_NE(rendered.find("<|im_start|>assistant\n"), std::string::npos);
  const std::vector<toolkit::TokenId> expected = tokenizer->encode(rendered, false);
  ASSERT_EQ(prompt.input.size(1), static_cast<std::int64_t>(expected.size()));
  for (std::size_t t = 0; t < expected.size(); ++t) EXPECT_EQ(prompt.input[0][t].item<std::int64_t>(), expected[t]);
  // The model's output: the prompt, the reply, the end of the turn, then whatever followed.
  std::vector<toolkit::TokenId> reply = tokenizer->encode("Sharded training.", false);
  std::vector<std::int64_t> output(expected.begin(), expected.end());
  output.insert(output.end(), reply.begin(), reply.end());
  output.push_back(*tokenizer->eos_id());
  for (auto id : tokenizer->encode("<|im_start|>user\nmore", false)) output.push_back(id);
  EXPECT_EQ(data->describe_prediction(prompt, at::tensor(output).unsqueeze(0)), "Sharded training.");
  remove_dir(dir);
}

// Generation ends where transformers' generate() ends it: at config.json's eos_token_id and at the
// ids the generation_config.json beside it lists (where chat models name their end-of-turn token).
TEST(ChatPredict, GenerationStopsAtTheGenerationConfigsEosTokens) {
  const fs::path dir = fresh_dir("sft_generation_config");
  write(dir / "config.json", json{{"architectures", {"LlamaForCausalLM"}}, {"vocab_size", 96}, {"hidden_size", 32},
                                  {"intermediate_size", 64}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
                                  {"num_key_value_heads", 2}, {"max_position_embeddings", 64}}
                                 .dump());
  const std::string toml = "config = \"" + (dir / "config.json").string() + "\"\nmax_new_tokens = 6\ntemperature = 0\n";
  const at::Tensor prompt = at::arange(1, 9, at::kLong).unsqueeze(0);
  auto generate = [&] {
    at::manual_seed(5);
    auto model = make_plugin<sdk::Module>(sdk::PluginKind::model, "model", "llama", toml);
    model->configure_model();
    return model->predict_step(sdk::Batch{prompt, {}}, 0);
  };
  const at::Tensor free_run = generate();
  const std::int64_t first = free_run[0][8].item<std::int64_t>();
  ASSERT_NE(free_run.narrow(1, 9, 5).ne(0).sum().item<std::int64_t>(), 0) << "the check below could not fail";
  write(dir / "generation_config.json", json{{"eos_token_id", {95, first}}}.dump());
  const at::Tensor stopped = generate();
  EXPECT_EQ(stopped[0][8].item<std::int64_t>(), first);
  EXPECT_TRUE(stopped.narrow(1, 9, 5).eq(0).all().item<bool>()) << stopped;  // padded after the end of the turn
  write(dir / "generation_config.json", json{{"eos_token_id", 96}}.dump());
  try {
    generate();
    ADD_FAILURE() << "an eos_token_id past the vocabulary was accepted";
  } catch (const std::exception& e) {
    EXPECT_MENTIONS(std::string(e.what()), "generation_config.json: eos_token_id 96 is not a token id below vocab_size = 96");
  }
  remove_dir(dir);
}

}  // namespace
