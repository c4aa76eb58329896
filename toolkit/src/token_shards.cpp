#include "tessera/toolkit/token_shards.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "json_integer.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::toolkit {

namespace fs = std::filesystem;
using json = nlohmann::json;

TokenDtype dtype_for(std::int64_t vocab_size) {
  return vocab_size <= 65536 ? TokenDtype::uint16 : TokenDtype::uint32;
}

std::size_t dtype_bytes(TokenDtype dtype) { return dtype == TokenDtype::uint16 ? 2 : 4; }

const char* to_string(TokenDtype dtype) { return dtype == TokenDtype::uint16 ? "uint16" : "uint32"; }

std::int64_t TokenManifest::total_tokens() const {
  std::int64_t n = 0;
  for (const auto& s : shards) n += s.tokens;
  return n;
}

std::int64_t TokenManifest::total_documents() const {
  std::int64_t n = 0;
  for (const auto& s : shards) n += s.documents;
  return n;
}

namespace {

/// A file written through `path`.tmp in order, hashed as it goes, then flushed and renamed into
/// place by commit(): readers see all or nothing. Never committed, the temporary is removed.
class AtomicFile {
 public:
  explicit AtomicFile(fs::path final_path) : path_(std::move(final_path)), temporary_(path_.string() + ".tmp") {
    XXH64_reset(hash_, 0);
    fd_ = ::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) {
      const int error = errno;
      XXH64_freeState(hash_);
      TESSERA_FAIL("cannot create ", temporary_, ": ", std::strerror(error));
    }
  }
  ~AtomicFile() {
    if (fd_ >= 0) {
      ::close(fd_);
      std::error_code ec;
      fs::remove(temporary_, ec);
    }
    XXH64_freeState(hash_);
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* bytes, std::size_t size) {
    XXH64_update(hash_, bytes, size);
    const auto* p = static_cast<const char*>(bytes);
    for (std::size_t done = 0; done < size;) {
      const ssize_t n = ::write(fd_, p + done, std::min<std::size_t>(size - done, 1 << 26));
      if (n < 0 && errno == EINTR) continue;
      TESSERA_CHECK(n > 0, "cannot write ", temporary_, ": ", std::strerror(errno));
      done += static_cast<std::size_t>(n);
    }
  }

  /// Flushed, then renamed. Returns the content's XXH64 as 16 hex digits.
  std::string commit() {
    const bool synced = ::fsync(fd_) == 0;
    const int error = errno;
    ::close(fd_);
    fd_ = -1;
    TESSERA_CHECK(synced, "cannot flush ", temporary_, ": ", std::strerror(error));
    std::error_code ec;
    fs::rename(temporary_, path_, ec);
    TESSERA_CHECK(!ec, "cannot rename ", temporary_, " to ", path_, ": ", ec.message());
    return xxh64_hex(XXH64_digest(hash_));
  }

 private:
  fs::path path_, temporary_;
  int fd_ = -1;
  XXH64_state_t* hash_ = XXH64_createState();
};

void write_atomically(const fs::path& path, const void* bytes, std::size_t size) {
  AtomicFile file(path);
  file.write(bytes, size);
  file.commit();
}

/// Streams a file through `visit(bytes, size)` with a fixed buffer (pread: nothing mapped).
template <typename Visit>
void stream_file(const fs::path& file, Visit&& visit) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  TESSERA_CHECK(fd >= 0, "cannot open ", file, ": ", std::strerror(errno));
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  std::vector<char> buffer(std::size_t{1} << 20);
  for (;;) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      ::close(fd);
      TESSERA_FAIL("cannot read ", file, ": ", std::strerror(error));
    }
    if (n == 0) break;
    visit(buffer.data(), static_cast<std::size_t>(n));
  }
  ::close(fd);
}

}  // namespace

std::string xxh64_hex(std::uint64_t hash) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(hash));
  return text;
}

std::string xxh64_file(const fs::path& file) {
  XXH64_state_t* state = XXH64_createState();
  XXH64_reset(state, 0);
  try {
    stream_file(file, [&](const char* bytes, std::size_t n) { XXH64_update(state, bytes, n); });
  } catch (...) {
    XXH64_freeState(state);
    throw;
  }
  const std::uint64_t hash = XXH64_digest(state);
  XXH64_freeState(state);
  return xxh64_hex(hash);
}

