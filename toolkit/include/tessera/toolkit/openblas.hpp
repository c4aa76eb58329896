#pragma once
/// OpenBLAS's own thread pool, looked up at run time: LibTorch's BLAS may be another (pip
/// wheels link MKL), and then there is no pool here to read or set.

namespace tessera::toolkit::openblas {

/// Whether the process has OpenBLAS's thread controls.
bool loaded();
/// Whether it runs a pool of its own (its pthreads build, Debian's default), whose count a
/// call from inside another pool's thread uses again; its OpenMP build waits in libgomp's pool
/// and runs single-threaded inside a parallel region, its serial build has no threads.
bool has_own_threads();
/// Its thread count; 1 when it is not loaded.
int num_threads();
/// Sets its thread count; nothing when it is not loaded.
void set_num_threads(int threads);
/// Ends its pool's threads, as its own fork handler does; its next call starts them again. Its
/// pthreads build starts them when it is loaded: a process that must run no other thread before
/// it forks (a launcher forking ranks) calls this first.
void stop_threads();

}  // namespace tessera::toolkit::openblas
