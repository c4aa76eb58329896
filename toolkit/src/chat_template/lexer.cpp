#include "chat_template/lexer.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>

#include "chat_template/errors.hpp"
#include "chat_template/text.hpp"
#include "utf8.hpp"

namespace tessera::toolkit::jinja {
namespace {

bool starts(std::string_view s, std::size_t pos, std::string_view what) { return s.substr(pos, what.size()) == what; }

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || is_digit(c); }

// Python's \s at s[pos]: the byte length of a whitespace code point there, or 0.
std::size_t space_at(std::string_view s, std::size_t pos) {
  if (pos >= s.size()) return 0;
  const auto b = static_cast<unsigned char>(s[pos]);
  if (b < 0x80) return text::is_space(b) ? 1 : 0;
  std::size_t n = b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : 2;
  const auto cps = text::decode(s.substr(pos, n));
  return !cps.empty() && text::is_space(cps[0]) ? n : 0;
}

std::size_t skip_spaces(std::string_view s, std::size_t pos) {
  while (std::size_t n = space_at(s, pos)) pos += n;
  return pos;
}

class Lexer {
 public:
  Lexer(std::string source, const std::string& origin) : src_(std::move(source)), origin_(origin) {}

  std::vector<Token> run() {
    std::size_t pos = 0;
    bool line_starting = true;
    while (pos < src_.size()) {
      const std::size_t open = find_tag(pos);
      if (open == std::string::npos) {
        push_data(pos, src_.substr(pos));
        break;
      }
      const char kind = src_[open + 1];  // '{', '%' or '#'
      const char sign = open + 2 < src_.size() && (src_[open + 2] == '-' || src_[open + 2] == '+') ? src_[open + 2] : 0;
      std::string data = src_.substr(pos, open - pos);
      if (sign == '-') {
        data = text::strip(data, std::nullopt, false, true);
      } else if (sign != '+' && kind != '{') {
        // lstrip_blocks: only whitespace between the line's start and the tag.
        const std::size_t line_pos = data.rfind('\n') == std::string::npos ? 0 : data.rfind('\n') + 1;
        if ((line_pos > 0 || line_starting) && line_pos < data.size() &&
            skip_spaces(data, line_pos) == data.size())
          data.resize(line_pos);
      }
      push_data(pos, data);
      const std::size_t inner = open + 2 + (sign ? 1 : 0);
      if (kind == '#') {
        pos = comment(open, inner, line_starting);
      } else if (kind == '%' && is_raw(inner)) {
        pos = raw(open, line_starting);
      } else {
        pos = tag(open, inner, kind == '%', line_starting);
      }
    }
    Token eof{Token::Type::eof, {}, 0, 0, 0, 0};
    locate(eof, src_.size());
    tokens_.push_back(eof);
    return std::move(tokens_);
  }

 private:
  [[noreturn]] void error(std::size_t pos, const std::string& message) {
    Token t{};
    locate(t, pos);
    throw TemplateError(TemplateError::Kind::syntax, origin_, t.line, t.column, message);
  }

  [[noreturn]] void unsupported_at(std::size_t pos, const std::string& what) {
    Token t{};
    locate(t, pos);
    throw TemplateError(TemplateError::Kind::unsupported, origin_, t.line, t.column,
                        what + " is not supported by Tessera's chat template interpreter");
  }

  // Line and column (in code points) of a byte offset.
  void locate(Token& t, std::size_t pos) {
    if (pos < line_scan_) line_scan_ = line_start_ = 0, line_ = 1;
    while (line_scan_ < pos) {
      if (src_[line_scan_] == '\n') {
        ++line_;
        line_start_ = line_scan_ + 1;
      }
      ++line_scan_;
    }
    t.line = line_;
    t.column = static_cast<int>(text::length(std::string_view(src_).substr(line_start_, pos - line_start_))) + 1;
  }

  void push(Token::Type type, std::size_t pos, std::string text = {}) {
    Token t{type, std::move(text), 0, 0, 0, 0};
    locate(t, pos);
    tokens_.push_back(std::move(t));
  }

  void push_data(std::size_t pos, std::string data) {
    if (!data.empty()) push(Token::Type::data, pos, std::move(data));
  }

