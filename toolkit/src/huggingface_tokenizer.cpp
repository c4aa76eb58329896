// Hugging Face tokenizer.json with a BPE model, following the Rust `tokenizers` crate step for
// step (added-token extraction, normalizer, pre-tokenizer, BPE, post-processor; decoders), so
// ids equal the reference library's. Each component reads its JSON strictly: a type or key we
// do not implement is refused by its JSON path, never skipped. The BPE model, added tokens and
// post-processing are here; normalizers, pre-tokenizers and decoders in hf_components.cpp.
#include <algorithm>
#include <atomic>
#include <optional>
#include <queue>
#include <set>
#include <unordered_map>

#include "hf_tokenizer_parts.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/toolkit/tokenizer.hpp"
#include "utf8.hpp"

namespace tessera::toolkit {
namespace {

using namespace hf;

// ---------------------------------------------------------------------------------------------
// The BPE model.

class Bpe {
 public:
  Bpe(const json& spec, const Where& where) : cache_id_(next_cache_id_++) {
    check_keys(spec, {"type", "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk",
                      "byte_fallback", "ignore_merges", "vocab", "merges"},
               where);
    const json* dropout = spec.contains("dropout") ? &spec.at("dropout") : nullptr;
    TESSERA_CHECK(dropout == nullptr || dropout->is_null() || dropout->get<double>() == 0.0, "Hugging Face tokenizer ",
                  where.at("dropout").str(),
                  " is set: BPE dropout (random merges, for training-time regularization) is not supported; set it "
                  "to null");
    unk_token_ = get_or<std::string>(spec, "unk_token", "");
    has_unk_ = spec.contains("unk_token") && !spec.at("unk_token").is_null();
    prefix_ = get_or<std::string>(spec, "continuing_subword_prefix", "");
    suffix_ = get_or<std::string>(spec, "end_of_word_suffix", "");
    fuse_unk_ = get_or(spec, "fuse_unk", false);
    byte_fallback_ = get_or(spec, "byte_fallback", false);
    ignore_merges_ = get_or(spec, "ignore_merges", false);

    const auto& vocab = require(spec, "vocab", where);
    TESSERA_CHECK(vocab.is_object(), "Hugging Face tokenizer ", where.at("vocab").str(), " is not an object");
    vocab_.reserve(vocab.size());
    // Ids number the vocabulary from 0 (every trainer writes them so): a decoding table of one
    // entry per id, and a file cannot make it larger than itself (libFuzzer: an id of 584379214
    // in a 3-token vocabulary asked for 18 GB).
    const std::int64_t entries = static_cast<std::int64_t>(vocab.size());
    // An empty vocabulary encodes every text to nothing; two tokens of one id decode as whichever
    // came last (the tokenizers library keeps the last too, but no trainer writes either).
    TESSERA_CHECK(entries > 0, "Hugging Face tokenizer ", where.at("vocab").str(),
                  " is empty: a BPE model needs its tokens, numbered from 0");
    std::vector<bool> taken(static_cast<std::size_t>(entries), false);
    for (const auto& [token, id] : vocab.items()) {
      const std::int64_t value = integer_in(id, 0, std::max<std::int64_t>(0, entries - 1), where.at("vocab").at(token));
      TESSERA_CHECK(!taken[value], "Hugging Face tokenizer ", where.at("vocab").at(token).str(), ": id ", value,
                    " is also ", json(id_to_token_[value]).dump(), "'s: every token of the vocab needs its own id");
      taken[value] = true;
      vocab_[token] = static_cast<TokenId>(value);
      if (static_cast<std::size_t>(value) >= id_to_token_.size()) id_to_token_.resize(value + 1);
      id_to_token_[value] = token;
    }
    if (byte_fallback_) {
      for (int b = 0; b < 256; ++b) {
        char code[8];
        std::snprintf(code, sizeof code, "<0x%02X>", b);
        const auto it = vocab_.find(code);
        byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
      }
    }
    if (has_unk_) {
      const auto it = vocab_.find(unk_token_);
      unk_id_ = it == vocab_.end() ? -1 : it->second;
    }

    const auto& merges = require(spec, "merges", where);
    merges_.reserve(merges.size());
    for (std::size_t rank = 0; rank < merges.size(); ++rank) {
      const auto& merge = merges[rank];
      std::string a, b;
      if (merge.is_string()) {  // "a b"
        const auto s = merge.get<std::string>();
        const auto space = s.find(' ');
        TESSERA_CHECK(space != std::string::npos && s.find(' ', space + 1) == std::string::npos,
                      "Hugging Face tokenizer ", where.at("merges").at(rank).str(), " is not \"a b\": ", merge.dump());
        a = s.substr(0, space);
        b = s.substr(space + 1);
      } else {  // ["a", "b"]
        TESSERA_CHECK(merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string(),
                      "Hugging Face tokenizer ", where.at("merges").at(rank).str(), " is not [\"a\", \"b\"]: ",
                      merge.dump());
        a = merge[0].get<std::string>();
        b = merge[1].get<std::string>();
      }
      const std::string joined = a + b.substr(std::min(prefix_.size(), b.size()));
      const auto ia = vocab_.find(a), ib = vocab_.find(b), ij = vocab_.find(joined);
      TESSERA_CHECK(ia != vocab_.end() && ib != vocab_.end() && ij != vocab_.end(), "Hugging Face tokenizer ",
                    where.at("merges").at(rank).str(), ": merge ", merge.dump(), " names a token not in the vocab");
      merges_[pair_key(ia->second, ib->second)] = {static_cast<std::uint32_t>(rank), ij->second};
    }
  }

