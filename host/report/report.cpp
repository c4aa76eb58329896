#include "report/report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <regex>
#include <sstream>

#include "tessera/sdk/error.hpp"

namespace tessera::host {

namespace {

namespace fs = std::filesystem;

constexpr const char* kUsage = R"(usage:
  tessera report RUN_DIR [--out FILE.html]
    one self-contained HTML page of a run (inline SVG: no script, nothing fetched): train and
    validation loss, learning rate, throughput and peak memory per rank, and the run's config.
    RUN_DIR is a run folder (default_root_dir/version_N); a fit resumed from another run's
    checkpoint is joined with the runs it resumed from into one curve. Written to
    RUN_DIR/report.html unless --out names a file.
)";

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

std::vector<std::string> split_csv(const std::string& line) {
  std::vector<std::string> fields;
  std::string field;
  std::istringstream in(line);
  while (std::getline(in, field, ',')) fields.push_back(field);
  return fields;
}

bool parse_double(const std::string& text, double& out) {
  char* end = nullptr;
  out = std::strtod(text.c_str(), &end);
  return end != text.c_str() && *end == '\0' && std::isfinite(out);
}

/// One run folder's own records, before joining.
struct Folder {
  std::string path;
  std::map<std::string, Series> metrics;  ///< metrics.csv: metric -> step -> value
  std::map<int, Series> rate, lr;         ///< per rank, from the step lines of logs/rank-N.log
  std::map<int, double> peak_rss_mb;
  std::string rate_unit, restored;  ///< the checkpoint this fit resumed from ("" if none)
  bool fit = false;
};

Folder read_folder(const fs::path& dir) {
  Folder f;
  f.path = dir.string();
  std::error_code ec;
  if (std::ifstream csv(dir / "metrics.csv"); csv) {
    std::string line;
    std::getline(csv, line);  // step,epoch,stage,metric,value
    while (std::getline(csv, line)) {
      const auto fields = split_csv(line);
      double value = 0, step = 0;
      if (fields.size() == 5 && parse_double(fields[0], step) && parse_double(fields[4], value))
        f.metrics[fields[3]][static_cast<std::int64_t>(step)] = value;
    }
  }
  static const std::regex step_line(R"(^epoch \d+ step (\d+)(?:/\d+)?  loss \S+  lr (\S+)  (\S+) (\S+)/s)");
  static const std::regex peak_line(R"(^peak RSS of rank (\d+): (\S+) MB)");
  static const std::regex restored_line(R"(^restored (.+) \(resuming at step \d+\))");
  for (const auto& entry : fs::directory_iterator(dir / "logs", ec)) {
    const std::string name = entry.path().filename().string();
    int rank = -1;
    if (std::sscanf(name.c_str(), "rank-%d.log", &rank) != 1 || rank < 0) continue;
    std::ifstream in(entry.path());
    std::string line;
    bool first = true;
    while (std::getline(in, line)) {
      if (first && rank == 0) f.fit = line.rfind("tessera fit:", 0) == 0;
      first = false;
      std::smatch m;
      double lr = 0, rate = 0;
      if (std::regex_search(line, m, step_line) && parse_double(m[2], lr) && parse_double(m[3], rate)) {
        const std::int64_t step = std::stoll(m[1]);
        f.lr[rank][step] = lr;
        f.rate[rank][step] = rate;
        f.rate_unit = m[4];
      } else if (std::regex_search(line, m, peak_line) && parse_double(m[2], rate)) {
        f.peak_rss_mb[std::stoi(m[1])] = rate;
      } else if (rank == 0 && std::regex_search(line, m, restored_line)) {
        f.restored = m[1];
      }
    }
  }
  return f;
}

/// The run folder a restored checkpoint path belongs to: RUN/checkpoints/..., as written (from
/// the fit's working directory) or beside `dir` (the runs of one default_root_dir).
std::string run_of_checkpoint(const std::string& checkpoint, const fs::path& dir) {
  const std::size_t at = checkpoint.rfind("/checkpoints/");
  if (at == std::string::npos) return "";
  const fs::path run = checkpoint.substr(0, at);
  std::error_code ec;
  for (const fs::path& candidate : {run, dir.parent_path() / run.filename()})
    if (fs::is_regular_file(candidate / "config.toml", ec) && !fs::equivalent(candidate, dir, ec))
      return candidate.string();
  return "";
}

/// Joins series oldest first: a later run's points replace the earlier ones from its first step on
/// (what the earlier run logged after the checkpoint it was resumed from is not the run's history).
void join(Series& into, const Series& later) {
  if (later.empty()) return;
  into.erase(into.lower_bound(later.begin()->first), into.end());
  into.insert(later.begin(), later.end());
}

// --- drawing -------------------------------------------------------------------------------

std::string escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '&') out += "&amp;";
    else if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '"') out += "&quot;";
    else out += c;
  }
  return out;
}