TokenManifest read_manifest(const fs::path& dir) {
  const fs::path path = dir / kManifestName;
  std::error_code ec;
  TESSERA_CHECK(fs::is_regular_file(path, ec), path, " does not exist: ", dir,
                " is not a prepared token directory (write one with `tessera data prepare --tokenizer T --input "
                "FILES --output ",
                dir.string(), "`; a prepare that did not finish leaves no manifest, and rerunning it resumes)");
  json j;
  try {
    std::ifstream in(path);
    j = json::parse(in);
  } catch (const json::exception& e) {
    TESSERA_FAIL(path, " is not valid JSON: ", e.what());
  }
  TokenManifest m;
  auto integer = [&](const json& object, const char* key) {
    const json& v = object.at(key);
    const std::optional<std::int64_t> n = detail::json_integer(v);
    TESSERA_CHECK(n.has_value(), path, ": \"", key, "\" is ", v.dump().substr(0, 40), ", not an integer");
    return *n;
  };
  try {
    TESSERA_CHECK(j.value("format", std::string()) == "tessera-tokens", path,
                  ": \"format\" is not \"tessera-tokens\" (not a manifest written by tessera data prepare)");
    const std::int64_t version = j.contains("version") ? integer(j, "version") : 1;
    TESSERA_CHECK(version >= 1 && version <= kManifestVersion, path, ": \"version\" is ", version,
                  "; this tessera reads token manifests of versions 1 to ", kManifestVersion,
                  " (a newer tessera wrote it)");
    m.content = j.value("content", std::string("text"));
    TESSERA_CHECK(m.content == "text" || m.content == "chat", path, ": \"content\" is \"", m.content,
                  "\"; valid: \"text\", \"chat\"");
    const auto& t = j.at("tokenizer");
    m.tokenizer_name = t.at("name").get<std::string>();
    m.tokenizer_kind = t.at("kind").get<std::string>();
    m.tokenizer_xxh64 = t.value("xxh64", std::string());
    m.vocab_size = integer(j, "vocab_size");
    const std::string dtype = j.at("dtype").get<std::string>();
    TESSERA_CHECK(dtype == "uint16" || dtype == "uint32", path, ": \"dtype\" is \"", dtype,
                  "\"; valid: \"uint16\", \"uint32\"");
    m.dtype = dtype == "uint16" ? TokenDtype::uint16 : TokenDtype::uint32;
    m.eos_id = integer(j, "eos_id");
    TESSERA_CHECK(m.vocab_size > 0 && (m.dtype == TokenDtype::uint32 || m.vocab_size <= 65536), path,
                  ": vocab_size ", m.vocab_size, " does not fit dtype ", dtype);
    for (const auto& s : j.at("shards")) {
      ShardInfo info;
      info.file = s.at("file").get<std::string>();
      info.tokens = integer(s, "tokens");
      info.documents = integer(s, "documents");
      info.offsets_file = s.at("offsets").get<std::string>();
      info.xxh64 = s.at("xxh64").get<std::string>();
      info.offsets_xxh64 = s.at("offsets_xxh64").get<std::string>();
      if (s.contains("mask")) {
        info.mask_file = s.at("mask").get<std::string>();
        info.mask_xxh64 = s.at("mask_xxh64").get<std::string>();
      }
      TESSERA_CHECK(m.shards.empty() || info.mask_file.empty() == m.shards.front().mask_file.empty(), path,
                    ": shard ", info.file, (info.mask_file.empty() ? " has no" : " has a"), " loss mask, shard ",
                    m.shards.front().file, (info.mask_file.empty() ? " has one" : " none"),
                    ": a prepared directory is masked throughout or not at all");
      TESSERA_CHECK(info.tokens >= 0 && info.documents >= 0, path, ": shard ", info.file,
                    " has a negative token or document count");
      m.shards.push_back(std::move(info));
    }
  } catch (const json::exception& e) {
    TESSERA_FAIL(path, " is missing a field or has one of the wrong type: ", e.what());
  }
  return m;
}

