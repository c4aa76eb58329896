#include "loggers/run_log.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <utility>

namespace tessera::host {

bool RunLog::stdout_is_user_terminal() {
  if (!::isatty(STDOUT_FILENO)) return false;
  // A launcher that relays our output through a pseudo-terminal (Open MPI does) while its own
  // stdout is a file or a pipe: the user sees no terminal, so no escape codes.
  std::string parent_stdout = "/proc/" + std::to_string(::getppid()) + "/fd/1";
  int fd = ::open(parent_stdout.c_str(), O_WRONLY | O_NOCTTY | O_CLOEXEC);
  if (fd < 0) return true;  // cannot tell (another user's process): trust our own stdout
  bool parent_tty = ::isatty(fd);
  ::close(fd);
  return parent_tty;
}

RunLog::RunLog(const std::string& log_dir, std::int64_t rank, const std::string& progress_bar)
    : rank_(rank),
      terminal_(rank == 0 && (progress_bar == "true" || (progress_bar == "auto" && stdout_is_user_terminal()))) {
  if (!log_dir.empty()) attach(log_dir);
}

void RunLog::attach(const std::string& log_dir) {
  if (log_dir == log_dir_) return;
  std::filesystem::create_directories(log_dir);
  log_dir_ = log_dir;
  log_path_ = log_dir + "/rank-" + std::to_string(rank_) + ".log";
  log_ = RecordFile(log_path_, RecordFile::Mode::append);
  log_.write(std::exchange(held_, {}));
}

void RunLog::write_file(const std::string& line) {
  if (log_dir_.empty()) held_ += line + "\n";
  else log_.write(line + "\n");
}

RunLog::~RunLog() { end_bar(); }

std::string RunLog::number(double value, int precision) {
  std::ostringstream out;
  out << std::setprecision(precision) << value;
  return out.str();
}

std::string RunLog::bar(double fraction, int width) {
  fraction = std::clamp(fraction, 0.0, 1.0);
  int filled = static_cast<int>(std::floor(fraction * width));
  char percent[8];
  std::snprintf(percent, sizeof(percent), "%3d%%", static_cast<int>(std::floor(fraction * 100)));
  return "[" + std::string(filled, '#') + std::string(width - filled, '.') + "] " + percent;
}

void RunLog::end_bar() {
  if (bar_open_) std::cout << "\n" << std::flush;
  bar_open_ = false;
}

void RunLog::info(const std::string& line) {
  write_file(line);
  if (rank_ != 0) return;
  end_bar();
  std::cout << line << "\n" << std::flush;
}

void RunLog::to_file(const std::string& line) { write_file(line); }

void RunLog::progress(const std::string& bar, const std::string& line, bool force_line) {
  if (force_line) write_file(line);
  if (rank_ != 0) return;
  if (terminal_) {
    std::cout << "\r\033[K" << bar << std::flush;
    bar_open_ = true;
  } else if (force_line) {
    std::cout << line << "\n" << std::flush;
  }
}

}  // namespace tessera::host
