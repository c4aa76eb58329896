#pragma once
/// A tiny span recorder for the profiler: the trainer opens spans around its hooks
/// (forward, backward, optimizer step, ...), the communicator records every collective from
/// issue to completion. Off by default: a span then costs one relaxed atomic load.
/// Thread-safe. The host turns it on for [trainer] profiler = "simple" or "trace" and
/// reads the events at the end (a per-name table, or a Chrome-trace JSON per rank).
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace tessera::core::trace {

using Clock = std::chrono::steady_clock;

struct Event {
  std::string name;
  std::string category;  ///< "hook", "collective", ...
  Clock::time_point begin;
  Clock::time_point end;
  std::uint64_t thread;  ///< a small number per thread, in order of first use
  bool overlapping;      ///< may overlap others on its thread (a collective in flight)
};

void enable(bool on);
bool enabled();
/// Records a finished interval; `overlapping` for intervals that do not nest (collectives).
void record(std::string name, const char* category, Clock::time_point begin, Clock::time_point end,
            bool overlapping = false);
/// Every event recorded so far, in order of completion.
std::vector<Event> events();
/// Forgets every event (tests).
void clear();

/// Records [construction, destruction) as one event when tracing is on.
class Span {
 public:
  Span(const char* category, std::string name);
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  const char* category_;
  std::string name_;
  Clock::time_point begin_;
  bool on_;
};

}  // namespace tessera::core::trace
