#pragma once
// Template source to tokens, as jinja2's lexer does it under transformers' settings:
// trim_blocks (the newline after a block or comment tag is dropped), lstrip_blocks (spaces
// and tabs before a block or comment tag on its own line are dropped), the "-" and "+"
// whitespace controls, raw blocks, newlines normalised to "\n" and one trailing newline of
// the source dropped (keep_trailing_newline=False).
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tessera::toolkit::jinja {

struct Token {
  enum class Type { data, variable_begin, variable_end, block_begin, block_end, name, string, integer, floating, op, eof };
  Type type;
  std::string text;  // data, a name, a string's value, an operator
  std::int64_t integer = 0;
  double floating = 0;
  int line = 1, column = 1;
};

/// Raises Failure-located TemplateError (syntax) naming `origin`.
std::vector<Token> tokenize(std::string_view source, const std::string& origin);

}  // namespace tessera::toolkit::jinja