  /// Appends the ids of one pre-tokenized word.
  void tokenize(const std::string& word, std::vector<TokenId>& out) const {
    if (word.empty()) return;
    if (ignore_merges_) {
      const auto it = vocab_.find(word);
      if (it != vocab_.end()) {
        out.push_back(it->second);
        return;
      }
    }
    // Per-thread cache (as the crate keeps one): no locks on the hot path of `data prepare`.
    thread_local Cache cache;
    if (cache.owner != cache_id_) {
      cache.words.clear();
      cache.owner = cache_id_;
    }
    const auto hit = cache.words.find(word);
    if (hit != cache.words.end()) {
      out.insert(out.end(), hit->second.begin(), hit->second.end());
      return;
    }
    std::vector<TokenId> ids = merge_word(word);
    out.insert(out.end(), ids.begin(), ids.end());
    if (word.size() < kMaxCachedLength && cache.words.size() < kCacheCapacity) cache.words.emplace(word, std::move(ids));
  }

  const std::vector<std::string>& id_to_token() const { return id_to_token_; }
  std::optional<TokenId> token_id(const std::string& token) const {
    const auto it = vocab_.find(token);
    return it == vocab_.end() ? std::nullopt : std::optional<TokenId>(it->second);
  }

 private:
  struct Cache {
    std::uint64_t owner = 0;
    std::unordered_map<std::string, std::vector<TokenId>> words;
  };
  static constexpr std::size_t kCacheCapacity = 1 << 16;
  static constexpr std::size_t kMaxCachedLength = 256;
  struct Symbol {
    TokenId id;
    int prev, next;
    bool removed;
  };
  struct Merge {
    std::uint32_t rank;
    TokenId new_id;
  };
  struct Candidate {
    std::size_t pos;
    std::uint32_t rank;
    TokenId new_id;
    bool operator<(const Candidate& other) const {  // max-heap order: lowest rank, then leftmost, on top
      return rank != other.rank ? rank > other.rank : pos > other.pos;
    }
  };
  static std::uint64_t pair_key(TokenId a, TokenId b) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
  }

