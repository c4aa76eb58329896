#include "compute_libraries.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace tessera::host {

namespace {

// 10,000 spins (tens of microseconds) keep the workers hot between the short elementwise
// kernels of a step and leave the cores to OpenBLAS during matmuls: bench GPT, single device,
// 2 cores: 2,700 tokens/s against 1,200 at libgomp's 300,000 and 1,900 at 100,000.
const char* openmp_spin_count() {
  if (std::getenv("GOMP_SPINCOUNT") != nullptr || std::getenv("OMP_WAIT_POLICY") != nullptr) return nullptr;
  if (::dlsym(RTLD_DEFAULT, "GOMP_parallel") == nullptr) return nullptr;  // not libgomp
  return "10000";
}

// OpenBLAS picks its kernels by CPU model; one it does not know gets a generic choice. Debian
// bookworm's 0.3.21 runs its Haswell (AVX2) kernels on AMD's AVX-512 cores: the bench GPT on
// 2 cores of such a machine trained at 2,650 tokens/s, 4,700 with the SkylakeX kernels, which
// need AVX-512 F, CD, BW, DQ and VL (Cooperlake's add BF16). Later OpenBLAS releases map these
// CPUs to the same kernels.
const char* openblas_core_type() {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return nullptr;
  using CoreName = char* (*)();
  auto core_name = reinterpret_cast<CoreName>(::dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  if (core_name == nullptr) return nullptr;
  const char* running = core_name();
  if (running == nullptr || (std::strcmp(running, "Haswell") != 0 && std::strcmp(running, "Zen") != 0)) return nullptr;
  __builtin_cpu_init();
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")))
    return nullptr;
  return __builtin_cpu_supports("avx512bf16") ? "COOPERLAKE" : "SKYLAKEX";
}

}  // namespace

void settle_compute_libraries(char** argv) {
  const char* spin = openmp_spin_count();
  const char* core = openblas_core_type();
  if (spin == nullptr && core == nullptr) return;
  if (spin != nullptr) ::setenv("GOMP_SPINCOUNT", spin, 1);
  if (core != nullptr) ::setenv("OPENBLAS_CORETYPE", core, 1);
  ::execv("/proc/self/exe", argv);  // returns only on failure: run on with the libraries' defaults
}

}  // namespace tessera::host
