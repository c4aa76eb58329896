#include "tessera/core/safetensors.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <algorithm>
#include <climits>
#include <cstring>
#include <filesystem>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "tessera/sdk/error.hpp"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian; so is this writer");

namespace tessera::core {

namespace {

using json = nlohmann::ordered_json;

const std::vector<std::pair<at::ScalarType, const char*>>& dtype_names() {
  static const std::vector<std::pair<at::ScalarType, const char*>> names{
      {at::kDouble, "F64"}, {at::kFloat, "F32"}, {at::kHalf, "F16"},  {at::kBFloat16, "BF16"}, {at::kLong, "I64"},
      {at::kInt, "I32"},    {at::kShort, "I16"}, {at::kChar, "I8"},   {at::kByte, "U8"},       {at::kBool, "BOOL"}};
  return names;
}

std::string hex(XXH64_hash_t hash) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(hash));
  return text;
}

/// Streams bytes into the whole-file hash and the per-block hashes.
class Digester {
 public:
  Digester() : whole_(XXH64_createState()), block_(XXH64_createState()) {
    XXH64_reset(whole_, 0);
    XXH64_reset(block_, 0);
  }
  ~Digester() {
    XXH64_freeState(whole_);
    XXH64_freeState(block_);
  }
  void update(const char* data, std::int64_t n) {
    XXH64_update(whole_, data, static_cast<std::size_t>(n));
    while (n > 0) {
      const std::int64_t take = std::min(n, kChecksumBlock - in_block_);
      XXH64_update(block_, data, static_cast<std::size_t>(take));
      data += take, n -= take, in_block_ += take, digest_.size += take;
      if (in_block_ == kChecksumBlock) close_block();
    }
  }
  FileDigest finish() {
    if (in_block_ > 0) close_block();
    digest_.xxh64 = hex(XXH64_digest(whole_));
    return digest_;
  }

 private:
  void close_block() {
    digest_.blocks.push_back(hex(XXH64_digest(block_)));
    XXH64_reset(block_, 0);
    in_block_ = 0;
  }
  XXH64_state_t* whole_;
  XXH64_state_t* block_;
  std::int64_t in_block_ = 0;
  FileDigest digest_;
};

[[noreturn]] void fail_errno(const std::string& what, const std::string& path, int error) {
  TESSERA_FAIL("cannot ", what, " ", path, ": ", std::strerror(error),
               error == ENOSPC ? " (the disk is full)" : "");
}

}  // namespace

std::string safetensors_dtype(at::ScalarType type) {
  for (const auto& [t, name] : dtype_names())
    if (t == type) return name;
  TESSERA_FAIL("tensors of type ", type, " cannot be stored in safetensors");
}

at::ScalarType scalar_type_of(const std::string& dtype, const std::string& where) {
  std::vector<std::string> valid;
  for (const auto& [t, name] : dtype_names()) {
    if (dtype == name) return t;
    valid.push_back(name);
  }
  TESSERA_FAIL(where, ": dtype \"", dtype, "\" is not one this reader knows (", sdk::join(valid), ")");
}

FileDigest write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                             const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  for (const auto& [name, t] : tensors) specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  return write_safetensors(path, specs, [&](std::size_t i) { return tensors[i].second; }, metadata);
}

