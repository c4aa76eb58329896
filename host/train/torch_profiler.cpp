#include "train/torch_profiler.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>

#include "loggers/record_file.hpp"

namespace tessera::host {

namespace profiler = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerState;

namespace {

// LibTorch 1.13's events count microseconds, 2.x's nanoseconds: whichever the event has.
template <class E>
auto start_us(const E& e, int) -> decltype(e.startNs(), double()) { return static_cast<double>(e.startNs()) / 1e3; }
template <class E>
double start_us(const E& e, long) { return static_cast<double>(e.startUs()); }
template <class E>
auto duration_us(const E& e, int) -> decltype(e.durationNs(), double()) { return static_cast<double>(e.durationNs()) / 1e3; }
template <class E>
double duration_us(const E& e, long) { return static_cast<double>(e.durationUs()); }

struct Event {
  std::string name;
  bool device;
  double start_us, duration_us;
  std::int64_t lane;  ///< host thread, or device stream
};

/// What a kernel does, from its name (cuBLAS/CUTLASS GEMMs, flash attention, NCCL, the fused
/// optimizer, copies), for the summary lines above the per-kernel table.
std::string kernel_kind(const std::string& name) {
  std::string n = name;
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  auto has = [&](std::initializer_list<const char*> parts) {
    return std::any_of(parts.begin(), parts.end(), [&](const char* p) { return n.find(p) != std::string::npos; });
  };
  if (has({"nccl"})) return "communication (NCCL)";
  if (has({"flash", "fmha", "attention", "sdpa"})) return "attention";
  if (has({"gemm", "cutlass", "xmma", "nvjet", "matmul", "cublas"})) return "matrix products";
  if (has({"adam", "multi_tensor"})) return "optimizer";
  if (has({"memcpy", "memset"})) return "copies and fills";
  return "element-wise, reductions, other";
}

std::string ms(double us) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.3f", us / 1e3);
  return buffer;
}

/// Rows of name | calls | total per step | share, largest first, at most `limit`.
std::string table(const std::map<std::string, std::pair<std::int64_t, double>>& rows, double whole_us, double steps,
                  std::size_t limit, const std::string& title) {
  std::vector<std::pair<std::string, std::pair<std::int64_t, double>>> sorted(rows.begin(), rows.end());
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.second.second > b.second.second; });
  std::string out = "  " + title + "\n";
  char line[512];
  for (std::size_t i = 0; i < sorted.size() && i < limit; ++i) {
    const auto& [name, row] = sorted[i];
    std::snprintf(line, sizeof(line), "    %6.1f%%  %10s ms/step  %7.0f calls/step  %s\n",
                  whole_us > 0 ? 100.0 * row.second / whole_us : 0.0, ms(row.second / steps).c_str(),
                  static_cast<double>(row.first) / steps, name.substr(0, 110).c_str());
    out += line;
  }
  if (sorted.size() > limit) out += "    (" + std::to_string(sorted.size() - limit) + " more)\n";
  return out;
}

}  // namespace

struct TorchProfiler::Recording {
  std::chrono::steady_clock::time_point started;
  std::unique_ptr<profiler::ProfilerResult> result;
};

TorchProfiler::TorchProfiler(bool cuda) : cuda_(cuda) {}
TorchProfiler::~TorchProfiler() {
  if (recording_ && !recording_->result) (void)profiler::disableProfiler();
}

void TorchProfiler::before_step(std::int64_t step) {
  if (step != kFirstStep || recording_) return;
  std::set<ActivityType> activities{ActivityType::CPU};
  if (cuda_) {
    activities.insert(ActivityType::CUDA);
    torch::cuda::synchronize();  // the window starts with an idle device
  }
  const torch::profiler::impl::ProfilerConfig config(ProfilerState::KINETO);
  profiler::prepareProfiler(config, activities);
  recording_ = std::make_unique<Recording>();
  profiler::enableProfiler(config, activities);
  recording_->started = std::chrono::steady_clock::now();
  first_ = step;
}

