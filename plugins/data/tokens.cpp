// `tokens`: language modelling over corpora prepared by `tessera data prepare` (token shards,
// memory-mapped), one directory or a weighted blend of several (Megatron's). Samples are windows
// of block_size + 1 tokens: packed across documents, one per document (document_aligned), or rows
// of whole documents each attending only to itself (packing). A prepared loss mask (chat data)
// turns the targets it does not train on into -100, which the loss ignores.
// Every dataset is an sdk::LargeDataset: the host's sampler shuffles it per index and reads ahead
// on a background thread, and nothing here holds an array that grows with the corpus (per-shard
// ranges only, and packing's one entry per row; the shards stay on disk, shared between the ranks
// through the page cache).
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <numeric>
#include <tuple>

#include <ATen/ATen.h>

#include "data.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/token_data.hpp"
#include "tessera/toolkit/chat_data.hpp"
#include "tessera/toolkit/chat_template.hpp"
#include "tessera/toolkit/token_shards.hpp"
#include "tessera/toolkit/tokenizer.hpp"

namespace tessera::data {

namespace {

namespace fs = std::filesystem;
using toolkit::TokenShards;

/// A run of whole documents of one shard: tokens [begin, end), documents [first, last).
struct Part {
  std::int64_t shard, begin, end, first, last;
};

/// The documents of one prepared directory that belong to one split.
struct Split {
  std::shared_ptr<TokenShards> shards;
  std::vector<Part> parts;  // one per shard at most
};

/// Reads `count` tokens from token `begin` of `shard` as a sample's input and targets: input[t] =
/// token t, target[t] = token t + 1, or -100 where the loss mask says token t + 1 is not a label.
/// `input` and `target` hold count - 1 positions.
void read_sample(const TokenShards& shards, std::int64_t shard, std::int64_t begin, std::int64_t count,
                 std::int64_t* input, std::int64_t* target, std::vector<std::int64_t>& ids, std::vector<std::uint8_t>& mask) {
  ids.resize(static_cast<std::size_t>(count));
  shards.read(shard, begin, count, ids.data());
  const bool masked = shards.manifest().has_mask();
  if (masked) {
    mask.resize(static_cast<std::size_t>(count));
    shards.read_mask(shard, begin, count, mask.data());
  }
  for (std::int64_t t = 0; t + 1 < count; ++t) {
    input[t] = ids[t];
    target[t] = !masked || mask[t + 1] ? ids[t + 1] : -100;
  }
}

/// Windows of block_size + 1 tokens over a split's token stream (its parts back to back), at
/// multiples of block_size: sample i is tokens [i * block, i * block + block + 1).
class PackedWindows final : public sdk::Dataset, public sdk::LargeDataset {
 public:
  PackedWindows(Split split, std::int64_t block) : split_(std::move(split)), block_(block) {
    std::int64_t total = 0;
    for (const auto& p : split_.parts) {
      starts_.push_back(total);
      total += p.end - p.begin;
    }
    total_ = total;
  }
  std::int64_t size() const override { return total_ <= block_ ? 0 : (total_ - 1) / block_; }
  sdk::Batch get_batch(const std::vector<std::int64_t>& indices) const override {
    const auto n = static_cast<std::int64_t>(indices.size());
    const bool masked = split_.shards && split_.shards->manifest().has_mask();
    at::Tensor windows = at::empty({n, block_ + 1}, at::kLong), labels;
    if (masked) labels = at::empty({n, block_ + 1}, at::kByte);
    std::int64_t* out = windows.data_ptr<std::int64_t>();
    for (std::int64_t row = 0; row < n; ++row) {
      const std::int64_t i = indices[row];
      TESSERA_CHECK(i >= 0 && i < size(), "tokens: sample index ", i, " is out of range [0, ", size(), ")");
      read(i * block_, block_ + 1, out + row * (block_ + 1),
           masked ? labels.data_ptr<std::uint8_t>() + row * (block_ + 1) : nullptr);
    }
    at::Tensor target = windows.narrow(1, 1, block_).contiguous();
    if (masked) target.masked_fill_(labels.narrow(1, 1, block_).eq(0), -100);  // context, not a label
    return sdk::Batch{windows.narrow(1, 0, block_).contiguous(), target};
  }

