#pragma once
// Settings of the libraries a step's compute runs in (libgomp, OpenBLAS) that they read only
// when they load, before main(): set here and applied by re-executing the binary in place.

namespace tessera::host {

/// Unless the user chose them, sets
/// - GOMP_SPINCOUNT=10000: libgomp's workers otherwise spin 300,000 times after each parallel
///   region, on the cores OpenBLAS's own threads need for the next matmul;
/// - OPENBLAS_CORETYPE=SKYLAKEX (COOPERLAKE with AVX512-BF16) when the loaded OpenBLAS runs
///   AVX2 kernels on a CPU with AVX-512 it does not recognise (Debian's 0.3.21 on Zen 4/5);
/// and then re-executes this binary (same pid and arguments; ranks inherit the settings, so
/// they do not re-execute). Returns when nothing had to change or the exec failed.
void settle_compute_libraries(char** argv);

}  // namespace tessera::host