  // The crate's BPE::merge_word + Word::merge_all.
  std::vector<TokenId> merge_word(const std::string& word) const {
    std::vector<TokenId> initial;
    std::optional<TokenId> unk;
    std::string key;
    for (std::size_t i = 0; i < word.size();) {
      const std::size_t n = std::min(utf8_length(static_cast<unsigned char>(word[i])), word.size() - i);
      const bool first = i == 0, last = i + n == word.size();
      key.clear();
      if (!first) key += prefix_;
      key.append(word, i, n);
      if (last) key += suffix_;
      i += n;
      const auto it = vocab_.find(key);
      if (it != vocab_.end()) {
        if (unk) initial.push_back(*std::exchange(unk, std::nullopt));
        initial.push_back(it->second);
        continue;
      }
      if (byte_fallback_) {
        const bool all = std::all_of(key.begin(), key.end(), [&](char c) { return byte_ids_[static_cast<unsigned char>(c)] >= 0; });
        if (all) {
          for (const char c : key) initial.push_back(byte_ids_[static_cast<unsigned char>(c)]);
          continue;
        }
      }
      if (has_unk_) {
        TESSERA_CHECK(unk_id_ >= 0, "the unk_token ", json(unk_token_).dump(), " is not in the vocab");
        if (unk && !fuse_unk_) initial.push_back(*unk);
        unk = unk_id_;
      }
      // Without an unk_token the crate drops a character it cannot represent; so do we.
    }
    if (unk) initial.push_back(*unk);

    std::vector<Symbol> symbols(initial.size());
    for (std::size_t i = 0; i < initial.size(); ++i) {
      symbols[i] = {initial[i], static_cast<int>(i) - 1,
                    i + 1 < initial.size() ? static_cast<int>(i) + 1 : -1, false};
    }
    std::priority_queue<Candidate> queue;
    for (std::size_t i = 0; i + 1 < symbols.size(); ++i) {
      const auto it = merges_.find(pair_key(symbols[i].id, symbols[i + 1].id));
      if (it != merges_.end()) queue.push({i, it->second.rank, it->second.new_id});
    }
    while (!queue.empty()) {
      const Candidate top = queue.top();
      queue.pop();
      Symbol& left = symbols[top.pos];
      if (left.removed || left.next == -1) continue;
      const int next_pos = left.next;
      const Symbol right = symbols[next_pos];
      const auto current = merges_.find(pair_key(left.id, right.id));
      if (current == merges_.end() || current->second.new_id != top.new_id) continue;  // stale entry
      left.id = top.new_id;
      left.next = right.next;
      symbols[next_pos].removed = true;
      if (right.next >= 0) symbols[right.next].prev = static_cast<int>(top.pos);
      if (left.prev >= 0) {
        const auto it = merges_.find(pair_key(symbols[left.prev].id, left.id));
        if (it != merges_.end()) queue.push({static_cast<std::size_t>(left.prev), it->second.rank, it->second.new_id});
      }
      if (left.next >= 0) {
        const auto it = merges_.find(pair_key(left.id, symbols[left.next].id));
        if (it != merges_.end()) queue.push({top.pos, it->second.rank, it->second.new_id});
      }
    }
    std::vector<TokenId> ids;
    ids.reserve(symbols.size());
    for (const auto& s : symbols) {
      if (!s.removed) ids.push_back(s.id);
    }
    return ids;
  }

