#pragma once
// What a rank tells the user: its log file (every rank: default_root_dir/logs/rank-K.log),
// the terminal (rank 0 only: a live progress bar on a TTY, plain lines otherwise) and the
// metrics CSV (rank 0 only: default_root_dir/metrics.csv, one row per metric value).
#include <chrono>
#include <fstream>
#include <map>
#include <string>

namespace tessera::host {

class RunLog {
 public:
  RunLog(const std::string& root_dir, std::int64_t rank, const std::string& progress_bar);
  ~RunLog();

  /// A line for the log file and (rank 0) the terminal.
  void info(const std::string& line);
  /// A line for the log file only.
  void to_file(const std::string& line);
  /// Progress of training (rank 0): redraws the bar on a terminal; `line` goes to the log.
  void progress(const std::string& bar, const std::string& line, bool force_line);
  /// One row per metric in metrics.csv (rank 0).
  void metrics(std::int64_t step, std::int64_t epoch, const std::string& stage,
               const std::map<std::string, double>& values);
  const std::string& log_path() const { return log_path_; }
  bool is_terminal() const { return terminal_; }

 private:
  void end_bar();

  std::int64_t rank_;
  bool terminal_;
  bool bar_open_ = false;
  std::string log_path_;
  std::ofstream log_;
  std::ofstream csv_;
};

}  // namespace tessera::host
