#pragma once
// What test code throws, as text.
#include <string>
#include <utility>

#include "tessera/sdk/error.hpp"

namespace tessera::testing {

/// The message of the sdk::Error `body` throws, or "<no sdk::Error thrown>".
template <typename F>
std::string error_of(F&& body) {
  try {
    std::forward<F>(body)();
  } catch (const sdk::Error& e) {
    return e.what();
  }
  return "<no sdk::Error thrown>";
}

}  // namespace tessera::testing
