#pragma once
/// The text files a corpus command reads (`tessera data prepare`, `tessera tokenizer train`).
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace tessera::host {

/// Each input expanded in order: a file as itself; a folder walked recursively and a quoted glob
/// expanded, each sorted, skipping hidden entries and binary files (a NUL byte in the first 8 KiB,
/// as git and grep decide: e.g. strfile's *.dat indexes beside the fortunes), which are counted
/// in `skipped_binary`. Each file once. Errors name `flag` and the input; finding no text file
/// at all is one.
std::vector<std::filesystem::path> corpus_files(const std::vector<std::string>& inputs, const std::string& flag,
                                                std::int64_t& skipped_binary);

}  // namespace tessera::host