void write_manifest(const fs::path& dir, const TokenManifest& m) {
  json shards = json::array();
  for (const auto& s : m.shards) {
    json shard = {{"file", s.file},     {"tokens", s.tokens},  {"documents", s.documents},
                  {"offsets", s.offsets_file}, {"xxh64", s.xxh64}, {"offsets_xxh64", s.offsets_xxh64}};
    if (!s.mask_file.empty()) {
      shard["mask"] = s.mask_file;
      shard["mask_xxh64"] = s.mask_xxh64;
    }
    shards.push_back(std::move(shard));
  }
  json j = {{"format", "tessera-tokens"},
            {"version", kManifestVersion},
            {"content", m.content},
            {"tokenizer", {{"name", m.tokenizer_name}, {"kind", m.tokenizer_kind}, {"xxh64", m.tokenizer_xxh64}}},
            {"vocab_size", m.vocab_size},
            {"dtype", to_string(m.dtype)},
            {"eos_id", m.eos_id},
            {"total_tokens", m.total_tokens()},
            {"total_documents", m.total_documents()},
            {"shards", shards}};
  const std::string text = j.dump(2) + "\n";
  write_atomically(dir / kManifestName, text.data(), text.size());
}

struct ShardWriter::File : AtomicFile {
  using AtomicFile::AtomicFile;
};

ShardWriter::ShardWriter(const fs::path& dir, const std::string& name, TokenDtype dtype, bool masked)
    : name_(name),
      dtype_(dtype),
      tokens_(std::make_unique<File>(dir / (name + ".bin"))),
      offsets_(std::make_unique<File>(dir / (name + ".idx"))),
      mask_(masked ? std::make_unique<File>(dir / (name + ".mask")) : nullptr) {
  const std::uint64_t zero = 0;
  offsets_->write(&zero, sizeof zero);
}

ShardWriter::~ShardWriter() = default;

void ShardWriter::append(const std::vector<TokenId>& tokens, const std::vector<std::uint64_t>& ends,
                         const std::vector<std::uint8_t>& mask) {
  TESSERA_CHECK(ends.empty() ? tokens.empty() : ends.back() == tokens.size(), "shard ", name_,
                ": document ends do not span the ", tokens.size(), " tokens appended");
  TESSERA_CHECK(mask_ ? mask.size() == tokens.size() : mask.empty(), "shard ", name_, ": ", mask.size(),
                " mask bytes for ", tokens.size(), " tokens", mask_ ? "" : " (the writer is not masked)");
  for (std::uint8_t b : mask) TESSERA_CHECK(b <= 1, "shard ", name_, ": mask byte ", int(b), " is not 0 or 1");
  // Little-endian on disk: this is a little-endian-only build (x86-64, aarch64).
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "token shards are little-endian");
  const std::int64_t limit = dtype_ == TokenDtype::uint16 ? 65536 : (std::int64_t{1} << 32);
  buffer_.resize(tokens.size() * dtype_bytes(dtype_));
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const TokenId id = tokens[i];
    TESSERA_CHECK(id >= 0 && id < limit, "shard ", name_, ": token id ", id, " does not fit ", to_string(dtype_));
    if (dtype_ == TokenDtype::uint16) {
      const auto v = static_cast<std::uint16_t>(id);
      std::memcpy(buffer_.data() + 2 * i, &v, 2);
    } else {
      const auto v = static_cast<std::uint32_t>(id);
      std::memcpy(buffer_.data() + 4 * i, &v, 4);
    }
  }
  tokens_->write(buffer_.data(), buffer_.size());
  std::vector<std::uint64_t> offsets(ends);
  for (auto& o : offsets) o += written_tokens_;
  offsets_->write(offsets.data(), offsets.size() * sizeof(std::uint64_t));
  if (mask_) mask_->write(mask.data(), mask.size());
  written_tokens_ += tokens.size();
  documents_ += static_cast<std::int64_t>(ends.size());
}

ShardInfo ShardWriter::finish() {
  ShardInfo info;
  info.file = name_ + ".bin";
  info.offsets_file = name_ + ".idx";
  info.tokens = static_cast<std::int64_t>(written_tokens_);
  info.documents = documents_;
  if (mask_) {
    info.mask_file = name_ + ".mask";
    info.mask_xxh64 = mask_->commit();
  }
  info.offsets_xxh64 = offsets_->commit();  // the tokens last: a finished .bin means a finished shard
  info.xxh64 = tokens_->commit();
  return info;
}

