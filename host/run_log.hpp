#pragma once
// What a rank tells the user: its log file (every rank: default_root_dir/logs/rank-K.log)
// and the terminal (rank 0 only: a live progress bar on a terminal, plain lines otherwise).
// Metrics go to the run's loggers (loggers/).
#include <fstream>
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
  /// Progress (rank 0): redraws `bar` on a terminal; `line` goes to the log, and to stdout
  /// when it is not a terminal, if `force_line`.
  void progress(const std::string& bar, const std::string& line, bool force_line);
  const std::string& log_path() const { return log_path_; }
  bool is_terminal() const { return terminal_; }

  /// `value` with `precision` significant digits, as the log writes numbers.
  static std::string number(double value, int precision = 4);
  /// "[#####.....]  50%" for `fraction` of `width` cells.
  static std::string bar(double fraction, int width = 20);
  /// Whether stdout is a terminal the user sees: a TTY, and so is our parent's stdout when
  /// it writes elsewhere. Under mpirun a rank's stdout is a pseudo-terminal of mpirun's even
  /// when mpirun's own output goes to a file: then this is false.
  static bool stdout_is_user_terminal();

 private:
  void end_bar();

  std::int64_t rank_;
  bool terminal_;
  bool bar_open_ = false;
  std::string log_path_;
  std::ofstream log_;
};

}  // namespace tessera::host