std::string number(double value) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.4g", value);
  return buffer;
}

std::string fixed(double value) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.1f", value);
  return buffer;
}

/// About `count` round tick values (1, 2, 5 x 10^k) covering [lo, hi].
std::vector<double> ticks(double lo, double hi, int count) {
  const double raw = (hi - lo) / count, magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  double step = magnitude;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * magnitude >= raw) {
      step = m * magnitude;
      break;
    }
  std::vector<double> out;
  for (double v = std::ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push_back(std::abs(v) < step * 1e-9 ? 0 : v);
  return out;
}

struct Line {
  std::string label, colour;
  Series points;
  double width = 2.5;  ///< wider lines first: a later series drawn on an equal one leaves it visible as a border
};

constexpr double kWidth = 760, kHeight = 300, kLeft = 80, kRight = 20, kTop = 34, kBottom = 46;

/// A line chart: each series a polyline with a dot per point, axes with round ticks, a legend,
/// and a dashed rule at each step where a resumed run begins.
std::string line_chart(const std::string& id, const std::string& title, const std::string& y_label,
                       const std::vector<Line>& lines, const std::vector<std::int64_t>& resumed_at) {
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (const Line& l : lines)
    for (const auto& [step, value] : l.points) {
      x0 = std::min(x0, static_cast<double>(step)), x1 = std::max(x1, static_cast<double>(step));
      y0 = std::min(y0, value), y1 = std::max(y1, value);
    }
  std::ostringstream svg;
  svg << "<svg id=\"" << id << "\" class=\"chart\" width=\"" << kWidth << "\" height=\"" << kHeight
      << "\" viewBox=\"0 0 " << kWidth << " " << kHeight << "\" role=\"img\" aria-label=\"" << escape(title) << "\">\n"
      << "<text x=\"" << kLeft << "\" y=\"20\" class=\"title\">" << escape(title) << "</text>\n";
  if (!std::isfinite(x0)) {
    svg << "<text x=\"" << kLeft << "\" y=\"" << kHeight / 2 << "\" class=\"none\">not recorded by this run</text>\n</svg>\n";
    return svg.str();
  }
  if (x1 == x0) x0 -= 1, x1 += 1;
  const double pad = y1 > y0 ? 0.06 * (y1 - y0) : (y0 != 0 ? 0.1 * std::abs(y0) : 1.0);
  y0 -= pad, y1 += pad;
  const double pw = kWidth - kLeft - kRight, ph = kHeight - kTop - kBottom;
  auto X = [&](double step) { return kLeft + (step - x0) / (x1 - x0) * pw; };
  auto Y = [&](double value) { return kTop + (y1 - value) / (y1 - y0) * ph; };
  svg << "<rect x=\"" << kLeft << "\" y=\"" << kTop << "\" width=\"" << pw << "\" height=\"" << ph
      << "\" class=\"plot\"/>\n";
  for (double t : ticks(y0, y1, 5))
    svg << "<line x1=\"" << kLeft << "\" x2=\"" << kLeft + pw << "\" y1=\"" << fixed(Y(t)) << "\" y2=\"" << fixed(Y(t))
        << "\" class=\"grid\"/><text x=\"" << kLeft - 6 << "\" y=\"" << fixed(Y(t) + 4) << "\" class=\"ytick\">"
        << number(t) << "</text>\n";
  for (double t : ticks(x0, x1, 6)) {
    if (std::abs(t - std::round(t)) > 1e-9) continue;  // steps are whole
    svg << "<line x1=\"" << fixed(X(t)) << "\" x2=\"" << fixed(X(t)) << "\" y1=\"" << kTop + ph << "\" y2=\""
        << kTop + ph + 4 << "\" class=\"axis\"/><text x=\"" << fixed(X(t)) << "\" y=\"" << kTop + ph + 18
        << "\" class=\"xtick\">" << number(t) << "</text>\n";
  }
  svg << "<text x=\"" << kLeft + pw / 2 << "\" y=\"" << kHeight - 6 << "\" class=\"xlabel\">step</text>\n"
      << "<text x=\"16\" y=\"" << kTop + ph / 2 << "\" class=\"ylabel\" transform=\"rotate(-90 16 " << kTop + ph / 2
      << ")\">" << escape(y_label) << "</text>\n";
  for (std::int64_t step : resumed_at)
    svg << "<line x1=\"" << fixed(X(static_cast<double>(step))) << "\" x2=\"" << fixed(X(static_cast<double>(step)))
        << "\" y1=\"" << kTop << "\" y2=\"" << kTop + ph << "\" class=\"resume\"><title>resumed at step " << step
        << "</title></line>\n";
  double legend_x = kLeft + pw;
  for (auto it = lines.rbegin(); it != lines.rend(); ++it) {  // right-aligned legend, text after a short rule
    const Line& l = *it;
    legend_x -= 30 + 7.0 * static_cast<double>(l.label.size());
    svg << "<line x1=\"" << fixed(legend_x) << "\" x2=\"" << fixed(legend_x + 16) << "\" y1=\"16\" y2=\"16\" stroke=\""
        << l.colour << "\" stroke-width=\"3\"/><text x=\"" << fixed(legend_x + 20) << "\" y=\"20\" class=\"legend\">"
        << escape(l.label) << "</text>\n";
  }
  for (const Line& l : lines) {
    if (l.points.empty()) continue;
    svg << "<polyline class=\"series\" data-series=\"" << escape(l.label) << "\" fill=\"none\" stroke=\"" << l.colour
        << "\" stroke-width=\"" << l.width << "\" points=\"";
    for (const auto& [step, value] : l.points) svg << fixed(X(static_cast<double>(step))) << "," << fixed(Y(value)) << " ";
    svg << "\"/>\n";
    for (const auto& [step, value] : l.points)
      svg << "<circle cx=\"" << fixed(X(static_cast<double>(step))) << "\" cy=\"" << fixed(Y(value))
          << "\" r=\"3.5\" fill=\"" << l.colour << "\"><title>" << escape(l.label) << " at step " << step << ": "
          << number(value) << "</title></circle>\n";
  }
  svg << "</svg>\n";
  return svg.str();
}

