#pragma once
/// The one error type that crosses the plugin boundary, and TESSERA_CHECK to raise it.
/// It lives in the SDK library (not inline), so its type info outlives every plugin.
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "tessera/sdk/export.hpp"

namespace tessera::sdk {

/// Every error raised by the host, the core or a plugin. `what()` is the full,
/// user-facing paragraph; `where()` is the source location that raised it.
class TESSERA_SDK_API Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message, std::string where = {});
  ~Error() override;
  const std::string& where() const noexcept { return where_; }

 private:
  std::string where_;
};

/// The candidate closest to `word` by edit distance, or "" if none is plausibly a typo.
TESSERA_SDK_API std::string closest_match(const std::string& word, const std::vector<std::string>& candidates);

/// `" (did you mean 'x'?)"` for a typo of one of `candidates`, or "".
TESSERA_SDK_API std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates);

/// "a, b, c" for error messages.
TESSERA_SDK_API std::string join(const std::vector<std::string>& items, const std::string& separator = ", ");

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
[[noreturn]] TESSERA_SDK_API void raise(const char* file, int line, const std::string& message);
}  // namespace detail
}  // namespace tessera::sdk

/// Throws tessera::sdk::Error with the streamed message when `cond` is false.
#define TESSERA_CHECK(cond, ...)                                                                  \
  do {                                                                                            \
    if (!(cond)) ::tessera::sdk::detail::raise(__FILE__, __LINE__, ::tessera::sdk::detail::concat(__VA_ARGS__)); \
  } while (false)

/// Throws tessera::sdk::Error unconditionally.
#define TESSERA_FAIL(...) ::tessera::sdk::detail::raise(__FILE__, __LINE__, ::tessera::sdk::detail::concat(__VA_ARGS__))
