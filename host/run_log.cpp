#include "run_log.hpp"

#include <unistd.h>

#include <filesystem>
#include <iomanip>
#include <iostream>

namespace tessera::host {

RunLog::RunLog(const std::string& root_dir, std::int64_t rank, const std::string& progress_bar)
    : rank_(rank),
      terminal_(rank == 0 && (progress_bar == "true" || (progress_bar == "auto" && ::isatty(STDOUT_FILENO)))),
      log_path_(root_dir + "/logs/rank-" + std::to_string(rank) + ".log") {
  std::filesystem::create_directories(root_dir + "/logs");
  log_.open(log_path_, std::ios::app);
  if (rank_ == 0) {
    std::string csv = root_dir + "/metrics.csv";
    bool fresh = !std::filesystem::exists(csv);
    csv_.open(csv, std::ios::app);
    if (fresh) csv_ << "step,epoch,stage,metric,value\n";
  }
}

RunLog::~RunLog() { end_bar(); }

void RunLog::end_bar() {
  if (bar_open_) std::cout << "\n" << std::flush;
  bar_open_ = false;
}

void RunLog::info(const std::string& line) {
  log_ << line << "\n" << std::flush;
  if (rank_ != 0) return;
  end_bar();
  std::cout << line << "\n" << std::flush;
}

void RunLog::to_file(const std::string& line) { log_ << line << "\n" << std::flush; }

void RunLog::progress(const std::string& bar, const std::string& line, bool force_line) {
  if (force_line) log_ << line << "\n" << std::flush;
  if (rank_ != 0) return;
  if (terminal_) {
    std::cout << "\r\033[K" << bar << std::flush;
    bar_open_ = true;
  } else if (force_line) {
    std::cout << line << "\n" << std::flush;
  }
}

void RunLog::metrics(std::int64_t step, std::int64_t epoch, const std::string& stage,
                     const std::map<std::string, double>& values) {
  if (rank_ != 0) return;
  for (const auto& [name, value] : values)
    csv_ << step << "," << epoch << "," << stage << "," << name << "," << std::setprecision(8) << value << "\n";
  csv_.flush();
}

}  // namespace tessera::host
