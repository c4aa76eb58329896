#pragma once
// libgomp's waiting policy, which it reads only when it loads (before main()): set here and
// applied by re-executing the binary in place.

namespace tessera::host {

/// Unless the user chose GOMP_SPINCOUNT or OMP_WAIT_POLICY, sets GOMP_SPINCOUNT=10000 and
/// re-executes this binary (same pid and arguments; ranks inherit the setting, so they do not
/// re-execute): libgomp's workers otherwise spin 300,000 times after each parallel region, on
/// the cores OpenBLAS's own threads need for the next matmul. Returns when nothing had to
/// change (or another OpenMP runtime is loaded) or the exec failed.
void settle_openmp_workers(char** argv);

}  // namespace tessera::host
