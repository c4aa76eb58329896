#pragma once
// torch.save archives embedded at byte ranges of one file: DCP's `__R_K.distcp` holds each
// tensor chunk as a torch.save record at the offset and length its `.metadata` records.
#include <cstdint>
#include <memory>
#include <ostream>
#include <string>

#include <ATen/core/ivalue.h>

namespace tessera::core {

class EmbeddedArchives {
 public:
  /// Maps `path` (private, copy-on-write); a missing or empty file throws naming it.
  explicit EmbeddedArchives(const std::string& path);
  std::size_t size() const;
  /// torch.load of bytes [offset, offset + length), checked as load_pickle checks a file (the
  /// range inside the file, a zip archive, only allowed globals, every storage inside it); its
  /// tensors point into the mapping, so only the pages of the archives read become resident.
  c10::IValue load(std::uint64_t offset, std::uint64_t length) const;

 private:
  std::string path_;
  std::shared_ptr<void> file_;  // checkpoint.cpp's MappedFile
};

/// Appends `value` to `out` as torch.save writes a file (a zip archive; torch.load reads the
/// bytes back); returns how many bytes it wrote. What save_pickle writes, without the file.
std::size_t write_archive(const c10::IValue& value, std::ostream& out);

}  // namespace tessera::core