/// One bar per rank.
std::string bar_chart(const std::string& id, const std::string& title, const std::map<int, double>& values,
                      const std::string& colour) {
  std::ostringstream svg;
  svg << "<svg id=\"" << id << "\" class=\"chart\" width=\"" << kWidth << "\" height=\"" << kHeight
      << "\" viewBox=\"0 0 " << kWidth << " " << kHeight << "\" role=\"img\" aria-label=\"" << escape(title) << "\">\n"
      << "<text x=\"" << kLeft << "\" y=\"20\" class=\"title\">" << escape(title) << "</text>\n";
  double top = 0;
  for (const auto& [rank, mb] : values) top = std::max(top, mb);
  if (values.empty() || top <= 0) {
    svg << "<text x=\"" << kLeft << "\" y=\"" << kHeight / 2 << "\" class=\"none\">not recorded by this run</text>\n</svg>\n";
    return svg.str();
  }
  const std::vector<double> t = ticks(0, top * 1.1, 5);
  const double y1 = std::max(top * 1.1, t.back());
  const double pw = kWidth - kLeft - kRight, ph = kHeight - kTop - kBottom;
  auto Y = [&](double value) { return kTop + (y1 - value) / y1 * ph; };
  svg << "<rect x=\"" << kLeft << "\" y=\"" << kTop << "\" width=\"" << pw << "\" height=\"" << ph
      << "\" class=\"plot\"/>\n";
  for (double v : t)
    svg << "<line x1=\"" << kLeft << "\" x2=\"" << kLeft + pw << "\" y1=\"" << fixed(Y(v)) << "\" y2=\"" << fixed(Y(v))
        << "\" class=\"grid\"/><text x=\"" << kLeft - 6 << "\" y=\"" << fixed(Y(v) + 4) << "\" class=\"ytick\">"
        << number(v) << "</text>\n";
  const double slot = pw / static_cast<double>(values.size()), width = std::min(80.0, slot * 0.6);
  std::size_t i = 0;
  for (const auto& [rank, mb] : values) {
    const double x = kLeft + slot * (static_cast<double>(i++) + 0.5);
    svg << "<rect class=\"bar\" x=\"" << fixed(x - width / 2) << "\" y=\"" << fixed(Y(mb)) << "\" width=\"" << fixed(width)
        << "\" height=\"" << fixed(kTop + ph - Y(mb)) << "\" fill=\"" << colour << "\"><title>rank " << rank << ": "
        << number(mb) << " MB</title></rect>\n<text x=\"" << fixed(x) << "\" y=\"" << kTop + ph + 18
        << "\" class=\"xtick\">" << (rank >= 0 ? "rank " + std::to_string(rank) : std::string("max over ranks"))
        << "</text><text x=\"" << fixed(x) << "\" y=\"" << fixed(Y(mb) - 5) << "\" class=\"xtick\">" << number(mb)
        << " MB</text>\n";
  }
  svg << "<text x=\"16\" y=\"" << kTop + ph / 2 << "\" class=\"ylabel\" transform=\"rotate(-90 16 " << kTop + ph / 2
      << ")\">peak RSS (MB)</text>\n</svg>\n";
  return svg.str();
}

