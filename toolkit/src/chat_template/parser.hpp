#pragma once
// Tokens to the AST, as jinja2/parser.py parses them (the same precedence, the same
// statements, the same odd corners such as filters binding tighter than unary minus).
// Statements, filters and tests outside the subset are refused here, by line and column.
#include <string>
#include <vector>

#include "chat_template/ast.hpp"
#include "chat_template/lexer.hpp"

namespace tessera::toolkit::jinja {

/// Raises TemplateError (syntax or unsupported) naming `origin`.
Body parse(const std::vector<Token>& tokens, const std::string& origin);

}  // namespace tessera::toolkit::jinja
