#pragma once
/// Tokenizers users already have: SentencePiece `tokenizer.model` (Llama 2, Mistral) and
/// Hugging Face `tokenizer.json` with a BPE model (Llama 3, Qwen, GPT-2). One interface, so a
/// data plugin, `tessera data prepare` and `tessera predict` never ask which kind it is.
/// Every method is const and safe to call from many threads at once on one tokenizer.
/// docs/tokenizers.md lists what each kind supports.
#include <cstdint>
#include <filesystem>
#include <functional>
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
  /// Token ids of `text` (UTF-8; invalid UTF-8 raises sdk::Error). With add_special_tokens,
  /// what the file's own post-processing adds (e.g. BOS for Llama); without, the plain
  /// encoding. Special tokens written in the text (added_tokens) are matched as the reference
  /// library matches them.
  virtual std::vector<TokenId> encode(std::string_view text, bool add_special_tokens = false) const = 0;
  /// The text of `ids`; special tokens left out when skip_special_tokens. An id outside
  /// [0, vocab_size()) raises sdk::Error.
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
/// directory holding one of them (tokenizer.json first, then tokenizer.model). The kind is
/// told from the file's bytes, not its name. An sdk::Error names the file and what would be valid.
std::unique_ptr<Tokenizer> load_tokenizer(const std::filesystem::path& path);

/// The file load_tokenizer reads for `path`: a directory's tokenizer.json, else its
/// tokenizer.model, or the file itself; nullopt when there is none.
std::optional<std::filesystem::path> tokenizer_file(const std::filesystem::path& path);

/// A Hugging Face tokenizer from the bytes of a tokenizer.json; `source` names them in errors
/// (a file path). Anything the file uses that is not implemented is refused by its JSON path.
/// `config_json`, when not empty, is the tokenizer_config.json beside it (bos/eos/pad names).
/// Takes bytes rather than a path so a fuzzer can drive it.
std::unique_ptr<Tokenizer> parse_huggingface_tokenizer(std::string_view json, const std::string& source,
                                                       std::string_view config_json = {});

/// A SentencePiece tokenizer from the bytes of a serialized ModelProto (a tokenizer.model).
std::unique_ptr<Tokenizer> parse_sentencepiece_tokenizer(std::string_view model_proto, const std::string& source);

/// Trains a SentencePiece model with SentencePiece's own trainer. `flags` are its options by
/// name (model_prefix, model_type, vocab_size, ...: it writes model_prefix + ".model" and
/// ".vocab"); `next_line` yields the training sentences, then nullopt (the view must stay valid
/// until the next call). Raises sdk::Error with SentencePiece's message on failure.
void train_sentencepiece(const std::vector<std::pair<std::string, std::string>>& flags,
                         const std::function<std::optional<std::string_view>()>& next_line);

}  // namespace tessera::toolkit