 private:
  void read(std::int64_t at, std::int64_t count, std::int64_t* out, std::uint8_t* mask) const {
    auto k = static_cast<std::size_t>(std::upper_bound(starts_.begin(), starts_.end(), at) - starts_.begin() - 1);
    while (count > 0) {
      const Part& p = split_.parts[k];
      const std::int64_t offset = at - starts_[k], take = std::min(count, p.end - p.begin - offset);
      split_.shards->read(p.shard, p.begin + offset, take, out);
      if (mask != nullptr) {
        split_.shards->read_mask(p.shard, p.begin + offset, take, mask);
        mask += take;
      }
      out += take;
      at += take;
      count -= take;
      ++k;
    }
  }

  Split split_;
  std::int64_t block_, total_ = 0;
  std::vector<std::int64_t> starts_;
};

/// One sample per document: its first block_size + 1 tokens; a shorter document is padded (the
/// input with EOS, the target with -100, which cross-entropy ignores).
class DocumentWindows final : public sdk::Dataset, public sdk::LargeDataset {
 public:
  DocumentWindows(Split split, std::int64_t block) : split_(std::move(split)), block_(block) {
    for (const auto& p : split_.parts) {
      starts_.push_back(documents_);
      documents_ += p.last - p.first;
    }
  }
  std::int64_t size() const override { return documents_; }
  sdk::Batch get_batch(const std::vector<std::int64_t>& indices) const override {
    const auto n = static_cast<std::int64_t>(indices.size());
    const std::int64_t eos = split_.shards->manifest().eos_id;
    at::Tensor input = at::full({n, block_}, eos, at::kLong), target = at::full({n, block_}, -100, at::kLong);
    std::vector<std::int64_t> ids;
    std::vector<std::uint8_t> mask;
    for (std::int64_t row = 0; row < n; ++row) {
      const std::int64_t i = indices[row];
      TESSERA_CHECK(i >= 0 && i < documents_, "tokens: sample index ", i, " is out of range [0, ", documents_, ")");
      auto k = static_cast<std::size_t>(std::upper_bound(starts_.begin(), starts_.end(), i) - starts_.begin() - 1);
      const Part& p = split_.parts[k];
      const std::int64_t d = p.first + (i - starts_[k]);
      const std::int64_t begin = split_.shards->document_start(p.shard, d);
      const std::int64_t length = std::min(split_.shards->document_start(p.shard, d + 1) - begin, block_ + 1);
      read_sample(*split_.shards, p.shard, begin, length, input[row].data_ptr<std::int64_t>(),
                  target[row].data_ptr<std::int64_t>(), ids, mask);
    }
    return sdk::Batch{input, target};
  }

 private:
  Split split_;
  std::int64_t block_, documents_ = 0;
  std::vector<std::int64_t> starts_;
};

/// Rows of block_size positions, each holding whole documents back to back (their first
/// block_size + 1 tokens; torchtune's PackedDataset without splitting a sample across rows),
/// filled in document order at setup: a row is closed when the next document does not fit. A
/// batch is its rows' documents end to end in one row [1, their positions] (Hugging Face's
/// DataCollatorWithFlattening: padding-free, no position is a pad), whose position_ids restart at
/// every document, so the model attends within each and a packed document's loss is the one it
/// has alone.
class PackedDocuments final : public sdk::Dataset, public sdk::LargeDataset {
 public:
  PackedDocuments(Split split, std::int64_t block) : split_(std::move(split)), block_(block) {
    for (std::size_t k = 0; k < split_.parts.size(); ++k) {
      const Part& p = split_.parts[k];
      std::int64_t used = block_;  // the open row's positions; full: none open
      for (std::int64_t d = p.first; d < p.last; ++d) {
        const std::int64_t positions = sample_tokens(p.shard, d) - 1;  // a sample of L tokens trains L - 1
        if (positions <= 0) continue;
        if (used + positions > block_) {
          rows_.push_back(Row{k, d, 0, 0});
          used = 0;
        }
        ++rows_.back().documents;
        rows_.back().positions += positions;
        used += positions;
      }
    }
  }
  std::int64_t size() const override { return static_cast<std::int64_t>(rows_.size()); }

