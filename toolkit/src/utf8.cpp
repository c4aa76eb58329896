#include "utf8.hpp"

#include "tessera/sdk/error.hpp"

namespace tessera::toolkit {
namespace {

// How many bytes at `p` form a valid UTF-8 character (> 0), or minus the length of the maximal
// invalid subpart (Unicode's "U+FFFD substitution of maximal subparts", as Rust does it).
int scan(const unsigned char* p, std::size_t left) {
  const unsigned char lead = p[0];
  if (lead < 0x80) return 1;
  int need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    need = 1;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    need = 2;
    if (lead == 0xE0) lo = 0xA0;
    if (lead == 0xED) hi = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    need = 3;
    if (lead == 0xF0) lo = 0x90;
    if (lead == 0xF4) hi = 0x8F;
  } else {
    return -1;
  }
  for (int i = 1; i <= need; ++i) {
    if (static_cast<std::size_t>(i) >= left) return -i;
    const unsigned char c = p[i];
    if (c < lo || c > hi) return -i;
    lo = 0x80;
    hi = 0xBF;
  }
  return need + 1;
}

}  // namespace

std::optional<std::size_t> invalid_utf8_offset(std::string_view text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  for (std::size_t i = 0; i < text.size();) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    const int n = scan(p + i, text.size() - i);
    if (n <= 0) return i;
    i += n;
  }
  return std::nullopt;
}

void check_utf8(std::string_view text, const std::string& source) {
  const auto bad = invalid_utf8_offset(text);
  TESSERA_CHECK(!bad, "text given to tokenizer ", source, " is not valid UTF-8 (byte ", bad.value_or(0), ")");
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  for (std::size_t i = 0; i < bytes.size();) {
    const int n = scan(p + i, bytes.size() - i);
    if (n > 0) {
      out.append(bytes.substr(i, n));
      i += n;
    } else {
      out += "\xEF\xBF\xBD";
      i += -n;
    }
  }
  return out;
}

}  // namespace tessera::toolkit
