// Normalizers, pre-tokenizers and decoders of tokenizer.json, as the Rust crate runs them
// (hf_tokenizer_parts.hpp); each reads its JSON strictly.
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>

#include <algorithm>
#include <optional>

#include "hf_tokenizer_parts.hpp"
#include "utf8.hpp"

namespace tessera::toolkit::hf {

namespace {

// Normalizers: text -> text.

class SequenceNormalizer final : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> steps) : steps_(std::move(steps)) {}
  void apply(std::string& text) const override {
    for (const auto& step : steps_) step->apply(text);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> steps_;
};

class UnicodeNormalizer final : public Normalizer {
 public:
  UnicodeNormalizer(const std::string& form, const Where& where) {
    UErrorCode status = U_ZERO_ERROR;
    normalizer_ = form == "NFC"    ? icu::Normalizer2::getNFCInstance(status)
                  : form == "NFD"  ? icu::Normalizer2::getNFDInstance(status)
                  : form == "NFKC" ? icu::Normalizer2::getNFKCInstance(status)
                                   : icu::Normalizer2::getNFKDInstance(status);
    TESSERA_CHECK(U_SUCCESS(status), "Hugging Face tokenizer ", where.str(), ": ICU has no ", form, " normalizer");
  }
  void apply(std::string& text) const override {
    UErrorCode status = U_ZERO_ERROR;
    if (normalizer_->isNormalizedUTF8(text, status) && U_SUCCESS(status)) return;
    status = U_ZERO_ERROR;
    std::string out;
    icu::StringByteSink<std::string> sink(&out);
    normalizer_->normalizeUTF8(0, text, sink, nullptr, status);
    TESSERA_CHECK(U_SUCCESS(status), "Unicode normalization failed: ", u_errorName(status));
    text = std::move(out);
  }

 private:
  const icu::Normalizer2* normalizer_ = nullptr;
};

class PrependNormalizer final : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prefix) : prefix_(std::move(prefix)) {}
  void apply(std::string& text) const override {
    if (!text.empty()) text.insert(0, prefix_);
  }

 private:
  std::string prefix_;
};

class ReplaceNormalizer final : public Normalizer {
 public:
  ReplaceNormalizer(Regex pattern, std::string content) : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void apply(std::string& text) const override { text = pattern_.replace_all(text, content_); }

 private:
  Regex pattern_;
  std::string content_;
};

}  // namespace

std::unique_ptr<Normalizer> make_normalizer(const json& spec, const Where& where) {
  const std::string type = require(spec, "type", where).get<std::string>();
  if (type == "Sequence") {
    check_keys(spec, {"type", "normalizers"}, where);
    std::vector<std::unique_ptr<Normalizer>> steps;
    const auto& list = require(spec, "normalizers", where);
    for (std::size_t i = 0; i < list.size(); ++i) steps.push_back(make_normalizer(list[i], where.at("normalizers").at(i)));
    return std::make_unique<SequenceNormalizer>(std::move(steps));
  }
  if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    check_keys(spec, {"type"}, where);
    return std::make_unique<UnicodeNormalizer>(type, where);
  }
  if (type == "Prepend") {
    check_keys(spec, {"type", "prepend"}, where);
    return std::make_unique<PrependNormalizer>(require(spec, "prepend", where).get<std::string>());
  }
  if (type == "Replace") {
    check_keys(spec, {"type", "pattern", "content"}, where);
    return std::make_unique<ReplaceNormalizer>(pattern_regex(require(spec, "pattern", where), where.at("pattern")),
                                               require(spec, "content", where).get<std::string>());
  }
  TESSERA_FAIL("Hugging Face tokenizer ", where.str(), ": normalizer type \"", type,
               "\" is not supported (supported: Sequence, NFC, NFD, NFKC, NFKD, Prepend, Replace)");
}