  sdk::Batch get_batch(const std::vector<std::int64_t>& indices) const override {
    std::int64_t total = 0;
    for (std::int64_t i : indices) {
      TESSERA_CHECK(i >= 0 && i < size(), "tokens: sample index ", i, " is out of range [0, ", size(), ")");
      total += rows_[static_cast<std::size_t>(i)].positions;
    }
    at::Tensor input = at::empty({1, total}, at::kLong), target = at::empty({1, total}, at::kLong);
    at::Tensor positions = at::empty({1, total}, at::kLong);
    std::int64_t* in = input.data_ptr<std::int64_t>();
    std::int64_t* tg = target.data_ptr<std::int64_t>();
    std::int64_t* pos = positions.data_ptr<std::int64_t>();
    std::vector<std::int64_t> ids;
    std::vector<std::uint8_t> mask;
    std::int64_t at = 0;
    for (std::int64_t i : indices) {
      const Row& row = rows_[static_cast<std::size_t>(i)];
      const Part& p = split_.parts[row.part];
      for (std::int64_t d = row.first; d < row.first + row.documents; ++d) {
        const std::int64_t length = sample_tokens(p.shard, d);
        if (length <= 1) continue;  // trains nothing: left out when the rows were built
        read_sample(*split_.shards, p.shard, split_.shards->document_start(p.shard, d), length, in + at, tg + at, ids,
                    mask);
        for (std::int64_t t = 0; t + 1 < length; ++t) pos[at + t] = t;
        at += length - 1;
      }
    }
    return sdk::Batch{input, target, positions};
  }

 private:
  struct Row {
    std::size_t part;
    std::int64_t first, documents, positions;
  };
  /// A document's tokens as a sample: at most block_size + 1.
  std::int64_t sample_tokens(std::int64_t shard, std::int64_t d) const {
    return std::min(split_.shards->document_start(shard, d + 1) - split_.shards->document_start(shard, d), block_ + 1);
  }

  Split split_;
  std::int64_t block_;
  std::vector<Row> rows_;
};

/// Megatron's blend: the index space [0, sum of sizes) cut into one range per dataset in
/// proportion to its weight; a dataset smaller than its range repeats (upsampling), a larger
/// one is cut (downsampling). With the sampler's shuffle each batch draws from the datasets
/// in proportion to the weights; the mapping is per index, in O(number of datasets).
class Blend final : public sdk::Dataset, public sdk::LargeDataset {
 public:
  Blend(std::vector<std::shared_ptr<sdk::Dataset>> parts, const std::vector<double>& weights)
      : parts_(std::move(parts)) {
    std::int64_t total = 0;
    for (const auto& p : parts_) total += p->size();
    const double sum = std::accumulate(weights.begin(), weights.end(), 0.0);
    std::int64_t start = 0;
    for (std::size_t k = 0; k < parts_.size(); ++k) {
      starts_.push_back(start);
      start = k + 1 == parts_.size() ? total
                                     : start + static_cast<std::int64_t>(std::llround(static_cast<double>(total) *
                                                                                      weights[k] / sum));
    }
    total_ = total;
  }
  std::int64_t size() const override { return total_; }
  sdk::Batch get_batch(const std::vector<std::int64_t>& indices) const override {
    std::vector<sdk::Batch> rows;
    for (std::int64_t i : indices) {
      TESSERA_CHECK(i >= 0 && i < total_, "tokens: sample index ", i, " is out of range [0, ", total_, ")");
      auto k = static_cast<std::size_t>(std::upper_bound(starts_.begin(), starts_.end(), i) - starts_.begin() - 1);
      rows.push_back(parts_[k]->get_batch({(i - starts_[k]) % parts_[k]->size()}));
    }
    std::vector<at::Tensor> inputs, targets, positions;
    for (auto& r : rows) {
      inputs.push_back(r.input);
      targets.push_back(r.target);
      if (r.position_ids.defined()) positions.push_back(r.position_ids);
    }
    TESSERA_CHECK(positions.empty() || positions.size() == rows.size(), "tokens: a blend of packed and unpacked rows");
    // Packed rows come flattened, [1, positions]: they go on end to end (still padding-free).
    const std::int64_t dim = positions.empty() ? 0 : 1;
    return sdk::Batch{at::cat(inputs, dim), at::cat(targets, dim), positions.empty() ? at::Tensor() : at::cat(positions, dim)};
  }

