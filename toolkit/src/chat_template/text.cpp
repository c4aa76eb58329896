#include "chat_template/text.hpp"

#include <unicode/uchar.h>
#include <unicode/ustring.h>

#include <algorithm>

#include "chat_template/errors.hpp"

namespace tessera::toolkit::jinja::text {
namespace {

// Decodes one code point of valid UTF-8 at s[i], advancing i.
char32_t next(std::string_view s, std::size_t& i) {
  const auto b = static_cast<unsigned char>(s[i]);
  if (b < 0x80) {
    ++i;
    return b;
  }
  const int n = b >= 0xF0 ? 3 : b >= 0xE0 ? 2 : 1;
  char32_t c = b & (0x3F >> n);
  for (int k = 1; k <= n && i + k < s.size(); ++k) c = (c << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += n + 1;
  return c;
}

std::u16string to_utf16(std::string_view s) {
  std::u16string out;
  for (char32_t c : decode(s)) {
    if (c >= 0x10000) {
      out.push_back(static_cast<char16_t>(0xD800 + ((c - 0x10000) >> 10)));
      out.push_back(static_cast<char16_t>(0xDC00 + ((c - 0x10000) & 0x3FF)));
    } else {
      out.push_back(static_cast<char16_t>(c));
    }
  }
  return out;
}

std::string from_utf16(const std::u16string& s) {
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    char32_t c = s[i];
    if (c >= 0xD800 && c < 0xDC00 && i + 1 < s.size()) c = 0x10000 + ((c - 0xD800) << 10) + (s[++i] - 0xDC00);
    append_utf8(out, c);
  }
  return out;
}

enum class Case { upper, lower, title };

// ICU's full case mapping of a whole string with the root locale (Python's str methods are
// locale-independent and use the full mappings: "ß".upper() == "SS").
std::string map_case(std::string_view s, Case which) {
  const std::u16string in = to_utf16(s);
  std::u16string out(in.size() * 3 + 4, u'\0');
  UErrorCode status = U_ZERO_ERROR;
  const auto* src = reinterpret_cast<const UChar*>(in.data());
  auto* dst = reinterpret_cast<UChar*>(out.data());
  const auto cap = static_cast<int32_t>(out.size());
  const auto len = static_cast<int32_t>(in.size());
  int32_t n = 0;
  if (which == Case::upper) n = u_strToUpper(dst, cap, src, len, "", &status);
  if (which == Case::lower) n = u_strToLower(dst, cap, src, len, "", &status);
  if (which == Case::title) n = u_strToTitle(dst, cap, src, len, nullptr, "", &status);
  if (U_FAILURE(status)) fail("case mapping failed: ", u_errorName(status));
  out.resize(static_cast<std::size_t>(n));
  return from_utf16(out);
}

std::string one(char32_t c) {
  std::string s;
  append_utf8(s, c);
  return s;
}

bool is_line_break(char32_t c) {
  return c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || (c >= 0x1C && c <= 0x1E) || c == 0x85 || c == 0x2028 ||
         c == 0x2029;
}

}  // namespace

std::vector<char32_t> decode(std::string_view s) {
  std::vector<char32_t> out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) out.push_back(next(s, i));
  return out;
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

std::string encode(const std::vector<char32_t>& cps) {
  std::string out;
  for (char32_t c : cps) append_utf8(out, c);
  return out;
}

std::size_t length(std::string_view s) {
  std::size_t n = 0;
  for (unsigned char b : s) n += (b & 0xC0) != 0x80;
  return n;
}

bool is_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

std::string strip(std::string_view s, const std::optional<std::string>& chars, bool left, bool right) {
  const auto cps = decode(s);
  const std::vector<char32_t> set = chars ? decode(*chars) : std::vector<char32_t>{};
  const auto strip_it = [&](char32_t c) {
    return chars ? std::find(set.begin(), set.end(), c) != set.end() : is_space(c);
  };
  std::size_t begin = 0, end = cps.size();
  if (left)
    while (begin < end && strip_it(cps[begin])) ++begin;
  if (right)
    while (end > begin && strip_it(cps[end - 1])) --end;
  return encode(std::vector<char32_t>(cps.begin() + begin, cps.begin() + end));
}

std::vector<std::string> split(std::string_view s, const std::optional<std::string>& sep, std::int64_t maxsplit,
                               bool from_right) {
  std::vector<std::string> parts;
  if (maxsplit < 0) maxsplit = INT64_MAX;
  if (sep) {
    if (sep->empty()) fail("ValueError: empty separator");
    if (!from_right) {
      std::size_t start = 0;
      for (std::size_t at; static_cast<std::int64_t>(parts.size()) < maxsplit &&
                           (at = s.find(*sep, start)) != std::string_view::npos;
           start = at + sep->size())
        parts.emplace_back(s.substr(start, at - start));
      parts.emplace_back(s.substr(start));
    } else {
      std::size_t end = s.size();
      while (static_cast<std::int64_t>(parts.size()) < maxsplit && end >= sep->size()) {
        const std::size_t at = s.rfind(*sep, end - sep->size());
        if (at == std::string_view::npos) break;
        parts.emplace_back(s.substr(at + sep->size(), end - at - sep->size()));
        end = at;
      }
      parts.emplace_back(s.substr(0, end));
      std::reverse(parts.begin(), parts.end());
    }
    return parts;
  }
  const auto cps = decode(s);
  if (!from_right) {
    std::size_t i = 0;
    while (true) {
      while (i < cps.size() && is_space(cps[i])) ++i;
      if (i == cps.size()) break;
      if (static_cast<std::int64_t>(parts.size()) == maxsplit) {
        std::size_t end = cps.size();
        while (end > i && is_space(cps[end - 1])) --end;
        parts.push_back(encode(std::vector<char32_t>(cps.begin() + i, cps.begin() + end)));
        break;
      }
      std::size_t j = i;
      while (j < cps.size() && !is_space(cps[j])) ++j;
      parts.push_back(encode(std::vector<char32_t>(cps.begin() + i, cps.begin() + j)));
      i = j;
    }
  } else {
    std::size_t i = cps.size();
    while (true) {
      while (i > 0 && is_space(cps[i - 1])) --i;
      if (i == 0) break;
      if (static_cast<std::int64_t>(parts.size()) == maxsplit) {
        std::size_t begin = 0;
        while (begin < i && is_space(cps[begin])) ++begin;
        parts.push_back(encode(std::vector<char32_t>(cps.begin() + begin, cps.begin() + i)));
        break;
      }
      std::size_t j = i;
      while (j > 0 && !is_space(cps[j - 1])) --j;
      parts.push_back(encode(std::vector<char32_t>(cps.begin() + j, cps.begin() + i)));
      i = j;
    }
    std::reverse(parts.begin(), parts.end());
  }
  return parts;
}

std::vector<std::string> splitlines(std::string_view s, bool keepends) {
  const auto cps = decode(s);
  std::vector<std::string> lines;
  std::size_t start = 0;
  for (std::size_t i = 0; i < cps.size(); ++i) {
    if (!is_line_break(cps[i])) continue;
    std::size_t end = i + 1;
    if (cps[i] == '\r' && i + 1 < cps.size() && cps[i + 1] == '\n') end = i + 2;
    lines.push_back(encode(std::vector<char32_t>(cps.begin() + start, cps.begin() + (keepends ? end : i))));
    start = end;
    i = end - 1;
  }
  if (start < cps.size()) lines.push_back(encode(std::vector<char32_t>(cps.begin() + start, cps.end())));
  return lines;
}

std::string replace(std::string_view s, std::string_view old, std::string_view replacement, std::int64_t count) {
  if (count < 0) count = INT64_MAX;
  std::string out;
  if (old.empty()) {
    // Python inserts the replacement before every code point and at the end.
    std::size_t i = 0;
    std::int64_t done = 0;
    while (i <= s.size()) {
      if (done < count) {
        out.append(replacement);
        ++done;
      }
      if (i == s.size()) break;
      const std::size_t start = i;
      next(s, i);
      out.append(s.substr(start, i - start));
    }
    return out;
  }
  std::size_t start = 0;
  for (std::int64_t done = 0; done < count; ++done) {
    const std::size_t at = s.find(old, start);
    if (at == std::string_view::npos) break;
    out.append(s.substr(start, at - start)).append(replacement);
    start = at + old.size();
  }
  out.append(s.substr(start));
  return out;
}

std::string upper(std::string_view s) { return map_case(s, Case::upper); }
std::string lower(std::string_view s) { return map_case(s, Case::lower); }

// CPython's str.title(): a cased character after a cased one is lowercased, any other
// character is titlecased.
std::string title(std::string_view s) {
  std::string out;
  bool previous_cased = false;
  for (char32_t c : decode(s)) {
    out += previous_cased ? map_case(one(c), Case::lower) : map_case(one(c), Case::title);
    previous_cased = u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_CASED);
  }
  return out;
}

