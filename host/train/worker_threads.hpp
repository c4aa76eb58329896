#pragma once
// How the idle threads of libgomp and OpenBLAS wait, which each reads only when it loads
// (before main()): set here and applied by re-executing the binary in place (~0.5 s per start).
// Not from the executable's .preinit_array, which does run before the libraries' constructors:
// glibc's own initializer then resets environ to the loader's copy and the setenv is lost (tried
// 2026-11-26: libgomp still read 300,000).

namespace tessera::host {

/// Unless the user chose them, sets GOMP_SPINCOUNT=10000 (libgomp loaded, no OMP_WAIT_POLICY)
/// and OPENBLAS_THREAD_TIMEOUT=20 (OpenBLAS's pthreads build loaded), then re-executes this
/// binary (same pid and arguments; ranks inherit the settings, so they do not re-execute).
/// Both runtimes' idle workers otherwise spin on the cores the other's threads need next:
/// libgomp's 300,000 times after each parallel region, OpenBLAS's for 2^28 cycles (~0.1 s) after
/// each matmul. Returns when nothing had to change or the exec failed.
void settle_worker_threads(char** argv);

}  // namespace tessera::host
