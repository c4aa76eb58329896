#include "tessera/toolkit/openblas.hpp"

#include <dlfcn.h>

namespace tessera::toolkit::openblas {

namespace {

struct Controls {
  using SetThreads = void (*)(int);
  using GetInt = int (*)();
  SetThreads set_num_threads = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  GetInt get_num_threads = reinterpret_cast<GetInt>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  GetInt get_parallel = reinterpret_cast<GetInt>(::dlsym(RTLD_DEFAULT, "openblas_get_parallel"));
  GetInt thread_shutdown = reinterpret_cast<GetInt>(::dlsym(RTLD_DEFAULT, "blas_thread_shutdown_"));
  bool found() const { return set_num_threads && get_num_threads && get_parallel; }
};

const Controls& controls() {
  static const Controls found;
  return found;
}

}  // namespace

bool loaded() { return controls().found(); }
bool has_own_threads() { return loaded() && controls().get_parallel() == 1; }
int num_threads() { return loaded() ? controls().get_num_threads() : 1; }
void set_num_threads(int threads) {
  if (loaded()) controls().set_num_threads(threads);
}
void stop_threads() {
  if (has_own_threads() && controls().thread_shutdown) controls().thread_shutdown();
}

}  // namespace tessera::toolkit::openblas