 private:
  std::vector<std::shared_ptr<sdk::Dataset>> parts_;
  std::vector<std::int64_t> starts_;
  std::int64_t total_ = 0;
};

class Tokens final : public sdk::DataModule, public sdk::TokenVocabulary {
 public:
  explicit Tokens(const sdk::Options& o)
      : options_(o),
        paths_(o.get_string_list(
            {"path",
             "the directory `tessera data prepare` wrote, or a list of them (a blend, with weights); memory-mapped"},
            {})),
        weights_(o.get_double_list(
            {"weights", "one positive number per path (Megatron's blend): each directory's share of the samples"}, {})),
        val_paths_(o.get_string_list(
            {"val_path", "a separate prepared directory (or list) for validation instead of val_fraction"}, {})),
        tokenizer_path_(o.get_string({"tokenizer",
                                      "the tokenizer file: encodes the prompt and decodes predictions (checked against "
                                      "the manifest); not needed to train"},
                                     "")),
        block_size_(o.get_int({"block_size", "tokens per sample, at most the model's context"}, 128, 1)),
        document_aligned_(o.get_bool({"document_aligned",
                                      "one window per document from its first token (shorter ones padded) instead of "
                                      "windows packed across documents"},
                                     false)),
        packing_(o.get_bool({"packing",
                             "rows of whole documents back to back, each attending only to itself (position ids "
                             "restart at every document): short samples (chat data) fill rows instead of padding; a "
                             "batch is its rows end to end in one row [1, tokens], padding-free"},
                            false)),
        val_fraction_(o.get_double(
            {"val_fraction",
             "the validation split: the last floor(val_fraction x documents) documents of each shard (before the "
             "test split's); 0: none"},
            val_paths_.empty() ? 0.05 : 0.0, 0.0, 0.5)),
        test_paths_(o.get_string_list(
            {"test_path", "a separate prepared directory (or list) for `tessera test` instead of test_fraction"}, {})),
        test_fraction_(o.get_double({"test_fraction",
                                     "the test split (`tessera test`): the last floor(test_fraction x documents) "
                                     "documents of each shard, after the validation split's; 0: none"},
                                    0.0, 0.0, 0.5)),
        verify_(o.get_bool(
            {"verify", "at setup, check every shard's checksum, document offsets and largest id in one streaming pass"},
            true)),
        prompt_(
            o.get_string({"prompt", "the text predict (and predict_after_fit) generates from; needs tokenizer"}, "")),
        prompt_messages_(o.get_string(
            {"prompt_messages",
             "a JSON file with a conversation {\"messages\": [...]} that predict answers: rendered through the chat "
             "template of the tokenizer's folder with the generation prompt; prints the reply up to its end-of-turn "
             "token (`tessera predict --messages FILE` sets it)"},
            "")),
        accept_other_tokenizer_(o.get_bool(
            {"accept_other_tokenizer",
             "use [data] tokenizer although its file's xxh64 is not the one manifest.json records (a re-saved copy "
             "whose ids mean the same tokens)"},
            false)) {
    TESSERA_CHECK(!paths_.empty(), o.locate("path"), " is required: the directory `tessera data prepare` wrote ",
                  "(or several, with [data] weights)");
    if (!weights_.empty()) {
      TESSERA_CHECK(weights_.size() == paths_.size(), o.locate("weights"), " has ", weights_.size(),
                    " entries for ", paths_.size(), " directories in ", o.locate("path"), ": give one weight each");
      for (double w : weights_)
        TESSERA_CHECK(w > 0 && std::isfinite(w), o.locate("weights"), " holds ", w, ": weights must be positive");
    } else {
      TESSERA_CHECK(paths_.size() == 1, o.locate("path"), " names ", paths_.size(),
                    " directories: blending them needs [data] weights (one positive number each)");
      weights_ = {1.0};
    }
    TESSERA_CHECK(prompt_.empty() || prompt_messages_.empty(), o.locate("prompt"), " and ", o.locate("prompt_messages"),
                  " both give what predict continues: keep one");
    TESSERA_CHECK(!(packing_ && document_aligned_), o.locate("packing"), " and ", o.locate("document_aligned"),
                  " both choose how documents become samples: packing already starts every sample at a document; "
                  "keep one");
    TESSERA_CHECK(val_paths_.empty() || !o.has("val_fraction") || val_fraction_ == 0.0, o.locate("val_path"),
                  " and ", o.locate("val_fraction"), " both choose the validation data: keep one");
    TESSERA_CHECK(test_paths_.empty() || test_fraction_ == 0.0, o.locate("test_path"), " and ",
                  o.locate("test_fraction"), " both choose the test data: keep one");
    TESSERA_CHECK(val_fraction_ + test_fraction_ < 1.0, o.locate("val_fraction"), " = ", val_fraction_, " and ",
                  o.locate("test_fraction"), " = ", test_fraction_, " leave no document to train on");
  }