const char* kRankColours[] = {"#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"};

std::string last_value(const Series& s) { return s.empty() ? "-" : number(s.rbegin()->second); }

}  // namespace

RunRecord read_run(const std::string& run_dir) {
  std::error_code ec;
  const fs::path dir = fs::path(run_dir).lexically_normal();
  TESSERA_CHECK(fs::is_directory(dir, ec), "report: ", run_dir, " is not a folder: give a run folder ",
                "(default_root_dir/version_N, the folder fit names in its last line)");
  TESSERA_CHECK(fs::is_regular_file(dir / "config.toml", ec) || fs::is_regular_file(dir / "metrics.csv", ec), "report: ",
                run_dir, " holds neither config.toml nor metrics.csv, so it is not a run folder: give one of its ",
                "version_N folders");
  // The chain of resumed runs, newest first, then reversed.
  std::vector<Folder> chain{read_folder(dir)};
  std::vector<std::string> seen{fs::absolute(dir).lexically_normal().string()};
  while (chain.back().fit && !chain.back().restored.empty()) {
    const std::string earlier = run_of_checkpoint(chain.back().restored, fs::path(chain.back().path));
    if (earlier.empty()) break;
    const std::string key = fs::absolute(earlier).lexically_normal().string();
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) break;
    seen.push_back(key);
    chain.push_back(read_folder(earlier));
  }
  std::reverse(chain.begin(), chain.end());

  RunRecord r;
  r.config = read_text(dir / "config.toml");
  for (std::size_t i = 0; i < chain.size(); ++i) {
    const Folder& f = chain[i];
    r.folders.push_back(f.path);
    std::int64_t first = -1;
    for (const auto& [name, series] : f.metrics)
      if (!series.empty() && (first < 0 || series.begin()->first < first)) first = series.begin()->first;
    if (i > 0 && first >= 0) r.resumed_at.push_back(first);
    for (const auto& [name, series] : f.metrics) {
      if (name == "train_loss") join(r.train_loss, series);
      else if (name == "val_loss") join(r.val_loss, series);
      else if (name.rfind("lr-", 0) == 0 && (r.lr_name.empty() || r.lr_name == name)) {
        r.lr_name = name;
        join(r.lr, series);
      } else if (name == "peak_rss_mb" && !series.empty()) {
        r.peak_rss_max_mb = std::max(r.peak_rss_max_mb, series.rbegin()->second);
      }
    }
    for (const auto& [rank, series] : f.rate) join(r.rate[rank], series);
    for (const auto& [rank, mb] : f.peak_rss_mb) r.peak_rss_mb[rank] = std::max(r.peak_rss_mb[rank], mb);
    if (!f.rate_unit.empty()) r.rate_unit = f.rate_unit;
  }
  if (r.lr_name.empty()) {  // no lr monitor: the lr of rank 0's step lines
    r.lr_name = "lr";
    for (const Folder& f : chain)
      if (f.lr.count(0)) join(r.lr, f.lr.at(0));
  }
  return r;
}

