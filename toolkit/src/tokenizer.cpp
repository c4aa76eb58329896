#include "tessera/toolkit/tokenizer.hpp"

#include <fstream>
#include <sstream>

#include "tessera/sdk/error.hpp"
#include "read_file.hpp"

namespace tessera::toolkit {
namespace fs = std::filesystem;

Tokenizer::~Tokenizer() = default;

namespace {

using detail::read_file;

}  // namespace

std::optional<fs::path> tokenizer_file(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return fs::is_regular_file(path, ec) ? std::optional(path) : std::nullopt;
  for (const char* name : {"tokenizer.json", "tokenizer.model"})
    if (fs::is_regular_file(path / name, ec)) return path / name;
  return std::nullopt;
}

std::unique_ptr<Tokenizer> load_tokenizer(const fs::path& given) {
  TESSERA_CHECK(fs::exists(given), "tokenizer ", given.string(),
                " does not exist (give a SentencePiece tokenizer.model, a Hugging Face tokenizer.json, or a "
                "directory holding one)");
  const fs::path path = tokenizer_file(given).value_or(given);
  TESSERA_CHECK(!fs::is_directory(path), "tokenizer directory ", given.string(),
                " holds neither tokenizer.json (Hugging Face) nor tokenizer.model (SentencePiece)");
  const std::string bytes = read_file(path);
  const auto first = bytes.find_first_not_of(" \t\r\n");
  // JSON is told by its first byte: a ModelProto starts with a protobuf field tag, never '{'.
  if (first != std::string::npos && bytes[first] == '{') {
    std::string config;
    const fs::path config_path = path.parent_path() / "tokenizer_config.json";
    if (fs::is_regular_file(config_path)) config = read_file(config_path);
    return parse_huggingface_tokenizer(bytes, path.string(), config);
  }
  return parse_sentencepiece_tokenizer(bytes, path.string());
}

}  // namespace tessera::toolkit