  void setup(const std::string& stage) override {
    if (stage == "predict") return setup_predict();
    // `tessera test` reports test_loss: from a test split, never the validation one.
    TESSERA_CHECK(stage != "test" || !test_paths_.empty() || test_fraction_ > 0, "tessera test evaluates the data's ",
                  "test split, and the tokens plugin has none here: set ",
                  options_.locate("test_fraction"), " (e.g. 0.05: the last 5% of each shard's documents, held out ",
                  "from training and validation) or ", options_.locate("test_path"), " (a prepared directory); ",
                  "for the validation split's loss run `tessera validate`");
    if (train_) return;
    std::vector<std::shared_ptr<sdk::Dataset>> train, val, test;
    for (const auto& path : paths_) {
      auto shards = open(path, "path");
      auto [t, v, h] = split(shards);
      train.push_back(windows(std::move(t)));
      TESSERA_CHECK(train.back()->size() > 0, options_.locate("path"), " = \"", path, "\": its training part holds ",
                    "too few tokens for one window of block_size + 1 = ", block_size_ + 1);
      if (val_paths_.empty() && val_fraction_ > 0) val.push_back(windows(std::move(v)));
      if (test_paths_.empty() && test_fraction_ > 0) test.push_back(windows(std::move(h)));
    }
    for (const auto& path : test_paths_) {
      auto shards = open(path, "test_path");
      test.push_back(windows(Split{shards, whole(shards)}));
    }
    if (!test.empty()) {
      std::vector<double> sizes;
      for (const auto& d : test) sizes.push_back(static_cast<double>(std::max<std::int64_t>(1, d->size())));
      test_ = test.size() == 1 ? test[0] : std::make_shared<Blend>(test, sizes);
      TESSERA_CHECK(test_->size() > 0,
                    test_paths_.empty() ? options_.locate("test_fraction") + " = " + std::to_string(test_fraction_)
                                        : options_.locate("test_path"),
                    " leaves no test window of block_size + 1 = ", block_size_ + 1,
                    " tokens (the test split takes whole documents from the end of each shard): raise it");
    }
    for (const auto& path : val_paths_) {
      auto shards = open(path, "val_path");
      val.push_back(windows(Split{shards, whole(shards)}));
    }
    train_ = train.size() == 1 ? train[0] : std::make_shared<Blend>(train, weights_);
    if (!val.empty()) {
      val.erase(std::remove_if(val.begin(), val.end(), [](const auto& v) { return v->size() == 0; }), val.end());
      if (val.empty()) val.push_back(std::make_shared<PackedWindows>(Split{}, block_size_));  // refused below
      std::vector<double> sizes;
      for (const auto& v : val) sizes.push_back(static_cast<double>(std::max<std::int64_t>(1, v->size())));
      val_ = val.size() == 1 ? val[0] : std::make_shared<Blend>(val, sizes);  // all of each, back to back
      TESSERA_CHECK(val_->size() > 0,
                    val_paths_.empty() ? options_.locate("val_fraction") + " = " + std::to_string(val_fraction_)
                                       : options_.locate("val_path"),
                    " leaves no validation window of block_size + 1 = ", block_size_ + 1,
                    " tokens (the validation split takes whole documents from the end of each shard): raise it, ",
                    "or set val_fraction = 0");
    }
    if (!tokenizer_path_.empty()) load_tokenizer();
  }