  std::size_t find_tag(std::size_t pos) const {
    for (std::size_t at = src_.find('{', pos); at != std::string::npos; at = src_.find('{', at + 1))
      if (at + 1 < src_.size() && (src_[at + 1] == '{' || src_[at + 1] == '%' || src_[at + 1] == '#')) return at;
    return std::string::npos;
  }

  bool is_raw(std::size_t inner) const {
    const std::size_t word = skip_spaces(src_, inner);
    if (!starts(src_, word, "raw")) return false;
    const std::size_t after = skip_spaces(src_, word + 3);
    return starts(src_, after, "%}") || starts(src_, after, "-%}");
  }

  // The end of a block or comment tag at `at` ("+X}", "-X}" and trailing whitespace, or "X}"
  // and one newline under trim_blocks); sets line_starting as jinja2 does (the match ends in "\n").
  std::size_t tag_end(std::size_t at, char closer, bool& line_starting) {
    std::size_t end;
    if (src_[at] == '+') {
      end = at + 3;
    } else if (src_[at] == '-') {
      end = skip_spaces(src_, at + 3);
    } else {
      end = at + 2;
      if (closer != '}' && end < src_.size() && src_[end] == '\n') ++end;  // trim_blocks
    }
    line_starting = src_[end - 1] == '\n';
    return end;
  }

  std::size_t comment(std::size_t open, std::size_t inner, bool& line_starting) {
    for (std::size_t at = inner; at < src_.size(); ++at) {
      if ((src_[at] == '+' || src_[at] == '-') && starts(src_, at + 1, "#}")) return tag_end(at, '#', line_starting);
      if (starts(src_, at, "#}")) return tag_end(at, '#', line_starting);
    }
    error(open, "Missing end of comment tag");
  }

  std::size_t raw(std::size_t open, bool& line_starting) {
    std::size_t body = src_.find("%}", open) + 2;
    if (src_[body - 3] == '-') body = skip_spaces(src_, body);
    for (std::size_t at = src_.find("{%", body); at != std::string::npos; at = src_.find("{%", at + 1)) {
      const char sign = at + 2 < src_.size() && (src_[at + 2] == '-' || src_[at + 2] == '+') ? src_[at + 2] : 0;
      const std::size_t word = skip_spaces(src_, at + 2 + (sign ? 1 : 0));
      if (!starts(src_, word, "endraw")) continue;
      const std::size_t close = skip_spaces(src_, word + 6);
      if (!starts(src_, close, "%}") && !starts(src_, close, "-%}") && !starts(src_, close, "+%}")) continue;
      std::string data = src_.substr(body, at - body);
      if (sign == '-') {
        data = text::strip(data, std::nullopt, false, true);
      } else if (sign != '+') {
        const std::size_t line_pos = data.rfind('\n') == std::string::npos ? 0 : data.rfind('\n') + 1;
        if (line_pos > 0 && line_pos < data.size() && skip_spaces(data, line_pos) == data.size()) data.resize(line_pos);
      }
      push_data(body, data);
      return tag_end(close, '%', line_starting);
    }
    error(open, "Missing end of raw directive");
  }

  std::size_t tag(std::size_t open, std::size_t pos, bool block, bool& line_starting) {
    push(block ? Token::Type::block_begin : Token::Type::variable_begin, open);
    std::vector<char> balance;
    while (true) {
      pos = skip_spaces(src_, pos);
      if (pos >= src_.size()) error(open, block ? "unexpected end of template, expected '%}'" : "unexpected end of template, expected '}}'");
      if (balance.empty()) {
        if (block && (starts(src_, pos, "%}") || starts(src_, pos, "-%}") || starts(src_, pos, "+%}"))) {
          push(Token::Type::block_end, pos);
          return tag_end(pos, '%', line_starting);
        }
        if (!block && (starts(src_, pos, "}}") || starts(src_, pos, "-}}"))) {
          push(Token::Type::variable_end, pos);
          const std::size_t end = src_[pos] == '-' ? skip_spaces(src_, pos + 3) : pos + 2;
          line_starting = src_[end - 1] == '\n';
          return end;
        }
      }
      const char c = src_[pos];
      if (is_digit(c)) {
        pos = number(pos);
      } else if (is_name_start(c)) {
        std::size_t end = pos;
        while (end < src_.size() && is_name_char(src_[end])) ++end;
        if (end < src_.size() && static_cast<unsigned char>(src_[end]) >= 0x80 && !space_at(src_, end))
          unsupported_at(pos, "a name with non-ASCII letters");
        push(Token::Type::name, pos, src_.substr(pos, end - pos));
        pos = end;
      } else if (c == '\'' || c == '"') {
        pos = string(pos);
      } else {
        pos = op(pos, balance);
      }
    }
  }