ShardInfo write_shard(const fs::path& dir, const std::string& name, TokenDtype dtype,
                      const std::vector<TokenId>& tokens, const std::vector<std::uint64_t>& offsets) {
  TESSERA_CHECK(!offsets.empty() && offsets.front() == 0 && offsets.back() == tokens.size(), "shard ", name,
                ": document offsets do not span its ", tokens.size(), " tokens");
  ShardWriter writer(dir, name, dtype);
  writer.append(tokens, std::vector<std::uint64_t>(offsets.begin() + 1, offsets.end()));
  return writer.finish();
}

MappedFile::MappedFile(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TESSERA_CHECK(fd >= 0, "cannot open ", path, ": ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    ::close(fd);
    TESSERA_FAIL("cannot stat ", path, ": ", std::strerror(error));
  }
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    const int error = errno;
    ::close(fd);
    TESSERA_CHECK(p != MAP_FAILED, "cannot memory-map ", path, ": ", std::strerror(error));
    ::madvise(p, size_, MADV_RANDOM);  // windows are read in shuffled order: no read-ahead of neighbours
    data_ = static_cast<const std::uint8_t*>(p);
  } else {
    ::close(fd);
  }
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<std::uint8_t*>(data_), size_);
}

TokenShards::TokenShards(const fs::path& dir, bool verify) : dir_(dir), manifest_(read_manifest(dir)) {
  const fs::path manifest_path = dir / kManifestName;
  TESSERA_CHECK(!manifest_.shards.empty() && manifest_.total_tokens() > 0, manifest_path,
                " lists no tokens: the corpus it was prepared from was empty");
  const std::size_t width = dtype_bytes(manifest_.dtype);
  for (const auto& s : manifest_.shards) {
    const fs::path file = dir / s.file, offsets = dir / s.offsets_file;
    std::vector<std::pair<fs::path, std::uintmax_t>> expected_sizes{
        {file, static_cast<std::uintmax_t>(s.tokens) * width}, {offsets, static_cast<std::uintmax_t>(s.documents + 1) * 8}};
    if (!s.mask_file.empty()) expected_sizes.emplace_back(dir / s.mask_file, static_cast<std::uintmax_t>(s.tokens));
    for (const auto& [path, expected] : expected_sizes) {
      std::error_code ec;
      TESSERA_CHECK(fs::is_regular_file(path, ec), path, " is missing (listed in ", manifest_path,
                    "): the prepared directory is incomplete; rerun `tessera data prepare` with the same arguments");
      const std::uintmax_t size = fs::file_size(path, ec);
      TESSERA_CHECK(size == expected, path, " holds ", size, " bytes where ", manifest_path, " says ", expected,
                    size < expected ? " (truncated)" : " (longer)",
                    ": the file was changed after prepare; rerun `tessera data prepare` into a new directory");
    }
    if (verify) {
      const std::string offsets_hash = xxh64_file(offsets);
      TESSERA_CHECK(offsets_hash == s.offsets_xxh64, offsets, ": checksum ", offsets_hash, " differs from ",
                    manifest_path, "'s ", s.offsets_xxh64, " (the file is damaged)");
      XXH64_state_t* state = XXH64_createState();
      XXH64_reset(state, 0);
      std::uint32_t largest = 0;
      stream_file(file, [&](const char* bytes, std::size_t n) {
        XXH64_update(state, bytes, n);
        if (width == 2) {
          for (std::size_t i = 0; i + 1 < n; i += 2) {
            std::uint16_t v;
            std::memcpy(&v, bytes + i, 2);
            largest = std::max<std::uint32_t>(largest, v);
          }
        } else {
          for (std::size_t i = 0; i + 3 < n; i += 4) {
            std::uint32_t v;
            std::memcpy(&v, bytes + i, 4);
            largest = std::max(largest, v);
          }
        }
      });
      const std::string hash = xxh64_hex(XXH64_digest(state));
      XXH64_freeState(state);
      TESSERA_CHECK(hash == s.xxh64, file, ": checksum ", hash, " differs from ", manifest_path, "'s ", s.xxh64,
                    " (the file is damaged or was changed after prepare)");
      TESSERA_CHECK(static_cast<std::int64_t>(largest) < manifest_.vocab_size, file, ": token id ", largest,
                    " is out of range for vocab_size ", manifest_.vocab_size, " (", manifest_path, ")");
    }
    if (verify && !s.mask_file.empty()) {
      const fs::path mask = dir / s.mask_file;
      XXH64_state_t* state = XXH64_createState();
      XXH64_reset(state, 0);
      bool binary = true;
      stream_file(mask, [&](const char* bytes, std::size_t n) {
        XXH64_update(state, bytes, n);
        for (std::size_t i = 0; i < n; ++i) binary = binary && static_cast<std::uint8_t>(bytes[i]) <= 1;
      });
      const std::string hash = xxh64_hex(XXH64_digest(state));
      XXH64_freeState(state);
      TESSERA_CHECK(hash == s.mask_xxh64, mask, ": checksum ", hash, " differs from ", manifest_path, "'s ",
                    s.mask_xxh64, " (the file is damaged or was changed after prepare)");
      TESSERA_CHECK(binary, mask, ": holds a byte other than 0 and 1 (not a loss mask)");
    }
    tokens_.push_back(std::make_unique<MappedFile>(file));
    offsets_.push_back(std::make_unique<MappedFile>(offsets));
    masks_.push_back(s.mask_file.empty() ? nullptr : std::make_unique<MappedFile>(dir / s.mask_file));
    if (verify) {
      const auto* o = reinterpret_cast<const std::uint64_t*>(offsets_.back()->data());
      bool ordered = o[0] == 0 && o[s.documents] == static_cast<std::uint64_t>(s.tokens);
      for (std::int64_t d = 0; ordered && d < s.documents; ++d) ordered = o[d] <= o[d + 1];
      TESSERA_CHECK(ordered, offsets, ": the document offsets are not a non-decreasing run from 0 to ", s.tokens);
    }
  }
}

