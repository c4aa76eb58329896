#pragma once
/// Tokenizers users already have: SentencePiece `tokenizer.model` (Llama 2, Mistral) and
/// Hugging Face `tokenizer.json` with a BPE model (Llama 3, Qwen, GPT-2). One interface, so a
/// data plugin, `tessera data prepare` and `tessera predict` never ask which kind it is.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tessera::toolkit {

using TokenId = std::int32_t;

class Tokenizer {
 public:
  virtual ~Tokenizer();
  /// Token ids of `text`. With add_special_tokens, what the file's own post-processing adds
  /// (e.g. BOS for Llama); without, the plain encoding. Special tokens written in the text
  /// (added_tokens) are matched as the reference library matches them.
  virtual std::vector<TokenId> encode(std::string_view text, bool add_special_tokens = false) const = 0;
  /// The text of `ids`; special tokens left out when skip_special_tokens.
  virtual std::string decode(const std::vector<TokenId>& ids, bool skip_special_tokens = false) const = 0;
  /// Number of ids the tokenizer can produce (the model's vocab_size must be at least this).
  virtual std::int64_t vocab_size() const = 0;
  virtual std::optional<TokenId> bos_id() const = 0;
  virtual std::optional<TokenId> eos_id() const = 0;
  virtual std::optional<TokenId> pad_id() const = 0;
  /// The special (added / control) tokens' strings.
  virtual std::vector<std::string> special_tokens() const = 0;
  /// "sentencepiece" or "huggingface", for manifests and messages.
  virtual std::string kind() const = 0;
};

/// Loads `path`: a SentencePiece model (`*.model`), a Hugging Face `tokenizer.json`, or a
/// directory holding one of them. An sdk::Error names the file and what would be valid.
std::unique_ptr<Tokenizer> load_tokenizer(const std::filesystem::path& path);

}  // namespace tessera::toolkit