FileDigest write_safetensors(const std::string& path, const std::vector<TensorSpec>& specs,
                             const std::function<at::Tensor(std::size_t)>& produce,
                             const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::int64_t offset = 0;
  for (const TensorSpec& spec : specs) {
    TESSERA_CHECK(spec.name != "__metadata__" && !header.contains(spec.name), path, ": tensor name '", spec.name,
                  "' is used twice");
    std::int64_t numel = 1;
    for (auto d : spec.shape) numel *= d;
    const std::int64_t bytes = numel * static_cast<std::int64_t>(c10::elementSize(spec.dtype));
    header[spec.name] = {{"dtype", safetensors_dtype(spec.dtype)}, {"shape", spec.shape},
                         {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  const std::uint64_t length = text.size();

  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail_errno("create", path, errno);
  Digester digest;
  try {
    auto put = [&](const char* data, std::int64_t n) {
      digest.update(data, n);
      while (n > 0) {
        const ssize_t done = ::write(fd, data, static_cast<std::size_t>(std::min<std::int64_t>(n, 1 << 26)));
        if (done < 0 && errno == EINTR) continue;
        if (done <= 0) fail_errno("write", path, done < 0 ? errno : ENOSPC);
        data += done, n -= done;
      }
    };
    put(reinterpret_cast<const char*>(&length), 8);
    put(text.data(), static_cast<std::int64_t>(text.size()));
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const at::Tensor cpu = produce(i).detach().to(at::kCPU).contiguous();
      TESSERA_CHECK(cpu.scalar_type() == specs[i].dtype && cpu.sizes() == at::IntArrayRef(specs[i].shape), path,
                    ": tensor '", specs[i].name, "' is not the ", safetensors_dtype(specs[i].dtype), " ",
                    at::IntArrayRef(specs[i].shape), " its header says");
      put(static_cast<const char*>(cpu.data_ptr()), static_cast<std::int64_t>(cpu.numel() * cpu.element_size()));
    }
    if (::fsync(fd) != 0) fail_errno("fsync", path, errno);
    if (::close(fd) != 0) fail_errno("close", path, errno);
  } catch (...) {
    ::close(fd);
    std::error_code ec;
    std::filesystem::remove(path, ec);
    throw;
  }
  return digest.finish();
}

FileDigest digest_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail_errno("open", path, errno);
  Digester digest;
  std::vector<char> buffer(static_cast<std::size_t>(kChecksumBlock));
  for (;;) {
    const ssize_t got = ::read(fd, buffer.data(), buffer.size());
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      const int error = errno;
      ::close(fd);
      fail_errno("read", path, error);
    }
    if (got == 0) break;
    digest.update(buffer.data(), got);
  }
  ::close(fd);
  return digest.finish();
}

std::uint64_t safetensors_header_length(const char* first8, std::int64_t file_size, const std::string& where) {
  TESSERA_CHECK(file_size >= 8, where, " is not a safetensors file: it has only ", file_size, " bytes");
  std::uint64_t length = 0;
  std::memcpy(&length, first8, 8);
  TESSERA_CHECK(length <= static_cast<std::uint64_t>(file_size - 8), where,
                " is not a safetensors file: its header length ", length, " does not fit in its ", file_size,
                " bytes");
  // A header that fits its file may still be more JSON than this reader parses (the same cap as
  // the safetensors library's): say so, rather than blame the file.
  TESSERA_CHECK(length <= kMaxSafetensorsHeader, where, ": its header is ", length,
                " bytes, more than this reader's limit of ", kMaxSafetensorsHeader,
                " bytes (kMaxSafetensorsHeader, the safetensors library's own limit, so its readers refuse the file ",
                "too): a file of fewer tensors (a sharded save_pretrained) has a smaller header");
  return length;
}