  std::size_t number(std::size_t pos) {
    // jinja2 tries a float first ("1.5", "1e3", "1_000.5"), then an integer (0b, 0o, 0x, decimal).
    const auto digits = [&](std::size_t p) {
      if (p >= src_.size() || !is_digit(src_[p])) return std::string::npos;
      while (p < src_.size() && (is_digit(src_[p]) || (src_[p] == '_' && p + 1 < src_.size() && is_digit(src_[p + 1])))) ++p;
      return p;
    };
    const bool after_dot = pos > 0 && src_[pos - 1] == '.';
    std::size_t end = digits(pos);
    std::size_t float_end = std::string::npos;
    if (!after_dot) {
      std::size_t p = end;
      if (p < src_.size() && src_[p] == '.' && digits(p + 1) != std::string::npos) {
        p = digits(p + 1);
        float_end = p;
      }
      if (p < src_.size() && (src_[p] == 'e' || src_[p] == 'E')) {
        std::size_t q = p + 1;
        if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
        if (digits(q) != std::string::npos) float_end = digits(q);
      }
    }
    if (float_end != std::string::npos) {
      std::string s = src_.substr(pos, float_end - pos);
      s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
      Token t{Token::Type::floating, s, 0, std::strtod(s.c_str(), nullptr), 0, 0};
      locate(t, pos);
      tokens_.push_back(t);
      return float_end;
    }
    int base = 10;
    std::size_t start = pos;
    if (src_[pos] == '0' && pos + 1 < src_.size()) {
      const char x = static_cast<char>(src_[pos + 1] | 0x20);
      base = x == 'b' ? 2 : x == 'o' ? 8 : x == 'x' ? 16 : 10;
    }
    std::string s;
    if (base != 10) {
      end = pos + 2;
      const auto valid = [&](char ch) {
        const char l = static_cast<char>(ch | 0x20);
        return base == 2 ? (ch == '0' || ch == '1') : base == 8 ? (ch >= '0' && ch <= '7') : (is_digit(ch) || (l >= 'a' && l <= 'f'));
      };
      while (end < src_.size() && (valid(src_[end]) || (src_[end] == '_' && end + 1 < src_.size() && valid(src_[end + 1])))) ++end;
      if (end == pos + 2) {
        base = 10;
        end = pos + 1;  // a lone "0"
      } else {
        start = pos + 2;
      }
    } else if (src_[pos] == '0') {
      end = pos + 1;
      while (end < src_.size() && (src_[end] == '0' || (src_[end] == '_' && end + 1 < src_.size() && src_[end + 1] == '0'))) ++end;
    }
    s = src_.substr(start, end - start);
    s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
    errno = 0;
    const long long value = std::strtoll(s.c_str(), nullptr, base);
    if (errno == ERANGE) unsupported_at(pos, "the integer " + src_.substr(pos, end - pos) + " (beyond 64 bits)");
    Token t{Token::Type::integer, src_.substr(pos, end - pos), value, 0, 0, 0};
    locate(t, pos);
    tokens_.push_back(t);
    return end;
  }

  std::size_t string(std::size_t pos) {
    const char quote = src_[pos];
    std::size_t end = pos + 1;
    while (end < src_.size() && src_[end] != quote) end += src_[end] == '\\' ? 2 : 1;
    if (end >= src_.size()) error(pos, "unexpected char " + std::string(1, quote) + " (an unterminated string)");
    push(Token::Type::string, pos, unescape(src_.substr(pos + 1, end - pos - 1), pos));
    return end + 1;
  }

