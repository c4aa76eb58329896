#include "train/profiler.hpp"

#include <algorithm>
#include <cstdio>
#include <map>

#include <nlohmann/json.hpp>

#include "loggers/record_file.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::host {

namespace {

double micros(core::trace::Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

}  // namespace

std::string simple_profile(const std::vector<core::trace::Event>& events) {
  if (events.empty()) return "profiler: nothing recorded";
  struct Row {
    double total_us = 0;
    std::int64_t calls = 0;
  };
  std::map<std::string, Row> rows;
  auto first = events.front().begin, last = events.front().end;
  for (const auto& e : events) {
    first = std::min(first, e.begin);
    last = std::max(last, e.end);
    Row& row = rows[e.category == "collective"         ? "[Collectives] in flight (all)"
                    : e.category == "collective-wait"  ? "[Collectives] waited on (all)"
                    : e.category == "collective-local" ? "[Collectives] local sum/copy (all)"
                                                       : e.name];
    row.total_us += micros(e.end - e.begin);
    ++row.calls;
  }
  const double run_us = std::max(1.0, micros(last - first));
  std::vector<std::pair<std::string, Row>> sorted(rows.begin(), rows.end());
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.second.total_us > b.second.total_us; });
  std::size_t name_width = 6;
  for (const auto& [name, row] : sorted) name_width = std::max(name_width, name.size());
  std::string out = "Profiler report (simple): " + std::to_string(static_cast<double>(run_us) / 1e6).substr(0, 6) +
                    " s recorded\n";
  char line[512];
  std::snprintf(line, sizeof(line), "  %-*s | %12s | %8s | %11s | %8s\n", static_cast<int>(name_width), "Action",
                "Mean (ms)", "Calls", "Total (s)", "Percent");
  out += line + std::string("  ") + std::string(name_width + 53, '-') + "\n";
  for (const auto& [name, row] : sorted) {
    std::snprintf(line, sizeof(line), "  %-*s | %12.3f | %8lld | %11.4f | %7.1f%%\n", static_cast<int>(name_width),
                  name.c_str(), row.total_us / 1e3 / static_cast<double>(row.calls),
                  static_cast<long long>(row.calls), row.total_us / 1e6, 100.0 * row.total_us / run_us);
    out += line;
  }
  return out;
}

void write_chrome_trace(const std::string& path, std::int64_t rank, const std::vector<core::trace::Event>& events) {
  using nlohmann::json;
  json trace_events = json::array();
  trace_events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"args", {{"name", "rank " + std::to_string(rank)}}}});
  if (!events.empty()) {
    auto origin = events.front().begin;
    for (const auto& e : events) origin = std::min(origin, e.begin);
    std::int64_t id = 0;
    for (const auto& e : events) {
      double ts = micros(e.begin - origin), dur = micros(e.end - e.begin);
      if (e.overlapping) {  // async begin/end pair: collectives overlap each other and compute
        json common = {{"name", e.name}, {"cat", e.category}, {"pid", rank}, {"tid", e.thread}, {"id", ++id}};
        json begin = common, end = common;
        begin["ph"] = "b", begin["ts"] = ts;
        end["ph"] = "e", end["ts"] = ts + dur;
        trace_events.push_back(begin);
        trace_events.push_back(end);
      } else {
        trace_events.push_back({{"name", e.name}, {"cat", e.category}, {"ph", "X"}, {"pid", rank}, {"tid", e.thread},
                                {"ts", ts}, {"dur", dur}});
      }
    }
  }
  write_record(path, json{{"traceEvents", trace_events}, {"displayTimeUnit", "ms"}}.dump() + "\n");
}

}  // namespace tessera::host