SafetensorsHeader parse_safetensors_header(std::string_view bytes, std::int64_t file_size, const std::string& where) {
  TESSERA_CHECK(bytes.size() >= 8, where, " is not a safetensors file: it has only ", bytes.size(), " bytes");
  const std::uint64_t length = safetensors_header_length(bytes.data(), file_size, where);
  TESSERA_CHECK(bytes.size() - 8 >= length, where, ": only ", bytes.size(), " of its header's ", 8 + length,
                " bytes were given");
  SafetensorsHeader out;
  out.data_start = 8 + static_cast<std::int64_t>(length);
  const std::int64_t data_bytes = file_size - out.data_start;
  json header;
  try {
    header = json::parse(bytes.data() + 8, bytes.data() + 8 + length);
  } catch (const std::exception& e) {
    TESSERA_FAIL(where, " is not a safetensors file: its header is not JSON (", e.what(), ")");
  }
  TESSERA_CHECK(header.is_object(), where, " is not a safetensors file: its header is not a JSON object");
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;  // data offsets, for the tiling check
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      TESSERA_CHECK(value.is_object(), where, ": __metadata__ is not an object");
      for (const auto& [key, item] : value.items()) {
        TESSERA_CHECK(item.is_string(), where, ": __metadata__['", key, "'] is not a string");
        out.metadata[key] = item.get<std::string>();
      }
      continue;
    }
    const std::string entry = where + " tensor '" + name + "'";
    TESSERA_CHECK(value.is_object() && value.contains("dtype") && value.at("dtype").is_string() &&
                      value.contains("shape") && value.at("shape").is_array() && value.contains("data_offsets") &&
                      value.at("data_offsets").is_array(),
                  entry, ": malformed header entry (it needs \"dtype\": string, \"shape\": [dims], ",
                  "\"data_offsets\": [begin, end])");
    SafetensorsEntry e{scalar_type_of(value.at("dtype").get<std::string>(), entry), {}};
    std::int64_t bytes_needed = static_cast<std::int64_t>(c10::elementSize(e.dtype));
    for (const auto& d : value.at("shape")) {
      TESSERA_CHECK(d.is_number_unsigned() || (d.is_number_integer() && d.get<std::int64_t>() >= 0), entry,
                    ": shape ", value.at("shape").dump(), " holds something other than a non-negative integer");
      TESSERA_CHECK(!d.is_number_unsigned() || d.get<std::uint64_t>() <= std::uint64_t{INT64_MAX}, entry,
                    ": dimension ", d.dump(), " is too large");
      e.shape.push_back(d.get<std::int64_t>());
      TESSERA_CHECK(!__builtin_mul_overflow(bytes_needed, e.shape.back(), &bytes_needed), entry, ": shape ",
                    value.at("shape").dump(), " has more bytes than a file can hold");
    }
    const auto& offsets = value.at("data_offsets");
    TESSERA_CHECK(offsets.size() == 2 && offsets[0].is_number_integer() && offsets[1].is_number_integer() &&
                      offsets[0].get<std::int64_t>() >= 0 && offsets[1].get<std::int64_t>() >= offsets[0].get<std::int64_t>(),
                  entry, ": data_offsets ", offsets.dump(), " is not [begin, end] with 0 <= begin <= end");
    const std::int64_t begin = offsets[0].get<std::int64_t>(), end = offsets[1].get<std::int64_t>();
    TESSERA_CHECK(end - begin == bytes_needed && end <= data_bytes, entry, ": data_offsets [", begin, ", ", end,
                  ") do not hold its ", bytes_needed, " bytes within the file's ", data_bytes,
                  " bytes of data (truncated?)");
    e.begin = out.data_start + begin;
    e.end = out.data_start + end;
    ranges.emplace_back(begin, end);
    out.tensors.emplace(name, std::move(e));
  }
  // The reference reader's rule: the tensors cover the data exactly, in some order.
  std::sort(ranges.begin(), ranges.end());
  std::int64_t covered = 0;
  for (const auto& [begin, end] : ranges) {
    TESSERA_CHECK(begin == covered, where, ": ", begin < covered ? "two tensors share" : "no tensor holds",
                  " the data bytes from ", std::min(begin, covered), " on (data_offsets overlap or leave a gap)");
    covered = end;
  }
  TESSERA_CHECK(covered == data_bytes, where, ": ", data_bytes - covered, " bytes after the last tensor's data ",
                "belong to no tensor");
  return out;
}