namespace {

// ---------------------------------------------------------------------------------------------
// Pre-tokenizers: split a piece of text into words (each word then goes through BPE alone).

enum class SplitBehavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

// The crate's NormalizedString::split: pieces of `text` by (range, is_match) and a behavior.
void split_pieces(const Piece& piece, std::vector<std::tuple<std::size_t, std::size_t, bool>> matches,
                  SplitBehavior behavior, std::vector<Piece>& out) {
  std::vector<std::tuple<std::size_t, std::size_t, bool>> kept;  // (start, end, remove)
  switch (behavior) {
    case SplitBehavior::isolated:
      for (auto& [s, e, m] : matches) kept.emplace_back(s, e, false);
      break;
    case SplitBehavior::removed:
      kept = matches;
      break;
    case SplitBehavior::contiguous: {
      bool previous_match = false;
      for (auto& [s, e, m] : matches) {
        if (m == previous_match && !kept.empty()) {
          std::get<1>(kept.back()) = e;
        } else {
          kept.emplace_back(s, e, false);
        }
        previous_match = m;
      }
      break;
    }
    case SplitBehavior::merged_with_previous: {
      bool previous_match = false;
      for (auto& [s, e, m] : matches) {
        if (m && !previous_match && !kept.empty()) {
          std::get<1>(kept.back()) = e;
        } else {
          kept.emplace_back(s, e, false);
        }
        previous_match = m;
      }
      break;
    }
    case SplitBehavior::merged_with_next: {
      bool previous_match = false;
      for (auto it = matches.rbegin(); it != matches.rend(); ++it) {
        auto& [s, e, m] = *it;
        if (m && !previous_match && !kept.empty()) {
          std::get<0>(kept.back()) = s;
        } else {
          kept.emplace_back(s, e, false);
        }
        previous_match = m;
      }
      std::reverse(kept.begin(), kept.end());
      break;
    }
  }
  for (const auto& [s, e, remove] : kept) {
    if (remove || s == e) continue;
    out.push_back({piece.text.substr(s, e - s), piece.at_start && s == 0});
  }
}

class SequencePreTokenizer final : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> steps) : steps_(std::move(steps)) {}
  void apply(std::vector<Piece>& pieces) const override {
    for (const auto& step : steps_) step->apply(pieces);
  }
  bool byte_level() const override {
    return std::any_of(steps_.begin(), steps_.end(), [](const auto& s) { return s->byte_level(); });
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

class SplitPreTokenizer final : public PreTokenizer {
 public:
  SplitPreTokenizer(Regex pattern, SplitBehavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}
  void apply(std::vector<Piece>& pieces) const override {
    std::vector<Piece> out;
    out.reserve(pieces.size() * 4);
    for (const auto& piece : pieces) {
      auto matches = pattern_.pieces(piece.text);
      if (invert_) {
        for (auto& m : matches) std::get<2>(m) = !std::get<2>(m);
      }
      split_pieces(piece, std::move(matches), behavior_, out);
    }
    pieces = std::move(out);
  }

 private:
  Regex pattern_;
  SplitBehavior behavior_;
  bool invert_;
};

// GPT-2's pattern, which ByteLevel applies when use_regex is true.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, bool use_regex, const Where& where)
      : add_prefix_space_(add_prefix_space) {
    if (use_regex) regex_.emplace(kGpt2Pattern, where);
  }
  void apply(std::vector<Piece>& pieces) const override {
    std::vector<Piece> out;
    out.reserve(pieces.size() * 4);
    for (auto& piece : pieces) {
      if (add_prefix_space_ && !piece.text.empty() && piece.text[0] != ' ') piece.text.insert(0, " ");
      if (regex_) {
        auto matches = regex_->pieces(piece.text);
        split_pieces(piece, std::move(matches), SplitBehavior::isolated, out);
      } else {
        out.push_back(std::move(piece));
      }
    }
    const auto& alphabet = byte_alphabet();
    for (auto& piece : out) {
      std::string mapped;
      mapped.reserve(piece.text.size() * 2);
      for (const char c : piece.text) mapped += alphabet.byte_to_char[static_cast<unsigned char>(c)];
      piece.text = std::move(mapped);
    }
    pieces = std::move(out);
  }
  bool byte_level() const override { return true; }

 private:
  bool add_prefix_space_;
  std::optional<Regex> regex_;
};