std::string capitalize(std::string_view s) {
  if (s.empty()) return {};
  std::size_t i = 0;
  const char32_t first = next(s, i);
  return map_case(one(first), Case::title) + map_case(s.substr(i), Case::lower);
}

bool is_printable(char32_t c) {
  if (c == ' ') return true;
  switch (u_charType(static_cast<UChar32>(c))) {
    case U_CONTROL_CHAR:
    case U_FORMAT_CHAR:
    case U_SURROGATE:
    case U_PRIVATE_USE_CHAR:
    case U_UNASSIGNED:
    case U_LINE_SEPARATOR:
    case U_PARAGRAPH_SEPARATOR:
    case U_SPACE_SEPARATOR:
      return false;
    default:
      return true;
  }
}

bool is_alpha(char32_t c) {
  switch (u_charType(static_cast<UChar32>(c))) {
    case U_UPPERCASE_LETTER:
    case U_LOWERCASE_LETTER:
    case U_TITLECASE_LETTER:
    case U_MODIFIER_LETTER:
    case U_OTHER_LETTER:
      return true;
    default:
      return false;
  }
}

bool is_digit(char32_t c) {
  const auto type = u_getIntPropertyValue(static_cast<UChar32>(c), UCHAR_NUMERIC_TYPE);
  return type == U_NT_DECIMAL || type == U_NT_DIGIT;
}

bool is_alnum(char32_t c) {
  return is_alpha(c) || u_getIntPropertyValue(static_cast<UChar32>(c), UCHAR_NUMERIC_TYPE) != U_NT_NONE;
}

// Every cased character of one case (lower or upper), and at least one of them.
static bool all_cased(std::string_view s, bool lower) {
  bool any = false;
  for (char32_t c : decode(s)) {
    if (lower ? is_upper_cased(c) : is_lower_cased(c)) return false;
    any = any || (lower ? is_lower_cased(c) : is_upper_cased(c));
  }
  return any;
}

bool is_lower(std::string_view s) { return all_cased(s, true); }
bool is_upper(std::string_view s) { return all_cased(s, false); }

std::string html_escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '\'': out += "&#39;"; break;
      case '"': out += "&#34;"; break;
      default: out.push_back(c);
    }
  }
  return out;
}

bool is_lower_cased(char32_t c) { return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_LOWERCASE); }
bool is_upper_cased(char32_t c) { return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_UPPERCASE); }

}  // namespace tessera::toolkit::jinja::text
