// libFuzzer: a safetensors file (its header, then every tensor's bytes), as sharded checkpoints
// and `checkpoint export`'s files are read.
#include <cstddef>
#include <cstdint>
#include <exception>

#include "fuzz_input.hpp"
#include "tessera/core/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  tessera::fuzz::InputFile file(data, size);
  try {
    tessera::core::SafetensorsReader reader(file.path());
    for (const auto& [name, entry] : reader.tensors()) (void)reader.read(name);
  } catch (const std::exception&) {
  }
  return 0;
}
