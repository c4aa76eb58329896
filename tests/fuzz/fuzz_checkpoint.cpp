// libFuzzer: a whole checkpoint file (torch.save's zip, its pickle, its tensor records) as
// `tessera checkpoint inspect` and fit's resume read it.
#include <cstddef>
#include <cstdint>
#include <exception>

#include "fuzz_input.hpp"
#include "tessera/core/checkpoint.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  tessera::fuzz::InputFile file(data, size);
  try {
    tessera::sdk::Checkpoint checkpoint = tessera::core::load_checkpoint_file(file.path());
    tessera::core::check_tensor_checksums(checkpoint, file.path());
  } catch (const std::exception&) {  // a refusal is the right answer to most inputs
  }
  return 0;
}
