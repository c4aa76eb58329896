#pragma once
// What a rank tells the user: its log file (every rank: the run folder's logs/rank-K.log)
// and the terminal (rank 0 only: a live progress bar on a terminal, plain lines otherwise).
// Metrics go to the run's loggers (loggers/). Every write to the log file is checked
// (record_file.hpp): a full disk ends the run with an error naming the file.
#include <cstdint>
#include <string>

#include "loggers/record_file.hpp"

namespace tessera::host {

class RunLog {
 public:
  /// `log_dir`: the folder of rank-K.log (the run folder's logs/). Empty when the run folder is
  /// not known yet (started by torchrun, Slurm or mpirun, or on several nodes): lines are then
  /// held until attach().
  RunLog(const std::string& log_dir, std::int64_t rank, const std::string& progress_bar);
  ~RunLog();

  /// Opens `log_dir`/rank-K.log (appending) and writes the lines held so far; no-op when the
  /// log is already in `log_dir`.
  void attach(const std::string& log_dir);

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
  void write_file(const std::string& line);

  std::int64_t rank_;
  bool terminal_;
  bool bar_open_ = false;
  std::string log_dir_, log_path_;
  RecordFile log_;
  std::string held_;  ///< lines written before attach()
};

}  // namespace tessera::host