  std::shared_ptr<sdk::Dataset> train_dataset() override { return train_; }
  std::shared_ptr<sdk::Dataset> val_dataset() override { return val_; }
  std::shared_ptr<sdk::Dataset> test_dataset() override { return test_; }
  std::shared_ptr<sdk::Dataset> predict_dataset() override { return prompt_dataset_; }

  std::string describe_prediction(const sdk::Batch& batch, const at::Tensor& output) const override {
    at::Tensor ids = output.to(at::kLong).cpu().contiguous();
    if (ids.dim() < 2) ids = ids.reshape({1, -1});
    std::string text;
    for (std::int64_t row = 0; row < ids.size(0); ++row) {
      if (row > 0) text += "\n---\n";
      const std::int64_t* p = ids[row].data_ptr<std::int64_t>();
      std::vector<toolkit::TokenId> tokens(p, p + ids.size(1));
      if (!prompt_messages_.empty() && tokenizer_ && ids.size(1) >= batch.input.size(1)) {
        // A chat reply: what follows the rendered prompt, up to the end of the assistant's turn.
        tokens.erase(tokens.begin(), tokens.begin() + batch.input.size(1));
        const auto eos = tokenizer_->eos_id();
        if (eos) tokens.erase(std::find(tokens.begin(), tokens.end(), *eos), tokens.end());
      }
      text += tokenizer_ ? tokenizer_->decode(tokens, /*skip_special_tokens=*/true) : ids_text(tokens);
    }
    return text;
  }
  std::string item_unit() const override { return "tokens"; }

  std::int64_t vocab_size() const override { return vocab_size_; }
  std::string vocab_source() const override { return vocab_source_; }

 private:
  std::shared_ptr<TokenShards> open(const std::string& path, const std::string& key) {
    std::error_code ec;
    TESSERA_CHECK(fs::is_directory(path, ec), options_.locate(key), " = \"", path,
                  "\": no such directory; prepare one with `tessera data prepare --tokenizer T --input FILES --output ",
                  path, "`");
    auto shards = std::make_shared<TokenShards>(path, verify_);
    const auto& m = shards->manifest();
    if (vocab_size_ == 0) {
      vocab_size_ = m.vocab_size;
      vocab_source_ = (fs::path(path) / toolkit::kManifestName).string();
      tokenizer_kind_ = m.tokenizer_kind;
      tokenizer_xxh64_ = m.tokenizer_xxh64;
    }
    TESSERA_CHECK(m.vocab_size == vocab_size_ && m.tokenizer_kind == tokenizer_kind_, (fs::path(path) / toolkit::kManifestName),
                  " was prepared with a ", m.tokenizer_kind, " tokenizer of ", m.vocab_size, " ids, ", vocab_source_,
                  " with a ", tokenizer_kind_, " one of ", vocab_size_, ": every directory of a job must share one tokenizer");
    return shards;
  }

