#include "cli/corpus_files.hpp"

#include <glob.h>

#include <algorithm>
#include <fstream>
#include <set>

#include "tessera/sdk/error.hpp"

namespace tessera::host {

namespace fs = std::filesystem;

namespace {

/// A NUL byte in the first 8 KiB: binary, as git and grep decide (e.g. strfile's *.dat indexes).
bool is_binary(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  char buffer[8192];
  in.read(buffer, sizeof buffer);
  return std::find(buffer, buffer + in.gcount(), '\0') != buffer + in.gcount();
}

bool hidden(const fs::path& p) { return p.filename().string().rfind('.', 0) == 0; }

}  // namespace

std::vector<fs::path> corpus_files(const std::vector<std::string>& inputs, const std::string& flag,
                                  std::int64_t& skipped_binary) {
  std::vector<fs::path> files;
  std::set<fs::path> seen;
  auto add = [&](const fs::path& file, bool from_walk) {
    if (from_walk && (hidden(file) || is_binary(file))) {
      skipped_binary += hidden(file) ? 0 : 1;
      return;
    }
    const fs::path canonical = fs::weakly_canonical(file);
    if (seen.insert(canonical).second) files.push_back(file);
  };
  for (const auto& input : inputs) {
    std::error_code ec;
    std::vector<fs::path> found;
    bool walk = false;
    if (input.find_first_of("*?[") != std::string::npos && !fs::exists(input, ec)) {
      glob_t g{};
      const int rc = ::glob(input.c_str(), 0, nullptr, &g);
      for (std::size_t k = 0; rc == 0 && k < g.gl_pathc; ++k) found.emplace_back(g.gl_pathv[k]);
      ::globfree(&g);
      TESSERA_CHECK(!found.empty(), flag, " ", input, ": the pattern matches no file");
      walk = true;
    } else if (fs::is_directory(input, ec)) {
      for (auto it = fs::recursive_directory_iterator(input); it != fs::recursive_directory_iterator(); ++it) {
        if (hidden(it->path()) && it->is_directory()) {
          it.disable_recursion_pending();
          continue;
        }
        if (!it->is_symlink() && it->is_regular_file()) found.push_back(it->path());
      }
      walk = true;
    } else {
      TESSERA_CHECK(fs::exists(input, ec), flag, " ", input, ": no such file or directory");
      TESSERA_CHECK(fs::is_regular_file(input, ec), flag, " ", input, " is not a regular file or a directory");
      found.emplace_back(input);
    }
    std::sort(found.begin(), found.end());
    for (const auto& f : found) {
      if (fs::is_directory(f, ec)) continue;
      add(f, walk);
    }
  }
  TESSERA_CHECK(!files.empty(), flag, " ", sdk::join(inputs), ": no text file found",
                skipped_binary > 0 ? " (" + std::to_string(skipped_binary) + " binary file(s) skipped)" : "");
  return files;
}

}  // namespace tessera::host
