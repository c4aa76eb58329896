#pragma once
// A whole file's bytes, for the toolkit's readers of small text files (tokenizer and chat
// template folders).
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "tessera/sdk/error.hpp"

namespace tessera::toolkit::detail {

inline std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  TESSERA_CHECK(in, "cannot read ", path.string());
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

}  // namespace tessera::toolkit::detail
