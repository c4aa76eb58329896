#include "loggers/record_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "tessera/sdk/error.hpp"

namespace tessera::host {

std::string record_write_advice() {
  return "; the run stops here (checkpoints already committed are kept): free space there, or point "
         "[trainer] default_root_dir at another filesystem";
}

RecordFile::RecordFile(std::string path, Mode mode) : path_(std::move(path)) {
  const int flags = O_WRONLY | O_CREAT | O_CLOEXEC | (mode == Mode::append ? O_APPEND : O_TRUNC);
  fd_ = ::open(path_.c_str(), flags, 0644);
  TESSERA_CHECK(fd_ >= 0, "cannot open the run record ", path_, " for writing: ", std::strerror(errno),
                record_write_advice());
}

RecordFile::RecordFile(RecordFile&& other) noexcept
    : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)) {}

RecordFile& RecordFile::operator=(RecordFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

RecordFile::~RecordFile() {
  if (fd_ >= 0) ::close(fd_);
}

void RecordFile::write(std::string_view text) {
  if (fd_ < 0) return;
  std::size_t written = 0;
  while (written < text.size()) {
    const ssize_t n = ::write(fd_, text.data() + written, text.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = n < 0 ? errno : ENOSPC;
      ::close(std::exchange(fd_, -1));
      TESSERA_FAIL("cannot write the run record ", path_, ": ", std::strerror(error), " (wrote ", written, " of ",
                   text.size(), " bytes)", record_write_advice());
    }
    written += static_cast<std::size_t>(n);
  }
}

void RecordFile::close() {
  if (fd_ < 0) return;
  const int result = ::close(std::exchange(fd_, -1));
  TESSERA_CHECK(result == 0, "cannot write the run record ", path_, ": ", std::strerror(errno), " (on close)",
                record_write_advice());
}

void write_record(const std::string& path, std::string_view text) {
  RecordFile file(path, RecordFile::Mode::truncate);
  file.write(text);
  file.close();
}

}  // namespace tessera::host
