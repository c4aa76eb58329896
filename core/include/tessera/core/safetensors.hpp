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

/// Reads tensors from one safetensors file; with an expected digest, the size is checked at
/// open and every block read is checked against it (a mismatch throws naming the file).
class SafetensorsReader {
 public:
  struct Entry {
    at::ScalarType dtype;
    std::vector<std::int64_t> shape;
    std::int64_t begin = 0, end = 0;  ///< byte offsets in the file
  };
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
