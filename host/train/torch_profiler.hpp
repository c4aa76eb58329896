#pragma once
// [trainer] profiler = "pytorch" (Lightning's PyTorchProfiler): LibTorch's own profiler over
// training steps 3 to 5 (Lightning's default schedule: wait 1, warm up 1, record 3), every
// operator on the host and, on CUDA where the LibTorch has Kineto (a pip wheel's), every kernel
// on the device. The answer to "where does a step go on the GPU" that host spans cannot give.
#include <cstdint>
#include <memory>
#include <string>

namespace tessera::host {

class TorchProfiler {
 public:
  static constexpr std::int64_t kFirstStep = 3, kSteps = 3;

  /// `cuda`: record the device's kernels too.
  explicit TorchProfiler(bool cuda);
  ~TorchProfiler();

  /// Before training step `step` (1-based) runs: starts recording at kFirstStep.
  void before_step(std::int64_t step);
  /// After step `step`: stops after the recorded window, or at `last` (a shorter run). Waits for
  /// the device first, so that the window's kernels are in.
  void after_step(std::int64_t step, bool last);

  /// Writes the recorded events to `trace_path` (Chrome's trace format, for Perfetto) and returns
  /// the table of where the recorded steps' time went; empty when nothing was recorded.
  std::string report(const std::string& trace_path, std::int64_t rank);

 private:
  struct Recording;
  void stop();

  bool cuda_;
  std::int64_t first_ = 0, last_ = 0;  ///< the steps recorded
  double wall_us_ = 0;                 ///< from the first step's start to the last one's end on the device
  std::unique_ptr<Recording> recording_;
};

}  // namespace tessera::host
