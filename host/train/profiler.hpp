#pragma once
// [trainer] profiler: "simple" prints a per-hook time table at the end of the run (Lightning's
// SimpleProfiler); "trace" writes a Chrome-trace JSON per rank (hooks as spans, collectives
// as async spans from issue to completion) that Perfetto and chrome://tracing load.
#include <string>
#include <vector>

#include "trace/trace.hpp"

namespace tessera::host {

/// Action | mean | calls | total | % of the run, slowest first (this rank's hooks).
std::string simple_profile(const std::vector<core::trace::Event>& events);

void write_chrome_trace(const std::string& path, std::int64_t rank, const std::vector<core::trace::Event>& events);

}  // namespace tessera::host
