// The reader's common ground (hf_tokenizer_parts.hpp): strict JSON access, PCRE2 regexes,
// GPT-2's byte alphabet and UTF-8 code points.
#include <cctype>

#include "hf_tokenizer_parts.hpp"
#include "json_integer.hpp"
#include "utf8.hpp"

namespace tessera::toolkit::hf {

const json& require(const json& object, const char* key, const Where& where) {
  TESSERA_CHECK(object.is_object() && object.contains(key), "Hugging Face tokenizer ", where.str(), " has no \"", key,
                "\"");
  return object.at(key);
}

std::int64_t integer_in(const json& value, std::int64_t min, std::int64_t max, const Where& where) {
  const std::optional<std::int64_t> v = detail::json_integer(value);
  TESSERA_CHECK(v && *v >= min && *v <= max, "Hugging Face tokenizer ", where.str(), " = ",
                value.dump().substr(0, 40), ": an integer in [", min, ", ", max, "] was expected");
  return *v;
}

void check_keys(const json& object, std::initializer_list<const char*> known, const Where& where) {
  TESSERA_CHECK(object.is_object(), "Hugging Face tokenizer ", where.str(), " is not a JSON object");
  for (const auto& item : object.items()) {
    const bool ok = std::any_of(known.begin(), known.end(), [&](const char* k) { return item.key() == k; });
    TESSERA_CHECK(ok, "Hugging Face tokenizer ", where.at(item.key()).str(),
                  " is not supported by Tessera's tokenizer.json reader (known keys here: ",
                  sdk::join(std::vector<std::string>(known.begin(), known.end())), ")");
  }
}

namespace {

// A per-thread JIT stack larger than PCRE2's 32 KiB default, so long whitespace or symbol runs
// (the patterns' lookaheads backtrack over them) match instead of failing.
pcre2_match_context* match_context() {
  thread_local struct Context {
    pcre2_match_context* context = pcre2_match_context_create(nullptr);
    pcre2_jit_stack* stack = pcre2_jit_stack_create(64 * 1024, 64 * 1024 * 1024, nullptr);
    Context() { pcre2_jit_stack_assign(context, nullptr, stack); }
    ~Context() {
      pcre2_jit_stack_free(stack);
      pcre2_match_context_free(context);
    }
  } context;
  return context.context;
}

}  // namespace

Regex::Regex(const std::string& pattern, const Where& where) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &error,
                        &offset, nullptr);
  if (code_ == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof message);
    TESSERA_FAIL("Hugging Face tokenizer ", where.str(), ": regex ", json(pattern).dump(), " does not compile (",
                 reinterpret_cast<const char*>(message), " at offset ", offset, ")");
  }
  pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // falls back to the interpreter where JIT is absent
  const std::string shown = json(pattern).dump();
  description_ = "Hugging Face tokenizer " + where.str() + ": regex " +
                 (shown.size() > 120 ? shown.substr(0, 117) + "..." : shown);
}

Regex Regex::literal(const std::string& text, const Where& where) {
  std::string escaped;
  for (const char c : text) {
    if (static_cast<unsigned char>(c) < 0x80 && !std::isalnum(static_cast<unsigned char>(c))) escaped += '\\';
    escaped += c;
  }
  return Regex(escaped, where);
}

Regex::~Regex() { pcre2_code_free(code_); }

std::vector<std::pair<std::size_t, std::size_t>> Regex::find_all(std::string_view text) const {
  std::vector<std::pair<std::size_t, std::size_t>> found;
  pcre2_match_data* data = pcre2_match_data_create_from_pattern(code_, nullptr);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const int rc = pcre2_match(code_, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, data, match_context());
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      pcre2_match_data_free(data);
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof message);
      TESSERA_FAIL(description_, " failed on a text of ", text.size(), " bytes: ", reinterpret_cast<const char*>(message),
                   " (a limit of PCRE2, the regex engine: its match limit or its 64 MiB JIT stack)");
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data);
    if (ovector[1] == ovector[0]) {
      if (ovector[0] >= text.size()) break;
      pos = ovector[0] + utf8_length(static_cast<unsigned char>(text[ovector[0]]));
      continue;
    }
    found.emplace_back(ovector[0], ovector[1]);
    pos = ovector[1];
  }
  pcre2_match_data_free(data);
  return found;
}

std::vector<std::tuple<std::size_t, std::size_t, bool>> Regex::pieces(std::string_view text) const {
  std::vector<std::tuple<std::size_t, std::size_t, bool>> out;
  if (text.empty()) {
    out.emplace_back(0, 0, false);
    return out;
  }
  std::size_t prev = 0;
  for (const auto& [start, end] : find_all(text)) {
    if (prev != start) out.emplace_back(prev, start, false);
    out.emplace_back(start, end, true);
    prev = end;
  }
  if (prev != text.size()) out.emplace_back(prev, text.size(), false);
  return out;
}

std::string Regex::replace_all(std::string_view text, std::string_view content) const {
  std::string out;
  for (const auto& [start, end, is_match] : pieces(text)) {
    if (is_match) {
      out += content;
    } else {
      out += text.substr(start, end - start);
    }
  }
  return out;
}

Regex pattern_regex(const json& pattern, const Where& where) {
  TESSERA_CHECK(pattern.is_object() && pattern.size() == 1, "Hugging Face tokenizer ", where.str(),
                " must be {\"String\": ...} or {\"Regex\": ...}");
  if (pattern.contains("String")) return Regex::literal(pattern.at("String").get<std::string>(), where);
  TESSERA_CHECK(pattern.contains("Regex"), "Hugging Face tokenizer ", where.str(),
                " must be {\"String\": ...} or {\"Regex\": ...}");
  return Regex(pattern.at("Regex").get<std::string>(), where);
}


ByteAlphabet::ByteAlphabet() {
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const std::uint32_t cp = printable ? b : 256 + extra++;
    std::string utf8;
    if (cp < 0x80) {
      utf8 += static_cast<char>(cp);
    } else {
      utf8 += static_cast<char>(0xC0 | (cp >> 6));
      utf8 += static_cast<char>(0x80 | (cp & 0x3F));
    }
    byte_to_char[b] = utf8;
    char_to_byte[cp] = static_cast<unsigned char>(b);
  }
}

const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet alphabet;
  return alphabet;
}

std::uint32_t next_code_point(std::string_view s, std::size_t& i) {
  const auto lead = static_cast<unsigned char>(s[i]);
  const std::size_t n = utf8_length(lead);
  std::uint32_t cp = n == 1 ? lead : n == 2 ? lead & 0x1F : n == 3 ? lead & 0x0F : lead & 0x07;
  for (std::size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += n;
  return cp;
}

std::string single_char(const json& value, const Where& where) {
  const auto s = value.get<std::string>();
  std::size_t i = 0;
  TESSERA_CHECK(!s.empty() && (next_code_point(s, i), i == s.size()), "Hugging Face tokenizer ", where.str(),
                " must be one character");
  return s;
}

}  // namespace tessera::toolkit::hf
