// libFuzzer: a checkpoint's pickle (data.pkl), through the scan that rewrites it for LibTorch's
// unpickler and lists its globals (core/src/checkpoint/python_pickle.cpp).
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include "python_pickle.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::string> globals;
  try {
    const std::string out =
        tessera::core::detail::readable_by_libtorch(std::string_view(reinterpret_cast<const char*>(data), size), &globals);
    for (const std::string& global : globals) (void)tessera::core::detail::allowed_global(global);
  } catch (const std::exception&) {  // a pickle the scan cannot follow is refused
  }
  return 0;
}
