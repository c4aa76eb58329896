// libFuzzer: a PyTorch DCP folder's `.metadata` pickle, as init_from and --ckpt-path read it
// (the restricted pickle reader and the metadata's checks; nothing is ever called).
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string_view>

#include "checkpoint/dcp.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    (void)tessera::core::parse_dcp_metadata(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
  } catch (const std::exception&) {
  }
  return 0;
}