  std::vector<Part> whole(const std::shared_ptr<TokenShards>& shards) const {
    std::vector<Part> parts;
    for (std::int64_t s = 0; s < shards->shards(); ++s)
      if (shards->documents(s) > 0) parts.push_back(Part{s, 0, shards->tokens(s), 0, shards->documents(s)});
    return parts;
  }

  /// By documents: of each shard's documents, the last test_fraction (rounded down) test, the
  /// val_fraction before them validate, the rest train.
  std::tuple<Split, Split, Split> split(const std::shared_ptr<TokenShards>& shards) const {
    Split train{shards, {}}, val{shards, {}}, test{shards, {}};
    auto count = [](double fraction, std::int64_t docs) {
      return static_cast<std::int64_t>(std::floor(fraction * static_cast<double>(docs)));
    };
    for (std::int64_t s = 0; s < shards->shards(); ++s) {
      const std::int64_t docs = shards->documents(s);
      const std::int64_t tested = test_paths_.empty() ? count(test_fraction_, docs) : 0;
      const std::int64_t held = val_paths_.empty() ? count(val_fraction_, docs) : 0;
      const std::int64_t val_first = docs - tested - held, test_first = docs - tested;
      const std::int64_t cut = shards->document_start(s, val_first), test_cut = shards->document_start(s, test_first);
      if (val_first > 0) train.parts.push_back(Part{s, 0, cut, 0, val_first});
      if (held > 0) val.parts.push_back(Part{s, cut, test_cut, val_first, test_first});
      if (tested > 0) test.parts.push_back(Part{s, test_cut, shards->tokens(s), test_first, docs});
    }
    return {std::move(train), std::move(val), std::move(test)};
  }

  std::shared_ptr<sdk::Dataset> windows(Split split) const {
    if (packing_) return std::make_shared<PackedDocuments>(std::move(split), block_size_);
    if (document_aligned_) return std::make_shared<DocumentWindows>(std::move(split), block_size_);
    return std::make_shared<PackedWindows>(std::move(split), block_size_);
  }

  void load_tokenizer() {
    if (tokenizer_) return;
    tokenizer_ = toolkit::load_tokenizer(tokenizer_path_);
    if (vocab_size_ == 0) return;  // predict without the corpus: nothing to compare with
    TESSERA_CHECK(tokenizer_->kind() == tokenizer_kind_ && tokenizer_->vocab_size() == vocab_size_,
                  options_.locate("tokenizer"), " = \"", tokenizer_path_, "\" is a ", tokenizer_->kind(),
                  " tokenizer of ", tokenizer_->vocab_size(), " ids, but ", vocab_source_, " was prepared with a ",
                  tokenizer_kind_, " one of ", vocab_size_, ": give the tokenizer the data was prepared with");
    // Same kind and size is not the same tokenizer: prompts would be encoded and samples decoded
    // with other ids. The manifest records the file's hash (none for one prepared from a folder).
    if (tokenizer_xxh64_.empty() || accept_other_tokenizer_) return;
    fs::path file = tokenizer_path_;
    std::error_code ec;
    if (fs::is_directory(file, ec))  // load_tokenizer's order
      for (const char* name : {"tokenizer.json", "tokenizer.model"})
        if (fs::is_regular_file(fs::path(tokenizer_path_) / name, ec)) {
          file = fs::path(tokenizer_path_) / name;
          break;
        }
    const std::string hash = toolkit::xxh64_file(file);
    TESSERA_CHECK(hash == tokenizer_xxh64_, options_.locate("tokenizer"), " = \"", tokenizer_path_, "\": ", file.string(),
                  " has xxh64 ", hash, ", but ", vocab_source_, " records ", tokenizer_xxh64_, " for the tokenizer the ",
                  "data was prepared with: its ids may mean other tokens. Give that tokenizer, or set ",
                  options_.locate("accept_other_tokenizer"), " = true if this file holds the same vocabulary (a re-saved copy)");
  }

