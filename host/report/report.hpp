#pragma once
// `tessera report RUN_DIR`: one self-contained HTML page of a run (inline SVG, no script, nothing
// fetched): train and validation loss, learning rate, throughput and peak memory per rank, and the
// run's config. A resumed run is joined with the runs it resumed from into one curve.
#include <map>
#include <string>
#include <vector>

namespace tessera::host {

/// One metric over steps: step -> value.
using Series = std::map<std::int64_t, double>;

/// What a run folder (or a chain of resumed ones) recorded, as the report draws it.
struct RunRecord {
  std::vector<std::string> folders;  ///< oldest first: the runs joined
  std::vector<std::int64_t> resumed_at;  ///< the first step of each folder after the first
  Series train_loss, val_loss, lr;
  std::string lr_name;      ///< "lr-AdamW" from the lr monitor, or "lr" from the step lines
  std::string rate_unit;    ///< "tokens", "samples", ...
  std::map<int, Series> rate;         ///< rank -> items/s at the logged steps
  std::map<int, double> peak_rss_mb;  ///< rank -> its peak RSS (MB)
  double peak_rss_max_mb = -1;        ///< metrics.csv's max over ranks, -1 when absent
  std::string config;                 ///< the newest folder's config.toml
};

/// Reads `run_dir` (metrics.csv, logs/rank-N.log, config.toml) and, through the checkpoint its
/// fit restored ("restored PATH" in its rank-0 log), the runs it resumed from. Throws sdk::Error
/// naming the folder when it is not a run folder.
RunRecord read_run(const std::string& run_dir);

/// The HTML page of a record.
std::string render_report(const RunRecord& record);

/// `tessera report RUN_DIR [--out FILE.html]`: exit code.
int report_tool(int argc, char** argv);

}  // namespace tessera::host