SafetensorsReader::SafetensorsReader(std::string path, const FileDigest* expected)
    : path_(std::move(path)), expected_(expected) {
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) fail_errno("open", path_, errno);
  struct stat st{};
  ::fstat(fd_, &st);
  size_ = st.st_size;
  try {
    TESSERA_CHECK(S_ISREG(st.st_mode), path_, " is ", S_ISDIR(st.st_mode) ? "a directory" : "not a regular file",
                  ", not a safetensors file", expected_ ? " (the manifest lists a shard file there): the checkpoint is "
                                                          "damaged; restore the file, or resume from another checkpoint"
                                                        : "");
    if (expected_)
      TESSERA_CHECK(size_ == expected_->size, path_, " has ", size_, " bytes but the manifest says ", expected_->size,
                    ": the file is truncated or was replaced");
    TESSERA_CHECK(size_ >= 8, path_, " is not a safetensors file: it has only ", size_, " bytes");
    // The header is parsed unverified (a caller may first check what file this is);
    // verify_header() and every data read check the blocks they touch.
    const FileDigest* expected = expected_;
    expected_ = nullptr;
    std::string bytes(8, '\0');
    read_bytes(0, 8, bytes.data());
    const std::uint64_t length = safetensors_header_length(bytes.data(), size_, path_);
    bytes.resize(8 + length);
    read_bytes(8, static_cast<std::int64_t>(length), bytes.data() + 8);
    SafetensorsHeader header = parse_safetensors_header(bytes, size_, path_);
    expected_ = expected;
    data_start_ = header.data_start;
    tensors_ = std::move(header.tensors);
    metadata_ = std::move(header.metadata);
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

void SafetensorsReader::verify_header() const {
  std::vector<char> header(static_cast<std::size_t>(data_start_));
  read_bytes(0, data_start_, header.data());
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

const SafetensorsReader::Entry& SafetensorsReader::entry(const std::string& name) const {
  auto it = tensors_.find(name);
  TESSERA_CHECK(it != tensors_.end(), path_, " has no tensor '", name, "'");
  return it->second;
}

at::Tensor SafetensorsReader::read(const std::string& name) const {
  const Entry& e = entry(name);
  at::Tensor out = at::empty(e.shape, at::TensorOptions(e.dtype));
  read_bytes(e.begin, e.end - e.begin, out.data_ptr());
  return out;
}

at::Tensor SafetensorsReader::read_elements(const std::string& name, std::int64_t start, std::int64_t count) const {
  const Entry& e = entry(name);
  const std::int64_t item = static_cast<std::int64_t>(c10::elementSize(e.dtype));
  TESSERA_CHECK(start >= 0 && count >= 0 && e.begin + (start + count) * item <= e.end, path_, " tensor '", name,
                "': elements [", start, ", ", start + count, ") are out of range");
  at::Tensor out = at::empty({count}, at::TensorOptions(e.dtype));
  read_bytes(e.begin + start * item, count * item, out.data_ptr());
  return out;
}

void SafetensorsReader::read_bytes(std::int64_t offset, std::int64_t count, void* out) const {
  auto pread_all = [&](std::int64_t at, std::int64_t n, char* to) {
    while (n > 0) {
      const ssize_t got = ::pread(fd_, to, static_cast<std::size_t>(n), at);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) fail_errno("read", path_, errno);
      TESSERA_CHECK(got > 0, path_, " ends at byte ", at, " while ", n, " more were expected (truncated)");
      at += got, to += got, n -= got;
    }
  };
  char* to = static_cast<char*>(out);
  if (expected_ == nullptr) return pread_all(offset, count, to);
  // Whole blocks are read and checked, then the wanted bytes copied out.
  std::vector<char> block;
  for (std::int64_t b = offset / kChecksumBlock; count > 0; ++b) {
    const std::int64_t block_start = b * kChecksumBlock, n = std::min(kChecksumBlock, size_ - block_start);
    TESSERA_CHECK(b < static_cast<std::int64_t>(expected_->blocks.size()), path_, ": block ", b,
                  " has no checksum in the manifest");
    block.resize(static_cast<std::size_t>(n));
    pread_all(block_start, n, block.data());
    TESSERA_CHECK(hex(XXH64(block.data(), block.size(), 0)) == expected_->blocks[static_cast<std::size_t>(b)], path_,
                  ": checksum mismatch in bytes [", block_start, ", ", block_start + n,
                  "): the file is damaged (or not the one this checkpoint's manifest describes)");
    const std::int64_t from = offset - block_start, take = std::min(count, n - from);
    std::memcpy(to, block.data() + from, static_cast<std::size_t>(take));
    to += take, offset += take, count -= take;
  }
}

}  // namespace tessera::core
