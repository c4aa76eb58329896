// libFuzzer: a rerun of `tessera data prepare` over the output folder an earlier run left, with
// one of its files damaged by the input: the first byte picks the file (prepare.json,
// manifest.json, a shard's .bin or .idx), the rest replaces a JSON file or is written into a
// shard at an offset (same size, other bytes: what re-recording once blessed). The property,
// beyond not crashing: a rerun that exits 0 leaves a manifest whose every checksum is its
// file's, and shards whose tokens are the first run's.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "cli/data_tool.hpp"
#include "tessera/toolkit/token_shards.hpp"

namespace {

namespace fs = std::filesystem;
namespace toolkit = tessera::toolkit;

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// The byte-level BPE of tests/fuzz/corpus/hf_tokenizer, a corpus of several shards and the
/// pristine output of a first run, made once per process.
struct Setup {
  fs::path root, tokenizer, corpus, pristine;
};

int prepare(const Setup& s, const fs::path& output) {
  std::vector<std::string> args{"data",    "prepare", "--tokenizer", s.tokenizer.string(), "--input", s.corpus.string(),
                                "--output", output.string(), "--split", "line", "--shard-size", "64", "--jobs", "1"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return tessera::host::data_tool(static_cast<int>(argv.size()), argv.data());
}

const Setup& setup() {
  static const Setup s = [] {
    char dir[] = "/tmp/fuzz-prepare-XXXXXX";
    Setup out;
    out.root = ::mkdtemp(dir);
    out.tokenizer = out.root / "tokenizer.json";
    std::ofstream(out.tokenizer) << slurp(TESSERA_FUZZ_TOKENIZER);
    out.corpus = out.root / "corpus.txt";
    std::ofstream corpus(out.corpus);
    for (int line = 0; line < 40; ++line) corpus << "abc ab a " << std::string(static_cast<std::size_t>(line % 7), 'b') << "\n";
    corpus.close();
    out.pristine = out.root / "pristine";
    if (prepare(out, out.pristine) != 0) std::abort();
    return out;
  }();
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const Setup& s = setup();
  const fs::path out = s.root / "rerun";
  fs::remove_all(out);
  fs::copy(s.pristine, out, fs::copy_options::recursive);
  const toolkit::TokenManifest first = toolkit::read_manifest(s.pristine);
  std::vector<fs::path> targets{out / "prepare.json", out / toolkit::kManifestName};
  for (const toolkit::ShardInfo& shard : first.shards) {
    targets.push_back(out / shard.file);
    targets.push_back(out / shard.offsets_file);
  }
  const fs::path& target = targets[data[0] % targets.size()];
  const std::string payload(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (target.extension() == ".json") {
    std::ofstream(target, std::ios::binary | std::ios::trunc) << payload;
  } else if (!payload.empty()) {  // overwrite in place, the file's size kept
    std::fstream file(target, std::ios::in | std::ios::out | std::ios::binary);
    const auto bytes = static_cast<std::size_t>(fs::file_size(target));
    if (bytes == 0) return 0;
    file.seekp(static_cast<std::streamoff>(static_cast<unsigned char>(payload[0]) % bytes));
    file.write(payload.data() + 1, static_cast<std::streamsize>(std::min(payload.size() - 1, bytes)));
  }
  if (prepare(s, out) != 0) return 0;  // refused: fine
  const toolkit::TokenManifest rerun = toolkit::read_manifest(out);
  if (rerun.shards.size() != first.shards.size()) std::abort();
  for (std::size_t i = 0; i < rerun.shards.size(); ++i) {
    const toolkit::ShardInfo& shard = rerun.shards[i];
    // Every checksum the manifest records is its file's, and the file is the first run's.
    if (toolkit::xxh64_file(out / shard.file) != shard.xxh64 || shard.xxh64 != first.shards[i].xxh64) std::abort();
    if (toolkit::xxh64_file(out / shard.offsets_file) != shard.offsets_xxh64 ||
        shard.offsets_xxh64 != first.shards[i].offsets_xxh64)
      std::abort();
  }
  return 0;
}
