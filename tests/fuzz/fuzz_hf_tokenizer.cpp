// libFuzzer: a Hugging Face tokenizer.json (the toolkit's strict reader), then the tokenizer it
// makes on a few texts.
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string_view>

#include "tessera/toolkit/tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    auto tokenizer = tessera::toolkit::parse_huggingface_tokenizer(
        std::string_view(reinterpret_cast<const char*>(data), size), "fuzz-input/tokenizer.json");
    for (std::string_view text : {"Q: What is a flat parameter? A: shards.", "", "\xc3\xa9t\xc3\xa9 \xf0\x9f\x98\x80"})
      (void)tokenizer->decode(tokenizer->encode(text));
  } catch (const std::exception&) {
  }
  return 0;
}
