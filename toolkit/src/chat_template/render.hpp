#pragma once
// Evaluates a parsed template: statements, expressions and jinja2's scoping (a for loop's
// body is a fresh scope on every iteration, so `set` inside it never leaks out; a macro sees
// the scope it was defined in, not its caller's; namespace() objects are shared), under the
// render budget.
#include <string>
#include <utility>
#include <vector>

#include "chat_template/ast.hpp"
#include "tessera/toolkit/chat_template.hpp"

namespace tessera::toolkit::jinja {

struct Program {
  Body body;
  std::string origin;
};

/// Renders `program` with `variables` as its top-level names. Raises TemplateError.
std::string render(const Program& program, const std::vector<std::pair<std::string, Value>>& variables,
                   const RenderOptions& options);

}  // namespace tessera::toolkit::jinja