class MetaspacePreTokenizer final : public PreTokenizer {
 public:
  enum class Prepend { always, first, never };
  MetaspacePreTokenizer(std::string replacement, Prepend prepend, bool split, const Where& where)
      : replacement_(std::move(replacement)),
        prepend_(prepend),
        split_(split),
        space_(Regex::literal(" ", where)),
        marker_(Regex::literal(replacement_, where)) {}
  void apply(std::vector<Piece>& pieces) const override {
    std::vector<Piece> out;
    for (auto& piece : pieces) {
      piece.text = space_.replace_all(piece.text, replacement_);
      const bool starts = piece.text.compare(0, replacement_.size(), replacement_) == 0;
      if (!starts && !piece.text.empty() && (prepend_ == Prepend::always || (prepend_ == Prepend::first && piece.at_start))) {
        piece.text.insert(0, replacement_);
      }
      if (split_) {
        split_pieces(piece, marker_.pieces(piece.text), SplitBehavior::merged_with_next, out);
      } else {
        out.push_back(std::move(piece));
      }
    }
    pieces = std::move(out);
  }

 private:
  std::string replacement_;
  Prepend prepend_;
  bool split_;
  Regex space_, marker_;
};

SplitBehavior split_behavior(const std::string& name, const Where& where) {
  if (name == "Removed") return SplitBehavior::removed;
  if (name == "Isolated") return SplitBehavior::isolated;
  if (name == "MergedWithPrevious") return SplitBehavior::merged_with_previous;
  if (name == "MergedWithNext") return SplitBehavior::merged_with_next;
  if (name == "Contiguous") return SplitBehavior::contiguous;
  TESSERA_FAIL("Hugging Face tokenizer ", where.str(), ": split behavior \"", name,
               "\" is not one of Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous");
}

}  // namespace

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& spec, const Where& where) {
  const std::string type = require(spec, "type", where).get<std::string>();
  if (type == "Sequence") {
    check_keys(spec, {"type", "pretokenizers"}, where);
    std::vector<std::unique_ptr<PreTokenizer>> steps;
    const auto& list = require(spec, "pretokenizers", where);
    for (std::size_t i = 0; i < list.size(); ++i) {
      steps.push_back(make_pre_tokenizer(list[i], where.at("pretokenizers").at(i)));
    }
    return std::make_unique<SequencePreTokenizer>(std::move(steps));
  }
  if (type == "Split") {
    check_keys(spec, {"type", "pattern", "behavior", "invert"}, where);
    return std::make_unique<SplitPreTokenizer>(
        pattern_regex(require(spec, "pattern", where), where.at("pattern")),
        split_behavior(require(spec, "behavior", where).get<std::string>(), where.at("behavior")),
        get_or(spec, "invert", false));
  }
  if (type == "ByteLevel") {
    // trim_offsets only moves offsets, which Tessera does not report.
    check_keys(spec, {"type", "add_prefix_space", "trim_offsets", "use_regex"}, where);
    return std::make_unique<ByteLevelPreTokenizer>(get_or(spec, "add_prefix_space", true),
                                                   get_or(spec, "use_regex", true), where);
  }
  if (type == "Metaspace") {
    check_keys(spec, {"type", "replacement", "prepend_scheme", "split", "add_prefix_space", "str_rep"}, where);
    const std::string scheme = get_or<std::string>(spec, "prepend_scheme",
                                                   get_or(spec, "add_prefix_space", true) ? "always" : "never");
    TESSERA_CHECK(scheme == "always" || scheme == "first" || scheme == "never", "Hugging Face tokenizer ",
                  where.at("prepend_scheme").str(), " is \"", scheme, "\", not always, first or never");
    return std::make_unique<MetaspacePreTokenizer>(
        single_char(require(spec, "replacement", where), where.at("replacement")),
        scheme == "always"  ? MetaspacePreTokenizer::Prepend::always
        : scheme == "first" ? MetaspacePreTokenizer::Prepend::first
                            : MetaspacePreTokenizer::Prepend::never,
        get_or(spec, "split", true), where);
  }
  if (type == "Digits") {
    check_keys(spec, {"type", "individual_digits"}, where);
    return std::make_unique<SplitPreTokenizer>(
        Regex(R"(\p{N})", where),
        get_or(spec, "individual_digits", false) ? SplitBehavior::isolated : SplitBehavior::contiguous, false);
  }
  TESSERA_FAIL("Hugging Face tokenizer ", where.str(), ": pre_tokenizer type \"", type,
               "\" is not supported (supported: Sequence, Split, ByteLevel, Metaspace, Digits)");
}