TokenShards::~TokenShards() = default;

fs::path TokenShards::shard_path(std::int64_t shard) const { return dir_ / manifest_.shards[shard].file; }

std::int64_t TokenShards::document_start(std::int64_t shard, std::int64_t d) const {
  std::uint64_t value;
  std::memcpy(&value, offsets_[shard]->data() + 8 * d, 8);
  TESSERA_CHECK(value <= static_cast<std::uint64_t>(tokens(shard)), dir_ / manifest_.shards[shard].offsets_file,
                ": document ", d, " starts at token ", value, ", past the shard's ", tokens(shard), " tokens");
  return static_cast<std::int64_t>(value);
}

void TokenShards::read(std::int64_t shard, std::int64_t begin, std::int64_t count, std::int64_t* out) const {
  const std::uint8_t* base = tokens_[shard]->data();
  std::int64_t largest = 0;
  if (manifest_.dtype == TokenDtype::uint16) {
    for (std::int64_t i = 0; i < count; ++i) {
      std::uint16_t v;
      std::memcpy(&v, base + 2 * (begin + i), 2);
      out[i] = v;
      largest = std::max<std::int64_t>(largest, v);
    }
  } else {
    for (std::int64_t i = 0; i < count; ++i) {
      std::uint32_t v;
      std::memcpy(&v, base + 4 * (begin + i), 4);
      out[i] = v;
      largest = std::max<std::int64_t>(largest, v);
    }
  }
  TESSERA_CHECK(largest < manifest_.vocab_size, shard_path(shard), ": token id ", largest, " near token ", begin,
                " is out of range for vocab_size ", manifest_.vocab_size, " (", dir_ / kManifestName, ")");
}

void TokenShards::read_mask(std::int64_t shard, std::int64_t begin, std::int64_t count, std::uint8_t* out) const {
  TESSERA_CHECK(masks_[shard] != nullptr, shard_path(shard), " has no loss mask");
  std::memcpy(out, masks_[shard]->data() + begin, static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) out[i] = out[i] != 0;  // unverified bytes: still 0 or 1
}

}  // namespace tessera::toolkit
