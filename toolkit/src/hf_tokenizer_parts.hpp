#pragma once
// The pieces of the Hugging Face tokenizer.json reader (huggingface_tokenizer.cpp) that its
// files share; private to the toolkit:
//   hf_text.cpp        reading the JSON strictly, PCRE2 regexes, GPT-2's byte alphabet, UTF-8
//   hf_components.cpp  normalizers, pre-tokenizers and decoders, each made from its JSON
//   huggingface_tokenizer.cpp  the BPE model, added tokens, post-processing: the tokenizer
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/sdk/error.hpp"

namespace tessera::toolkit::hf {

using json = nlohmann::json;

// Where a component sits in the file, for messages: "tokenizer.json: pre_tokenizer.pretokenizers[1]".
struct Where {
  const std::string& file;
  std::string path;
  Where at(const std::string& key) const { return {file, path.empty() ? key : path + "." + key}; }
  Where at(std::size_t index) const { return {file, path + "[" + std::to_string(index) + "]"}; }
  std::string str() const { return file + ": " + path; }
};

const json& require(const json& object, const char* key, const Where& where);

// An integer in [min, max]: nlohmann's get<> converts a float or an out-of-range number with
// undefined behaviour (a vocabulary id of 3.3e23 did), so anything else is refused.
std::int64_t integer_in(const json& value, std::int64_t min, std::int64_t max, const Where& where);

// Refuses keys this reader does not know, so a setting is never silently dropped.
void check_keys(const json& object, std::initializer_list<const char*> known, const Where& where);

template <typename T>
T get_or(const json& object, const char* key, T fallback) {
  const auto it = object.find(key);
  return it == object.end() || it->is_null() ? fallback : it->get<T>();
}

// Regexes (PCRE2 with UTF and Unicode properties, JIT-compiled): the crate uses Oniguruma for
// the same Perl-style patterns.
class Regex {
 public:
  Regex(const std::string& pattern, const Where& where);
  static Regex literal(const std::string& text, const Where& where);
  Regex(Regex&& other) noexcept
      : code_(std::exchange(other.code_, nullptr)), description_(std::move(other.description_)) {}
  Regex(const Regex&) = delete;
  ~Regex();

  /// Non-overlapping matches (start, end) left to right; empty matches are skipped.
  std::vector<std::pair<std::size_t, std::size_t>> find_all(std::string_view text) const;
  /// The crate's `Pattern::find_matches`: the whole text as (range, is_match) pieces.
  std::vector<std::tuple<std::size_t, std::size_t, bool>> pieces(std::string_view text) const;
  std::string replace_all(std::string_view text, std::string_view content) const;

 private:
  pcre2_code* code_ = nullptr;
  std::string description_;  ///< the tokenizer file, where the pattern is in it and the pattern: for messages
};

// A Replace/Split "pattern": {"String": "..."} or {"Regex": "..."}.
Regex pattern_regex(const json& pattern, const Where& where);

// GPT-2's byte-level alphabet: every byte as a printable character.
struct ByteAlphabet {
  std::string byte_to_char[256];
  std::unordered_map<std::uint32_t, unsigned char> char_to_byte;  // code point -> byte
  ByteAlphabet();
};
const ByteAlphabet& byte_alphabet();

// Decodes one UTF-8 character at `i` (valid input), advancing `i`.
std::uint32_t next_code_point(std::string_view s, std::size_t& i);
// A JSON string of exactly one character.
std::string single_char(const json& value, const Where& where);

// Normalizers: text -> text.
class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void apply(std::string& text) const = 0;
};
std::unique_ptr<Normalizer> make_normalizer(const json& spec, const Where& where);

// Pre-tokenizers: split a piece of text into words (each word then goes through BPE alone).
struct Piece {
  std::string text;
  bool at_start;  // begins at offset 0 of the original text (Metaspace's prepend_scheme "first")
};
class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  virtual void apply(std::vector<Piece>& pieces) const = 0;
  /// True when the words it yields are GPT-2 byte-level characters.
  virtual bool byte_level() const { return false; }
};
std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& spec, const Where& where);

// Decoders: a chain of token strings -> token strings, joined at the end.
class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual std::vector<std::string> decode_chain(std::vector<std::string> tokens) const = 0;
};
std::unique_ptr<Decoder> make_decoder(const json& spec, const Where& where);

}  // namespace tessera::toolkit::hf