namespace {

// ---------------------------------------------------------------------------------------------
// Decoders: a chain of token strings -> token strings, joined at the end.

class SequenceDecoder final : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> steps) : steps_(std::move(steps)) {}
  std::vector<std::string> decode_chain(std::vector<std::string> tokens) const override {
    for (const auto& step : steps_) tokens = step->decode_chain(std::move(tokens));
    return tokens;
  }

 private:
  std::vector<std::unique_ptr<Decoder>> steps_;
};

class ByteLevelDecoder final : public Decoder {
 public:
  std::vector<std::string> decode_chain(std::vector<std::string> tokens) const override {
    const auto& alphabet = byte_alphabet();
    std::string bytes;
    for (const auto& token : tokens) {
      std::string mapped;
      bool all_mapped = true;
      for (std::size_t i = 0; i < token.size();) {
        const auto it = alphabet.char_to_byte.find(next_code_point(token, i));
        if (it == alphabet.char_to_byte.end()) {
          all_mapped = false;
          break;
        }
        mapped += static_cast<char>(it->second);
      }
      bytes += all_mapped ? mapped : token;  // a token outside the alphabet (an added token) stays as written
    }
    return {utf8_lossy(bytes)};
  }
};

class ByteFallbackDecoder final : public Decoder {
 public:
  std::vector<std::string> decode_chain(std::vector<std::string> tokens) const override {
    std::vector<std::string> out;
    std::string pending;
    std::size_t pending_count = 0;
    const auto flush = [&] {
      if (pending_count == 0) return;
      if (utf8_lossy(pending) == pending) {
        out.push_back(pending);
      } else {
        for (std::size_t i = 0; i < pending_count; ++i) out.emplace_back("\xEF\xBF\xBD");
      }
      pending.clear();
      pending_count = 0;
    };
    for (auto& token : tokens) {
      if (token.size() == 6 && token.compare(0, 3, "<0x") == 0 && token[5] == '>' && std::isxdigit(static_cast<unsigned char>(token[3])) &&
          std::isxdigit(static_cast<unsigned char>(token[4]))) {
        pending += static_cast<char>(std::stoi(token.substr(3, 2), nullptr, 16));
        ++pending_count;
      } else {
        flush();
        out.push_back(std::move(token));
      }
    }
    flush();
    return out;
  }
};

class FuseDecoder final : public Decoder {
 public:
  std::vector<std::string> decode_chain(std::vector<std::string> tokens) const override {
    std::string all;
    for (const auto& t : tokens) all += t;
    return {all};
  }
};

class StripDecoder final : public Decoder {
 public:
  StripDecoder(std::uint32_t content, std::size_t start, std::size_t stop)
      : content_(content), start_(start), stop_(stop) {}
  std::vector<std::string> decode_chain(std::vector<std::string> tokens) const override {
    for (auto& token : tokens) {
      std::vector<std::pair<std::size_t, std::uint32_t>> chars;  // (byte offset, code point)
      for (std::size_t i = 0; i < token.size();) {
        const std::size_t at = i;
        chars.emplace_back(at, next_code_point(token, i));
      }
      std::size_t start_cut = 0;
      for (std::size_t i = 0; i < std::min(start_, chars.size()) && chars[i].second == content_; ++i) start_cut = i + 1;
      std::size_t stop_cut = chars.size();
      for (std::size_t i = 0; i < stop_ && i < chars.size(); ++i) {
        const std::size_t index = chars.size() - i - 1;
        if (chars[index].second != content_) break;
        stop_cut = index;
      }
      if (start_cut >= stop_cut) {
        token.clear();
        continue;
      }
      const std::size_t from = chars[start_cut].first;
      const std::size_t to = stop_cut == chars.size() ? token.size() : chars[stop_cut].first;
      token = token.substr(from, to - from);
    }
    return tokens;
  }

