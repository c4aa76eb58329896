// libFuzzer: a run's TOML configuration, as every tessera command reads it (toml++'s parser,
// then every section's keys and checks in host/config/config.cpp).
#include <cstddef>
#include <cstdint>
#include <exception>

#include "config/config.hpp"
#include "fuzz_input.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  tessera::fuzz::InputFile file(data, size);
  try {
    (void)tessera::host::Config::load(file.path(), {});
  } catch (const std::exception&) {
  }
  return 0;
}
