#include "trace/trace.hpp"

#include <atomic>
#include <mutex>
#include <utility>

namespace tessera::core::trace {

namespace {

std::atomic<bool> g_enabled{false};
std::mutex g_mutex;
std::vector<Event> g_events;
std::atomic<std::uint64_t> g_next_thread{0};

std::uint64_t this_thread() {
  thread_local const std::uint64_t id = g_next_thread++;
  return id;
}

}  // namespace

void enable(bool on) { g_enabled.store(on, std::memory_order_relaxed); }
bool enabled() { return g_enabled.load(std::memory_order_relaxed); }

void record(std::string name, const char* category, Clock::time_point begin, Clock::time_point end, bool overlapping) {
  if (!enabled()) return;
  Event event{std::move(name), category, begin, end, this_thread(), overlapping};
  std::lock_guard<std::mutex> lock(g_mutex);
  g_events.push_back(std::move(event));
}

std::vector<Event> events() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_events;
}

void clear() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_events.clear();
}

Span::Span(const char* category, std::string name) : category_(category), on_(enabled()) {
  if (!on_) return;
  name_ = std::move(name);
  begin_ = Clock::now();
}

Span::~Span() {
  if (on_) record(std::move(name_), category_, begin_, Clock::now());
}

}  // namespace tessera::core::trace