 private:
  std::uint32_t content_;
  std::size_t start_, stop_;
};

class ReplaceDecoder final : public Decoder {
 public:
  ReplaceDecoder(Regex pattern, std::string content) : pattern_(std::move(pattern)), content_(std::move(content)) {}
  std::vector<std::string> decode_chain(std::vector<std::string> tokens) const override {
    for (auto& token : tokens) token = pattern_.replace_all(token, content_);
    return tokens;
  }

 private:
  Regex pattern_;
  std::string content_;
};

class MetaspaceDecoder final : public Decoder {
 public:
  MetaspaceDecoder(std::uint32_t replacement, bool strip_first) : replacement_(replacement), strip_first_(strip_first) {}
  std::vector<std::string> decode_chain(std::vector<std::string> tokens) const override {
    for (std::size_t t = 0; t < tokens.size(); ++t) {
      std::string out;
      const std::string& token = tokens[t];
      for (std::size_t i = 0; i < token.size();) {
        const std::size_t at = i;
        if (next_code_point(token, i) == replacement_) {
          if (!(t == 0 && strip_first_)) out += ' ';
        } else {
          out.append(token, at, i - at);
        }
      }
      tokens[t] = std::move(out);
    }
    return tokens;
  }

 private:
  std::uint32_t replacement_;
  bool strip_first_;
};

std::uint32_t code_point_of(const std::string& one_char) {
  std::size_t i = 0;
  return next_code_point(one_char, i);
}

}  // namespace

std::unique_ptr<Decoder> make_decoder(const json& spec, const Where& where) {
  const std::string type = require(spec, "type", where).get<std::string>();
  if (type == "Sequence") {
    check_keys(spec, {"type", "decoders"}, where);
    std::vector<std::unique_ptr<Decoder>> steps;
    const auto& list = require(spec, "decoders", where);
    for (std::size_t i = 0; i < list.size(); ++i) steps.push_back(make_decoder(list[i], where.at("decoders").at(i)));
    return std::make_unique<SequenceDecoder>(std::move(steps));
  }
  if (type == "ByteLevel") {
    // The ByteLevel decoder ignores these (they configure the pre-tokenizer half of ByteLevel).
    check_keys(spec, {"type", "add_prefix_space", "trim_offsets", "use_regex"}, where);
    return std::make_unique<ByteLevelDecoder>();
  }
  if (type == "ByteFallback") {
    check_keys(spec, {"type"}, where);
    return std::make_unique<ByteFallbackDecoder>();
  }
  if (type == "Fuse") {
    check_keys(spec, {"type"}, where);
    return std::make_unique<FuseDecoder>();
  }
  if (type == "Strip") {
    check_keys(spec, {"type", "content", "start", "stop"}, where);
    return std::make_unique<StripDecoder>(code_point_of(single_char(require(spec, "content", where), where.at("content"))),
                                          integer_in(require(spec, "start", where), 0, INT32_MAX, where.at("start")),
                                          integer_in(require(spec, "stop", where), 0, INT32_MAX, where.at("stop")));
  }
  if (type == "Replace") {
    check_keys(spec, {"type", "pattern", "content"}, where);
    return std::make_unique<ReplaceDecoder>(pattern_regex(require(spec, "pattern", where), where.at("pattern")),
                                            require(spec, "content", where).get<std::string>());
  }
  if (type == "Metaspace") {
    check_keys(spec, {"type", "replacement", "prepend_scheme", "split", "add_prefix_space", "str_rep"}, where);
    const std::string scheme = get_or<std::string>(spec, "prepend_scheme",
                                                   get_or(spec, "add_prefix_space", true) ? "always" : "never");
    return std::make_unique<MetaspaceDecoder>(
        code_point_of(single_char(require(spec, "replacement", where), where.at("replacement"))), scheme != "never");
  }
  TESSERA_FAIL("Hugging Face tokenizer ", where.str(), ": decoder type \"", type,
               "\" is not supported (supported: Sequence, ByteLevel, ByteFallback, Fuse, Strip, Replace, Metaspace)");
}

}  // namespace tessera::toolkit::hf
