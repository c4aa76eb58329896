// libFuzzer: a sharded checkpoint's manifest.json, as fit's resume and `checkpoint verify` read it.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>

#include "tessera/core/sharded_checkpoint.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string folder = [] {
    const std::string dir = "/dev/shm/tessera-fuzz-manifest-" + std::to_string(::getpid());
    std::filesystem::create_directories(dir);
    return dir;
  }();
  std::ofstream(folder + "/" + tessera::core::kManifestName, std::ios::binary)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  try {
    (void)tessera::core::read_manifest(folder);
  } catch (const std::exception&) {
  }
  return 0;
}