  static inline std::atomic<std::uint64_t> next_cache_id_{1};
  std::uint64_t cache_id_;
  std::unordered_map<std::string, TokenId> vocab_;
  std::vector<std::string> id_to_token_;
  std::unordered_map<std::uint64_t, Merge> merges_;
  std::string unk_token_, prefix_, suffix_;
  bool has_unk_ = false, fuse_unk_ = false, byte_fallback_ = false, ignore_merges_ = false;
  TokenId unk_id_ = -1;
  TokenId byte_ids_[256];
};

// ---------------------------------------------------------------------------------------------
// Added tokens: matched in the text before normalization (normalized=false) or in each
// normalized piece (normalized=true), leftmost-longest, as the crate's AddedVocabulary does.

struct AddedToken {
  std::string content;
  TokenId id;
  bool special, single_word, lstrip, rstrip, normalized;
};

class AddedMatcher {
 public:
  void add(std::string pattern, std::size_t token) {
    if (pattern.empty()) return;
    by_first_byte_[static_cast<unsigned char>(pattern[0])].emplace_back(std::move(pattern), token);
  }
  void finish() {
    for (auto& list : by_first_byte_) {
      std::stable_sort(list.begin(), list.end(), [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
    }
  }
  bool empty() const {
    return std::all_of(std::begin(by_first_byte_), std::end(by_first_byte_), [](const auto& l) { return l.empty(); });
  }
  /// Leftmost-longest non-overlapping matches: (start, end, token index).
  std::vector<std::tuple<std::size_t, std::size_t, std::size_t>> find(std::string_view text) const {
    std::vector<std::tuple<std::size_t, std::size_t, std::size_t>> found;
    for (std::size_t i = 0; i < text.size();) {
      const auto& candidates = by_first_byte_[static_cast<unsigned char>(text[i])];
      bool matched = false;
      for (const auto& [pattern, token] : candidates) {  // longest first
        if (text.compare(i, pattern.size(), pattern) == 0) {
          found.emplace_back(i, i + pattern.size(), token);
          i += pattern.size();
          matched = true;
          break;
        }
      }
      if (!matched) ++i;
    }
    return found;
  }

 private:
  std::vector<std::pair<std::string, std::size_t>> by_first_byte_[256];
};

// Unicode \w and \s at the edges of a string, for single_word / lstrip / rstrip.
struct EdgeRegexes {
  Regex starts_with_word, ends_with_word, space_at_start, space_at_end;
  explicit EdgeRegexes(const Where& where)
      : starts_with_word(R"(^\w)", where),
        ends_with_word(R"(\w$)", where),
        space_at_start(R"(^\s*)", where),
        space_at_end(R"(\s*$)", where) {}
};

// ---------------------------------------------------------------------------------------------

struct TemplatePiece {
  bool is_sequence;
  std::vector<TokenId> ids;  // the special token's ids
};

class HuggingFaceTokenizer final : public Tokenizer {
 public:
  HuggingFaceTokenizer(const json& root, const std::string& source, std::string_view config_json)
      : source_(source), edges_(Where{source_, "added_tokens"}) {
    const Where top{source_, ""};
    check_keys(root, {"version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer", "model",
                      "post_processor", "decoder"},
               top);
    for (const char* key : {"truncation", "padding"}) {
      TESSERA_CHECK(!root.contains(key) || root.at(key).is_null(), "Hugging Face tokenizer ", top.at(key).str(),
                    " is set: Tessera encodes whole documents without truncation or padding; set it to null");
    }
    const auto& model = require(root, "model", top);
    const std::string type = model.contains("type") ? model.at("type").get<std::string>()
                             : model.contains("merges") ? "BPE"
                                                        : "(untyped)";
    TESSERA_CHECK(type == "BPE", "Hugging Face tokenizer ", top.at("model.type").str(), " is \"", type,
                  "\": only BPE models are supported (SentencePiece-based Unigram files load from their "
                  "tokenizer.model instead)");
    bpe_.emplace(model, top.at("model"));
    if (root.contains("normalizer") && !root.at("normalizer").is_null()) {
      normalizer_ = make_normalizer(root.at("normalizer"), top.at("normalizer"));
    }
    if (root.contains("pre_tokenizer") && !root.at("pre_tokenizer").is_null()) {
      pre_tokenizer_ = make_pre_tokenizer(root.at("pre_tokenizer"), top.at("pre_tokenizer"));
    }
    if (root.contains("decoder") && !root.at("decoder").is_null()) {
      decoder_ = make_decoder(root.at("decoder"), top.at("decoder"));
    }
    vocab_size_ = static_cast<std::int64_t>(bpe_->id_to_token().size());
    read_added_tokens(root, top);
    if (root.contains("post_processor") && !root.at("post_processor").is_null()) {
      read_post_processor(root.at("post_processor"), top.at("post_processor"));
    }
    read_special_ids(config_json);
  }

  std::vector<TokenId> encode(std::string_view text, bool add_special_tokens) const override {
    check_utf8(text, source_);
    std::vector<TokenId> ids;
    ids.reserve(text.size() / 3 + 4);
    if (add_special_tokens) append_template(ids, true);
    // 1. Added tokens that match the raw text.
    for (const auto& [segment, token] : split_added(text, raw_matcher_)) {
      if (token) {
        ids.push_back(added_[*token].id);
        continue;
      }
      // 2. Normalize the rest, then match the normalized added tokens in it.
      std::string normalized(segment.text);
      if (normalizer_) normalizer_->apply(normalized);
      for (const auto& [piece, inner] : split_added(normalized, normalized_matcher_)) {
        if (inner) {
          ids.push_back(added_[*inner].id);
          continue;
        }
        // 3. Pre-tokenize into words, 4. BPE each word.
        std::vector<Piece> words{{std::string(piece.text), segment.at_start && piece.at_start}};
        if (pre_tokenizer_) pre_tokenizer_->apply(words);
        for (const auto& word : words) bpe_->tokenize(word.text, ids);
      }
    }
    if (add_special_tokens) append_template(ids, false);
    return ids;
  }

  std::string decode(const std::vector<TokenId>& ids, bool skip_special_tokens) const override {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    const auto& model_tokens = bpe_->id_to_token();
    for (const TokenId id : ids) {
      TESSERA_CHECK(id >= 0 && id < vocab_size_, "token id ", id, " is outside Hugging Face tokenizer ", source_,
                    "'s vocabulary [0, ", vocab_size_, ")");
      const auto added = added_by_id_.find(id);
      if (added != added_by_id_.end()) {
        const AddedToken& token = added_[added->second];
        if (skip_special_tokens && special_contents_.count(token.content) > 0) continue;
        tokens.push_back(token.content);
      } else if (static_cast<std::size_t>(id) < model_tokens.size() && !model_tokens[id].empty()) {
        if (skip_special_tokens && special_contents_.count(model_tokens[id]) > 0) continue;
        tokens.push_back(model_tokens[id]);
      }
      // An id in range with no token (a hole in the vocab) is dropped, as the crate does.
    }
    if (!decoder_) return sdk::join(tokens, " ");
    std::string text;
    for (const auto& piece : decoder_->decode_chain(std::move(tokens))) text += piece;
    return text;
  }

  std::int64_t vocab_size() const override { return vocab_size_; }
  std::optional<TokenId> bos_id() const override { return bos_; }
  std::optional<TokenId> eos_id() const override { return eos_; }
  std::optional<TokenId> pad_id() const override { return pad_; }
  std::vector<std::string> special_tokens() const override {
    std::vector<std::string> out;
    for (const auto& token : added_) {
      if (token.special) out.push_back(token.content);
    }
    return out;
  }
  std::string kind() const override { return "huggingface"; }

 private:
  struct Segment {
    std::string_view text;
    bool at_start;
  };

  // The crate's AddedVocabulary::find_matches: the text as segments, each plain or one added token.
  std::vector<std::pair<Segment, std::optional<std::size_t>>> split_added(std::string_view text,
                                                                          const AddedMatcher& matcher) const {
    std::vector<std::pair<Segment, std::optional<std::size_t>>> out;
    if (text.empty() || matcher.empty()) {
      out.push_back({{text, true}, std::nullopt});
      return out;
    }
    std::size_t start_offset = 0;
    for (auto [start, stop, index] : matcher.find(text)) {
      const AddedToken& token = added_[index];
      if (token.single_word) {
        const bool start_space = start == 0 || !matches(edges_.ends_with_word, text.substr(0, start));
        const bool stop_space = stop == text.size() || !matches(edges_.starts_with_word, text.substr(stop));
        if (!start_space || !stop_space) continue;
      }
      if (token.lstrip) {
        const auto found = edges_.space_at_end.find_all(text.substr(0, start));
        const std::size_t new_start = found.empty() ? start : found.front().first;
        start = std::max(new_start, start_offset);
      }
      if (token.rstrip) {
        const auto found = edges_.space_at_start.find_all(text.substr(stop));
        if (!found.empty()) stop += found.front().second;
      }
      if (start_offset < start) out.push_back({{text.substr(start_offset, start - start_offset), start_offset == 0}, std::nullopt});
      out.push_back({{text.substr(start, stop - start), start == 0}, index});
      start_offset = stop;
    }
    if (start_offset != text.size()) {
      out.push_back({{text.substr(start_offset), start_offset == 0}, std::nullopt});
    }
    return out;
  }

  static bool matches(const Regex& regex, std::string_view text) { return !regex.find_all(text).empty(); }

  void read_added_tokens(const json& root, const Where& top) {
    if (!root.contains("added_tokens") || root.at("added_tokens").is_null()) return;
    const auto& list = root.at("added_tokens");
    for (std::size_t i = 0; i < list.size(); ++i) {
      const Where where = top.at("added_tokens").at(i);
      const auto& entry = list[i];
      check_keys(entry, {"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"}, where);
      AddedToken token{require(entry, "content", where).get<std::string>(),
                       static_cast<TokenId>(integer_in(require(entry, "id", where), 0, INT32_MAX, where.at("id"))),
                       get_or(entry, "special", false),
                       get_or(entry, "single_word", false),
                       get_or(entry, "lstrip", false),
                       get_or(entry, "rstrip", false),
                       get_or(entry, "normalized", !get_or(entry, "special", false))};
      TESSERA_CHECK(token.id >= 0, "Hugging Face tokenizer ", where.str(), " has a negative id");
      // The tokenizers library gives an added token whose id is taken (by another added token, or
      // by a different token of the vocab) a new id after the others: refused, since these ids
      // would not be the library's.
      const auto earlier = added_by_id_.find(token.id);
      TESSERA_CHECK(earlier == added_by_id_.end(), "Hugging Face tokenizer ", where.at("id").str(), " = ", token.id,
                    " is also added_tokens[", earlier == added_by_id_.end() ? 0 : earlier->second, "]'s (",
                    json(earlier == added_by_id_.end() ? "" : added_[earlier->second].content).dump(),
                    "): the tokenizers library would renumber this one; give each added token its own id");
      const auto& model_tokens = bpe_->id_to_token();
      const bool in_vocab = static_cast<std::size_t>(token.id) < model_tokens.size() && !model_tokens[token.id].empty();
      TESSERA_CHECK(!in_vocab || model_tokens[token.id] == token.content, "Hugging Face tokenizer ",
                    where.at("id").str(), " = ", token.id, " is the vocab's ",
                    json(in_vocab ? model_tokens[token.id] : "").dump(), ", not ", json(token.content).dump(),
                    ": the tokenizers library would give ", json(token.content).dump(), " a new id after the ",
                    "vocabulary; an added token takes a vocab id only for the same token");
      vocab_size_ = std::max<std::int64_t>(vocab_size_, token.id + 1);
      if (token.special) special_contents_.insert(token.content);
      added_by_id_[token.id] = added_.size();
      added_.push_back(std::move(token));
    }
    for (std::size_t i = 0; i < added_.size(); ++i) {
      const AddedToken& token = added_[i];
      if (!token.normalized) {
        raw_matcher_.add(token.content, i);
      } else {
        std::string pattern = token.content;
        if (normalizer_) normalizer_->apply(pattern);
        normalized_matcher_.add(std::move(pattern), i);
      }
    }
    raw_matcher_.finish();
    normalized_matcher_.finish();
  }

  void read_post_processor(const json& spec, const Where& where) {
    const std::string type = require(spec, "type", where).get<std::string>();
    if (type == "Sequence") {
      check_keys(spec, {"type", "processors"}, where);
      const auto& list = require(spec, "processors", where);
      for (std::size_t i = 0; i < list.size(); ++i) read_post_processor(list[i], where.at("processors").at(i));
      return;
    }
    if (type == "ByteLevel") {  // only moves offsets
      check_keys(spec, {"type", "add_prefix_space", "trim_offsets", "use_regex"}, where);
      return;
    }
    TESSERA_CHECK(type == "TemplateProcessing", "Hugging Face tokenizer ", where.str(), ": post_processor type \"", type,
                  "\" is not supported (supported: TemplateProcessing, ByteLevel, Sequence)");
    // "pair" is the template for two sequences, which Tessera never encodes.
    check_keys(spec, {"type", "single", "pair", "special_tokens"}, where);
    TESSERA_CHECK(template_.empty(), "Hugging Face tokenizer ", where.str(), ": a second TemplateProcessing");
    const auto& specials = require(spec, "special_tokens", where);
    const auto& single = require(spec, "single", where);
    for (std::size_t i = 0; i < single.size(); ++i) {
      const auto& piece = single[i];
      if (piece.contains("Sequence")) {
        template_.push_back({true, {}});
      } else {
        const auto name = require(require(piece, "SpecialToken", where.at("single").at(i)), "id", where).get<std::string>();
        TESSERA_CHECK(specials.contains(name), "Hugging Face tokenizer ", where.at("single").at(i).str(),
                      " names special token ", json(name).dump(), " missing from special_tokens");
        const json& ids = specials.at(name).at("ids");
        TESSERA_CHECK(ids.is_array(), "Hugging Face tokenizer ", where.str(), ": special token ", json(name).dump(),
                      " has no list of ids");
        std::vector<TokenId> piece_ids;
        for (const json& id : ids)
          piece_ids.push_back(static_cast<TokenId>(integer_in(id, 0, INT32_MAX, where.at("special_tokens").at(name))));
        template_.push_back({false, std::move(piece_ids)});
      }
    }
  }

  // The template's special tokens before (leading) or after the sequence.
  void append_template(std::vector<TokenId>& ids, bool leading) const {
    bool before = true;
    for (const auto& piece : template_) {
      if (piece.is_sequence) {
        before = false;
      } else if (before == leading) {
        ids.insert(ids.end(), piece.ids.begin(), piece.ids.end());
      }
    }
  }

  std::optional<TokenId> id_of(const std::string& content) const {
    for (const auto& token : added_) {
      if (token.content == content) return token.id;
    }
    return bpe_->token_id(content);
  }

  // BOS/EOS/PAD live in tokenizer_config.json, not tokenizer.json: read it when it is beside the
  // file, else take the template's leading token as BOS and the usual names.
  void read_special_ids(std::string_view config_json) {
    json config;
    if (!config_json.empty()) {
      config = json::parse(config_json, nullptr, false);
      if (config.is_discarded()) config = json::object();
    }
    const auto from_config = [&](const char* key) -> std::optional<TokenId> {
      if (!config.is_object() || !config.contains(key)) return std::nullopt;
      const auto& v = config.at(key);
      if (v.is_string()) return id_of(v.get<std::string>());
      if (v.is_object() && v.contains("content")) return id_of(v.at("content").get<std::string>());
      return std::nullopt;
    };
    const auto first_known = [&](std::initializer_list<const char*> names) -> std::optional<TokenId> {
      for (const char* name : names) {
        if (special_contents_.count(name) > 0) return id_of(name);
      }
      return std::nullopt;
    };
    bos_ = from_config("bos_token");
    if (!bos_ && !template_.empty() && !template_.front().is_sequence && template_.front().ids.size() == 1) {
      bos_ = template_.front().ids[0];
    }
    if (!bos_) bos_ = first_known({"<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"});
    eos_ = from_config("eos_token");
    if (!eos_) eos_ = first_known({"</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"});
    pad_ = from_config("pad_token");
    if (!pad_) pad_ = first_known({"<pad>", "<|pad|>", "[PAD]"});
  }

  std::string source_;
  EdgeRegexes edges_;
  std::optional<Bpe> bpe_;
  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<Decoder> decoder_;
  std::vector<AddedToken> added_;
  std::unordered_map<TokenId, std::size_t> added_by_id_;
  std::set<std::string> special_contents_;
  AddedMatcher raw_matcher_, normalized_matcher_;
  std::vector<TemplatePiece> template_;
  std::int64_t vocab_size_ = 0;
  std::optional<TokenId> bos_, eos_, pad_;
};

}  // namespace

std::unique_ptr<Tokenizer> parse_huggingface_tokenizer(std::string_view bytes, const std::string& source,
                                                       std::string_view config_json) {
  json root = json::parse(bytes, nullptr, false);
  TESSERA_CHECK(!root.is_discarded() && root.is_object(), "tokenizer ", source,
                " is not valid JSON (expected a Hugging Face tokenizer.json)");
  try {
    return std::make_unique<HuggingFaceTokenizer>(root, source, config_json);
  } catch (const json::exception& e) {
    // A value of the wrong JSON type somewhere (e.g. a number where a string belongs).
    TESSERA_FAIL("Hugging Face tokenizer ", source, " is malformed: ", e.what());
  }
}

}  // namespace tessera::toolkit
