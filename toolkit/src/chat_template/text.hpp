#pragma once
// Python's str methods over UTF-8 text: Python indexes, slices and measures strings by code
// point, and its whitespace and case rules are Unicode's (case mappings through ICU). Every
// string a template sees is valid UTF-8 (the template and the JSON it is given are checked).
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tessera::toolkit::jinja::text {

/// The code points of `s`.
std::vector<char32_t> decode(std::string_view s);
void append_utf8(std::string& out, char32_t c);
std::string encode(const std::vector<char32_t>& cps);
/// Number of code points.
std::size_t length(std::string_view s);

/// str.isspace() of one code point.
bool is_space(char32_t c);
/// str.strip() / lstrip() / rstrip(): whitespace, or the code points of `chars`.
std::string strip(std::string_view s, const std::optional<std::string>& chars, bool left, bool right);
/// str.split(sep, maxsplit) and rsplit(); no sep splits on runs of whitespace.
std::vector<std::string> split(std::string_view s, const std::optional<std::string>& sep, std::int64_t maxsplit,
                               bool from_right = false);
/// str.splitlines(keepends).
std::vector<std::string> splitlines(std::string_view s, bool keepends = false);
/// str.replace(old, new, count); count < 0 replaces all.
std::string replace(std::string_view s, std::string_view old, std::string_view replacement, std::int64_t count);
/// str.upper(), lower(), title(), capitalize() with Unicode's full case mappings.
std::string upper(std::string_view s);
std::string lower(std::string_view s);
std::string title(std::string_view s);
std::string capitalize(std::string_view s);
/// str.islower() / str.isupper(): every cased character of that case, and at least one.
bool is_lower(std::string_view s);
bool is_upper(std::string_view s);
/// markupsafe.escape: & < > ' " as HTML entities.
std::string html_escape(std::string_view s);
/// str.isprintable() of one code point (what repr() leaves unescaped).
bool is_printable(char32_t c);
/// Python character classes of str.isalpha() and friends, for one code point.
bool is_alpha(char32_t c);
bool is_digit(char32_t c);
bool is_alnum(char32_t c);
bool is_lower_cased(char32_t c);
bool is_upper_cased(char32_t c);

}  // namespace tessera::toolkit::jinja::text
