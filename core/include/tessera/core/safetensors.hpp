#pragma once
/// safetensors files (https://github.com/huggingface/safetensors): an 8-byte little-endian
/// header length, a JSON header {name: {"dtype", "shape", "data_offsets"}, "__metadata__":
/// {str: str}}, then raw little-endian tensor data. Python, Rust and C++ read them, and a
/// reader can fetch one tensor, or a byte range of it, without parsing the rest.
/// Integrity: xxh64 of the whole file and of every kChecksumBlock bytes, so a reader of a
/// byte range verifies just the blocks it reads.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace tessera::core {

constexpr std::int64_t kChecksumBlock = std::int64_t{1} << 20;

/// A file's size and checksums (hex xxh64): of the whole file and of each block.
struct FileDigest {
  std::int64_t size = 0;
  std::string xxh64;
  std::vector<std::string> blocks;
};

/// Writes `tensors` (in order; CPU or not, any layout) and `metadata` to `path` and fsyncs it.
/// A failure (a full disk included) removes the partial file and throws naming `path`.
FileDigest write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                             const std::map<std::string, std::string>& metadata);

/// The same, streaming: the header from `specs`, then each tensor's data from `produce(i)`
/// (which must match its spec), so only one tensor at a time needs to be in memory.
struct TensorSpec {
  std::string name;
  at::ScalarType dtype;
  std::vector<std::int64_t> shape;
};
FileDigest write_safetensors(const std::string& path, const std::vector<TensorSpec>& specs,
                             const std::function<at::Tensor(std::size_t)>& produce,
                             const std::map<std::string, std::string>& metadata);

/// The xxh64 digest of a whole file as write_safetensors computes it (for verification).
FileDigest digest_file(const std::string& path);

/// A safetensors header, parsed: each tensor's dtype, shape and byte range in the file.
struct SafetensorsEntry {
  at::ScalarType dtype;
  std::vector<std::int64_t> shape;
  std::int64_t begin = 0, end = 0;  ///< byte offsets in the file
};
struct SafetensorsHeader {
  std::int64_t data_start = 0;  ///< 8 + the header's length (where offset 0 of data_offsets is)
  std::map<std::string, SafetensorsEntry> tensors;
  std::map<std::string, std::string> metadata;
};
/// The largest header a reader accepts (the Rust reference's limit).
constexpr std::uint64_t kMaxSafetensorsHeader = 100'000'000;
/// The 8-byte header length at the start of a file of `file_size` bytes, checked against it.
std::uint64_t safetensors_header_length(const char* first8, std::int64_t file_size, const std::string& where);
/// Parses the start of an untrusted file of `file_size` bytes: `bytes` holds at least its
/// first 8 + header-length bytes. Strict, as the format's reference reader: a header length
/// within the file and kMaxSafetensorsHeader, a JSON object, known dtypes, non-negative dims
/// whose byte count does not overflow, data_offsets [begin, end] matching it, and tensors that
/// tile the data exactly (no overlap, no gap, nothing after the last). Throws sdk::Error naming
/// `where` on anything else; never reads outside `bytes`.
SafetensorsHeader parse_safetensors_header(std::string_view bytes, std::int64_t file_size, const std::string& where);

/// Reads tensors from one safetensors file; with an expected digest, the size is checked at
/// open and every block read is checked against it (a mismatch throws naming the file).
class SafetensorsReader {
 public:
  using Entry = SafetensorsEntry;
  /// Opens `path` and parses its header (with `expected`: after checking the file's size; the
  /// header's checksum is checked by verify_header() or the first read of its block).
  explicit SafetensorsReader(std::string path, const FileDigest* expected = nullptr);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, Entry>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const Entry& entry(const std::string& name) const;
  /// Checks the header's bytes against the expected digest.
  void verify_header() const;
  /// The whole tensor, in its stored shape.
  at::Tensor read(const std::string& name) const;
  /// Elements [start, start + count) of the flattened tensor, as a 1-D tensor.
  at::Tensor read_elements(const std::string& name, std::int64_t start, std::int64_t count) const;

 private:
  void read_bytes(std::int64_t offset, std::int64_t count, void* out) const;
  std::string path_;
  int fd_ = -1;
  const FileDigest* expected_ = nullptr;
  std::int64_t size_ = 0, data_start_ = 0;
  std::map<std::string, Entry> tensors_;
  std::map<std::string, std::string> metadata_;
};

/// The safetensors dtype name ("F32", "BF16", "I64", ...) of a scalar type, and back.
std::string safetensors_dtype(at::ScalarType type);
at::ScalarType scalar_type_of(const std::string& dtype, const std::string& where);

}  // namespace tessera::core
