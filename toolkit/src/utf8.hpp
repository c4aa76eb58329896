#pragma once
// UTF-8 helpers the tokenizers share (private to the toolkit).
#include <optional>
#include <string>
#include <string_view>

namespace tessera::toolkit {

/// Raises sdk::Error naming `source` and the byte offset when `text` is not valid UTF-8.
void check_utf8(std::string_view text, const std::string& source);

/// The byte offset of the first invalid UTF-8 sequence in `text`, or nullopt.
std::optional<std::size_t> invalid_utf8_offset(std::string_view text);

/// `bytes` as UTF-8, each maximal invalid subsequence replaced by U+FFFD (Rust's
/// String::from_utf8_lossy, which the Hugging Face decoders use).
std::string utf8_lossy(std::string_view bytes);

/// Length in bytes of the UTF-8 sequence starting with `lead` (1 for a stray byte).
inline std::size_t utf8_length(unsigned char lead) {
  return lead < 0x80 ? 1 : (lead >> 5) == 0x6 ? 2 : (lead >> 4) == 0xE ? 3 : (lead >> 3) == 0x1E ? 4 : 1;
}

}  // namespace tessera::toolkit
