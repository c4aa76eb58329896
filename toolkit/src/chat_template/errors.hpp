#pragma once
// How the interpreter's pieces fail: a Failure carries what went wrong without a place; the
// renderer and the parser add the template's line and column (the innermost node wins).
#include <string>

#include "tessera/sdk/error.hpp"
#include "tessera/toolkit/chat_template.hpp"

namespace tessera::toolkit::jinja {

struct Failure {
  TemplateError::Kind kind;
  std::string message;
};

/// A type error, a bad argument, an undefined value used: what jinja2 raises while rendering.
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  throw Failure{TemplateError::Kind::runtime, sdk::detail::concat(args...)};
}

/// A construct jinja2 has that this interpreter does not implement.
template <typename... Args>
[[noreturn]] void unsupported(const Args&... args) {
  throw Failure{TemplateError::Kind::unsupported, sdk::detail::concat(args..., " is not supported by Tessera's chat template interpreter")};
}

}  // namespace tessera::toolkit::jinja
