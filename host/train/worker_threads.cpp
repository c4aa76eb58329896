#include "train/worker_threads.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "tessera/toolkit/openblas.hpp"

namespace tessera::host {

namespace {

bool chose(const char* name) { return std::getenv(name) != nullptr; }

}  // namespace

// Measured on the bench GPT, single device, 2 cores (2 threads each for LibTorch's OpenMP pool
// and OpenBLAS's): GOMP_SPINCOUNT 10,000 gave 2,700 tokens/s against 1,200 at libgomp's
// 300,000 and 1,900 at 100,000. OPENBLAS_THREAD_TIMEOUT 20 (2^20 cycles, well under a
// millisecond, then the worker sleeps until the next matmul) on top: 1.04x to 1.45x in each of 8
// interleaved pairs, median 1,975 against 1,794 (2026-11-26); 16 to 22 alike.
void settle_worker_threads(char** argv) {
  bool changed = false;
  if (!chose("GOMP_SPINCOUNT") && !chose("OMP_WAIT_POLICY") && ::dlsym(RTLD_DEFAULT, "GOMP_parallel") != nullptr) {
    ::setenv("GOMP_SPINCOUNT", "10000", 1);
    changed = true;
  }
  if (!chose("OPENBLAS_THREAD_TIMEOUT") && toolkit::openblas::has_own_threads()) {
    ::setenv("OPENBLAS_THREAD_TIMEOUT", "20", 1);
    changed = true;
  }
  if (!changed) return;
  // Through the binary's own path, as the launcher starts ranks: the kernel names a process
  // after the file it executes, and `ps`, `top` and `pkill tessera` should see "tessera", not "exe".
  std::error_code error;
  const std::string self = std::filesystem::read_symlink("/proc/self/exe", error).string();
  if (!error) ::execv(self.c_str(), argv);
  ::execv("/proc/self/exe", argv);  // returns only on failure: run on with the defaults
}

}  // namespace tessera::host