  // Python's unicode-escape decoding of the literal (jinja2 applies it to every string).
  std::string unescape(const std::string& raw, std::size_t pos) {
    std::string out;
    const auto cps = text::decode(raw);
    const auto hex = [&](std::size_t& i, int n) -> char32_t {
      char32_t v = 0;
      for (int k = 0; k < n; ++k, ++i) {
        if (i >= cps.size() || !std::isxdigit(static_cast<int>(cps[i] < 0x80 ? cps[i] : 'g')))
          error(pos, "truncated escape in a string literal");
        const char32_t d = cps[i];
        v = v * 16 + (d <= '9' ? d - '0' : (d | 0x20) - 'a' + 10);
      }
      return v;
    };
    for (std::size_t i = 0; i < cps.size();) {
      const char32_t c = cps[i++];
      if (c != '\\' || i >= cps.size()) {
        text::append_utf8(out, c);
        continue;
      }
      const char32_t e = cps[i++];
      char32_t v = 0;
      switch (e) {
        case '\n': continue;
        case '\\': case '\'': case '"': v = e; break;
        case 'a': v = 7; break;
        case 'b': v = 8; break;
        case 'f': v = 12; break;
        case 'n': v = 10; break;
        case 'r': v = 13; break;
        case 't': v = 9; break;
        case 'v': v = 11; break;
        case 'x': v = hex(i, 2); break;
        case 'u': v = hex(i, 4); break;
        case 'U': v = hex(i, 8); break;
        case 'N': unsupported_at(pos, "a \\N{...} escape");
        default:
          if (e >= '0' && e <= '7') {
            v = e - '0';
            for (int k = 0; k < 2 && i < cps.size() && cps[i] >= '0' && cps[i] <= '7'; ++k) v = v * 8 + (cps[i++] - '0');
          } else if (e >= 0x80) {
            // backslashreplace turned the character into its escape text before decoding.
            char buf[16];
            std::snprintf(buf, sizeof buf, e <= 0xFF ? "\\x%02x" : e <= 0xFFFF ? "\\u%04x" : "\\U%08x", static_cast<unsigned>(e));
            out += buf;
            continue;
          } else {
            out.push_back('\\');
            text::append_utf8(out, e);
            continue;
          }
      }
      if (v > 0x10FFFF) error(pos, "illegal Unicode character in a string literal");
      if (v >= 0xD800 && v < 0xE000) unsupported_at(pos, "a surrogate escape in a string");
      text::append_utf8(out, v);
    }
    return out;
  }

  std::size_t op(std::size_t pos, std::vector<char>& balance) {
    static const char* const two[] = {"//", "**", "==", "!=", ">=", "<="};
    for (const char* o : two)
      if (starts(src_, pos, o)) {
        push(Token::Type::op, pos, o);
        return pos + 2;
      }
    const char c = src_[pos];
    if (std::string_view("+-/*%~[](){}><=.:|,;").find(c) == std::string_view::npos) {
      std::size_t n = 1;
      const auto b = static_cast<unsigned char>(c);
      if (b >= 0x80) n = b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : 2;
      error(pos, "unexpected char '" + src_.substr(pos, n) + "'");
    }
    if (c == '(' || c == '[' || c == '{') balance.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
    if (c == ')' || c == ']' || c == '}') {
      if (balance.empty()) error(pos, std::string("unexpected '") + c + "'");
      if (balance.back() != c) error(pos, std::string("unexpected '") + c + "', expected '" + balance.back() + "'");
      balance.pop_back();
    }
    push(Token::Type::op, pos, std::string(1, c));
    return pos + 1;
  }

  std::string src_;
  const std::string& origin_;
  std::vector<Token> tokens_;
  std::size_t line_scan_ = 0, line_start_ = 0;
  int line_ = 1;
};

// "\r\n" and "\r" become "\n", and one trailing newline goes.
std::string normalize(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (std::size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out.push_back('\n');
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out.push_back(source[i]);
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

}  // namespace

std::vector<Token> tokenize(std::string_view source, const std::string& origin) {
  if (const auto bad = invalid_utf8_offset(source)) {
    const auto before = source.substr(0, *bad);
    const int line = 1 + static_cast<int>(std::count(before.begin(), before.end(), '\n'));
    throw TemplateError(TemplateError::Kind::syntax, origin, line, 1,
                        "the template is not valid UTF-8 (byte " + std::to_string(*bad) + ")");
  }
  return Lexer(normalize(source), origin).run();
}

}  // namespace tessera::toolkit::jinja