  void setup_predict() {
    if (prompt_dataset_) return;
    TESSERA_CHECK(!prompt_.empty() || !prompt_messages_.empty(), options_.locate("prompt"),
                  " is needed by predict: the text generation starts from (or ", options_.locate("prompt_messages"),
                  ": a conversation to answer)");
    TESSERA_CHECK(!tokenizer_path_.empty(), options_.locate("tokenizer"),
                  " is needed by predict: the tokenizer file that turns [data] prompt into ids and the generated ids "
                  "back into text");
    // The manifest, when the corpus is there, names the vocabulary the model is checked against.
    std::error_code ec;
    if (fs::is_regular_file(fs::path(paths_[0]) / toolkit::kManifestName, ec)) {
      const auto m = toolkit::read_manifest(paths_[0]);
      vocab_size_ = m.vocab_size;
      vocab_source_ = (fs::path(paths_[0]) / toolkit::kManifestName).string();
      tokenizer_kind_ = m.tokenizer_kind;
      tokenizer_xxh64_ = m.tokenizer_xxh64;
    }
    load_tokenizer();
    if (vocab_size_ == 0) {
      vocab_size_ = tokenizer_->vocab_size();
      vocab_source_ = tokenizer_path_;
    }
    std::vector<toolkit::TokenId> ids;
    if (!prompt_messages_.empty()) {
      ids = chat_prompt();
    } else {
      ids = tokenizer_->encode(prompt_, /*add_special_tokens=*/false);
      TESSERA_CHECK(!ids.empty(), options_.locate("prompt"), " = \"", prompt_, "\" encodes to no token");
    }
    prompt_dataset_ = std::make_shared<PromptDataset>(
        at::tensor(std::vector<std::int64_t>(ids.begin(), ids.end()), at::kLong).unsqueeze(0));
  }

  /// [data] prompt_messages rendered with the generation prompt by the tokenizer folder's template.
  std::vector<toolkit::TokenId> chat_prompt() const {
    std::ifstream in(prompt_messages_, std::ios::binary);
    TESSERA_CHECK(in, options_.locate("prompt_messages"), " = \"", prompt_messages_, "\": cannot read the file");
    const std::string conversation((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    try {
      const auto chat_template = toolkit::ChatTemplate::load(tokenizer_path_);  // a file: its folder's
      return toolkit::encode_chat_prompt(chat_template, *tokenizer_, conversation);
    } catch (const std::exception& e) {
      TESSERA_FAIL(options_.locate("prompt_messages"), " = \"", prompt_messages_, "\": ", e.what());
    }
  }

  static std::string ids_text(const std::vector<toolkit::TokenId>& ids) {
    std::string text = "token ids (no [data] tokenizer to decode them):";
    for (auto id : ids) text += " " + std::to_string(id);
    return text;
  }

  sdk::Options options_;
  std::vector<std::string> paths_;
  std::vector<double> weights_;
  std::vector<std::string> val_paths_;
  std::string tokenizer_path_;
  std::int64_t block_size_;
  bool document_aligned_;
  bool packing_;
  double val_fraction_;
  std::vector<std::string> test_paths_;
  double test_fraction_;
  bool verify_;
  std::string prompt_;
  std::string prompt_messages_;
  bool accept_other_tokenizer_;
  std::int64_t vocab_size_ = 0;
  std::string vocab_source_, tokenizer_kind_, tokenizer_xxh64_;
  std::unique_ptr<toolkit::Tokenizer> tokenizer_;
  std::shared_ptr<sdk::Dataset> train_, val_, test_, prompt_dataset_;
};

}  // namespace

sdk::PluginEntry tokens_entry() {
  return sdk::plugin_entry<Tokens>("tokens",
                                   "token shards written by `tessera data prepare`, memory-mapped (one directory or a blend)");
}

}  // namespace tessera::data
