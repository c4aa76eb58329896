#include "openmp_workers.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>

namespace tessera::host {

// 10,000 spins (tens of microseconds) keep the workers hot between the short elementwise
// kernels of a step and leave the cores to OpenBLAS during matmuls: bench GPT, single device,
// 2 cores: 2,700 tokens/s against 1,200 at libgomp's 300,000 and 1,900 at 100,000.
void settle_openmp_workers(char** argv) {
  if (std::getenv("GOMP_SPINCOUNT") != nullptr || std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  if (::dlsym(RTLD_DEFAULT, "GOMP_parallel") == nullptr) return;  // not libgomp
  ::setenv("GOMP_SPINCOUNT", "10000", 1);
  ::execv("/proc/self/exe", argv);  // returns only on failure: run on with libgomp's default
}

}  // namespace tessera::host