std::string render_report(const RunRecord& r) {
  const std::string name = r.folders.empty() ? "run" : r.folders.back();
  std::ostringstream html;
  html << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>tessera report: "
       << escape(name) << "</title>\n<style>\n"
       << "body{font-family:sans-serif;margin:16px;color:#222;background:#fff}\n"
       << "h1{font-size:20px;margin:0 0 8px}h2{font-size:16px;margin:18px 0 6px}\n"
       << ".chart{display:block;margin:6px 0}.plot{fill:#fff;stroke:#999}.grid{stroke:#e4e4e4}.axis{stroke:#999}\n"
       << ".title{font-size:14px;font-weight:bold;fill:#222}.legend{font-size:12px;fill:#222}\n"
       << ".xtick{font-size:11px;fill:#444;text-anchor:middle}.ytick{font-size:11px;fill:#444;text-anchor:end}\n"
       << ".xlabel,.ylabel{font-size:12px;fill:#444;text-anchor:middle}.none{font-size:13px;fill:#888}\n"
       << ".resume{stroke:#555;stroke-dasharray:5 4}\n"
       << "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}\n"
       << "pre{background:#f6f6f6;border:1px solid #ddd;padding:8px;font-size:12px;overflow:auto;max-height:480px}\n"
       << "</style>\n</head>\n<body>\n<h1>tessera report: " << escape(name) << "</h1>\n<table>\n"
       << "<tr><th>runs joined</th><td>" << r.folders.size();
  for (const std::string& f : r.folders) html << "<br>" << escape(f);
  html << "</td></tr>\n<tr><th>resumed at step</th><td>";
  for (std::size_t i = 0; i < r.resumed_at.size(); ++i) html << (i ? ", " : "") << r.resumed_at[i];
  if (r.resumed_at.empty()) html << "-";
  html << "</td></tr>\n<tr><th>last step</th><td>" << (r.train_loss.empty() ? "-" : std::to_string(r.train_loss.rbegin()->first))
       << "</td></tr>\n<tr><th>last train_loss</th><td>" << last_value(r.train_loss)
       << "</td></tr>\n<tr><th>last val_loss</th><td>" << last_value(r.val_loss) << "</td></tr>\n</table>\n";

  html << "<h2>Loss</h2>\n"
       << line_chart("loss", "train and validation loss", "loss",
                     {{"train_loss", "#1f77b4", r.train_loss}, {"val_loss", "#ff7f0e", r.val_loss}}, r.resumed_at);
  html << "<h2>Learning rate</h2>\n"
       << line_chart("lr", "learning rate (" + r.lr_name + ")", "lr", {{r.lr_name, "#2ca02c", r.lr}}, r.resumed_at);
  std::vector<Line> rates;
  for (const auto& [rank, series] : r.rate)
    rates.push_back({"rank " + std::to_string(rank), kRankColours[static_cast<std::size_t>(rank) % 6], series,
                     2.5 + 3.0 * static_cast<double>(r.rate.size() - 1 - rates.size())});
  const std::string unit = r.rate_unit.empty() ? "items" : r.rate_unit;
  html << "<h2>Throughput</h2>\n" << line_chart("rate", unit + "/s per rank", unit + "/s", rates, r.resumed_at);
  std::map<int, double> memory = r.peak_rss_mb;
  std::string memory_title = "peak RSS per rank";
  if (memory.empty() && r.peak_rss_max_mb > 0) {  // runs that logged only the maximum
    memory[-1] = r.peak_rss_max_mb;
    memory_title = "peak RSS, max over ranks (this run's logs give no rank's own)";
  }
  html << "<h2>Memory</h2>\n" << bar_chart("memory", memory_title, memory, "#d62728");
  html << "<h2>Config</h2>\n<pre>" << escape(r.config) << "</pre>\n</body>\n</html>\n";
  return html.str();
}

int report_tool(int argc, char** argv) {
  std::vector<std::string> words(argv + 1, argv + argc);
  std::string run, out;
  try {
    for (std::size_t i = 0; i < words.size(); ++i) {
      const std::string& w = words[i];
      if (w == "--help" || w == "-h") return std::cout << kUsage, 0;
      if (w == "--out" || w.rfind("--out=", 0) == 0) {
        const auto eq = w.find('=');
        TESSERA_CHECK(eq != std::string::npos || i + 1 < words.size(), "--out needs a file name");
        out = eq != std::string::npos ? w.substr(eq + 1) : words[++i];
      } else if (w.rfind("-", 0) != 0 && run.empty()) {
        run = w;
      } else {
        TESSERA_FAIL("unexpected argument '", w, "'", sdk::did_you_mean(w, {"--out", "--help"}));
      }
    }
    TESSERA_CHECK(!run.empty(), "report needs a run folder");
  } catch (const sdk::Error& e) {
    std::cerr << "tessera: " << e.what() << "\n\n" << kUsage;
    return 2;
  }
  try {
    const RunRecord record = read_run(run);
    if (out.empty()) out = (fs::path(run) / "report.html").string();
    const std::string page = render_report(record);
    std::ofstream file(out, std::ios::binary | std::ios::trunc);
    TESSERA_CHECK(file.good(), "report: cannot write ", out);
    file << page;
    file.close();
    TESSERA_CHECK(file.good(), "report: writing ", out, " failed");
    std::cout << "report of " << record.folders.size() << " run(s) (" << record.train_loss.size()
              << " train_loss points, " << record.val_loss.size() << " val_loss points, " << record.rate.size()
              << " rank(s)) written to " << out << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "tessera: error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace tessera::host