void TorchProfiler::after_step(std::int64_t step, bool last) {
  if (!recording_ || recording_->result) return;
  last_ = step;
  if (step >= first_ + kSteps - 1 || last) stop();
}

void TorchProfiler::stop() {
  if (cuda_) torch::cuda::synchronize();
  wall_us_ = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - recording_->started).count();
  recording_->result = profiler::disableProfiler();
}

std::string TorchProfiler::report(const std::string& trace_path, std::int64_t rank) {
  if (recording_ && !recording_->result && last_ >= first_) stop();  // the run ended inside the window
  if (!recording_ || !recording_->result) return "";
  std::vector<Event> events;
  double origin = -1;
  for (const auto& e : recording_->result->events()) {
    Event event{e.name(), e.deviceType() != c10::DeviceType::CPU, start_us(e, 0), duration_us(e, 0),
                e.deviceType() != c10::DeviceType::CPU ? e.deviceResourceId() : static_cast<std::int64_t>(e.startThreadId())};
    origin = origin < 0 ? event.start_us : std::min(origin, event.start_us);
    events.push_back(std::move(event));
  }
  nlohmann::json trace = nlohmann::json::array();
  // The host's threads under pid = rank (as profiler = "trace"), the device's streams under 1000 + rank.
  auto pid = [rank](bool device) { return device ? 1000 + rank : rank; };
  for (bool device : {false, true})
    trace.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid(device)},
                     {"args", {{"name", (device ? "device, rank " : "host, rank ") + std::to_string(rank)}}}});
  for (const Event& e : events)
    trace.push_back({{"name", e.name}, {"ph", "X"}, {"cat", e.device ? "kernel" : "cpu_op"}, {"pid", pid(e.device)},
                     {"tid", e.lane}, {"ts", e.start_us - origin}, {"dur", e.duration_us}});
  write_record(trace_path, nlohmann::json{{"traceEvents", trace}, {"displayTimeUnit", "ms"}}.dump() + "\n");

  const double steps = static_cast<double>(last_ - first_ + 1);
  std::map<std::string, std::pair<std::int64_t, double>> kernels, kinds, ops;
  std::vector<std::pair<double, double>> busy;  // device intervals, for the time the device worked
  for (const Event& e : events) {
    auto& rows = e.device ? kernels : ops;
    ++rows[e.name].first;
    rows[e.name].second += e.duration_us;
    if (!e.device) continue;
    auto& kind = kinds[kernel_kind(e.name)];
    ++kind.first;
    kind.second += e.duration_us;
    busy.emplace_back(e.start_us, e.start_us + e.duration_us);
  }
  std::sort(busy.begin(), busy.end());
  double busy_us = 0, until = -1;
  for (const auto& [begin, end] : busy) {
    if (end <= until) continue;
    busy_us += end - std::max(begin, until);
    until = end;
  }
  std::string out = "Profiler report (pytorch): training steps " + std::to_string(first_) + "-" + std::to_string(last_) +
                    " of rank " + std::to_string(rank) + ", " + ms(wall_us_ / steps) + " ms per step\n";
  if (!kernels.empty()) {
    double kernel_us = 0;
    for (const auto& [name, row] : kernels) kernel_us += row.second;
    out += "  device busy " + ms(busy_us / steps) + " ms per step (" +
           std::to_string(static_cast<int>(100.0 * busy_us / std::max(1.0, wall_us_) + 0.5)) +
           "% of the step; the rest the device waited for the host)\n";
    out += table(kinds, kernel_us, steps, kinds.size(), "device time by kind of kernel:");
    out += table(kernels, kernel_us, steps, 15, "kernels by device time:");
  } else if (cuda_) {
    out += "  no device kernels recorded: this LibTorch has no Kineto (CUPTI); the host's operators only\n";
  }
  out += table(ops, wall_us_, steps, 15, "host operators by time (inclusive: an operator's time holds its callees'):");
  return out;
}

}  // namespace tessera::host
