#pragma once
// Run records (config.toml, hparams.yaml, metrics.csv, rank logs, TensorBoard events, lr_find.csv,
// profiler output): every write is checked. A full disk or a short write is an error that names
// the file and the reason, never a silently empty record.
#include <string>
#include <string_view>

namespace tessera::host {

/// One record file, written through POSIX write() so that each failure is seen where it happens.
class RecordFile {
 public:
  enum class Mode { truncate, append };
  RecordFile() = default;
  /// Opens (creating) `path`; throws sdk::Error naming it and the reason.
  RecordFile(std::string path, Mode mode);
  RecordFile(RecordFile&& other) noexcept;
  RecordFile& operator=(RecordFile&& other) noexcept;
  RecordFile(const RecordFile&) = delete;
  RecordFile& operator=(const RecordFile&) = delete;
  ~RecordFile();

  /// Writes all of `text`; a failed or short write throws sdk::Error ("cannot write PATH: No
  /// space left on device (wrote 4096 of 5000 bytes) ..."). After a failure the file is closed
  /// and later writes are dropped, so an error path that logs does not fail a second time.
  void write(std::string_view text);
  /// Closes, checking close() too (a network filesystem reports late errors there).
  void close();
  bool is_open() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

/// Writes `text` as the whole of `path` (checked, as RecordFile).
void write_record(const std::string& path, std::string_view text);

/// The advice every record-write error ends with.
std::string record_write_advice();

}  // namespace tessera::host
