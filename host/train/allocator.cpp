#include "train/allocator.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <string>

// Read by jemalloc when it starts (a MALLOC_CONF the user sets is read after it and wins). With
// freed pages kept (keep_freed_pages), jemalloc's default would let a request take a kept extent
// only when it is at most 64 times the request's size (lg 6); kept extents coalesce past that, so
// small requests took fresh pages every step and a rank grew without bound: the main job's Llama
// at batch 1 on one device went from 85 MB of heap to 995 MB in 400 steps (2.4 MB a step), and
// slowed as it faulted them in. Any kept extent may now serve any request: flat at 85 MB.
extern "C" {
extern const char* malloc_conf;
const char* malloc_conf = "lg_extent_max_active_fit:20";
}

namespace tessera::host {

namespace {

using Mallctl = int (*)(const char*, void*, std::size_t*, void*, std::size_t);

// jemalloc's control entry, unless the user's MALLOC_CONF sets a decay or the malloc is another.
Mallctl jemalloc_control() {
  const char* conf = std::getenv("MALLOC_CONF");
  if (conf != nullptr && std::strstr(conf, "decay") != nullptr) return nullptr;
  return reinterpret_cast<Mallctl>(::dlsym(RTLD_DEFAULT, "mallctl"));
}

}  // namespace

// jemalloc hands freed pages back to the kernel as they age (its 10 s decay), and the next
// step faults them in again: 1.8 million page faults in 20 steps of DDP on 2 ranks of the
// bench GPT instead of 0.37 million (~8% of a step). Blocks above the oversize threshold
// (8 MiB) have their own arena, which purges at once. A job of several ranks keeps that:
// retained there beside the ordinary arenas' pages, FSDP's 57M GPT held 80-155 MB more per
// rank on 2 ranks (each arena keeps its own peak, and big blocks serve few later requests).
// A one-process job has no 1/N line to keep, and its activations pass 8 MiB sooner: a
// single device on the bench GPT (batch 16) faulted 4.7 million times in 30 steps when that
// arena purged, 12 of its 60 CPU seconds.
void keep_freed_pages(bool oversize_blocks_too) {
  Mallctl mallctl = jemalloc_control();
  if (mallctl == nullptr) return;
  std::size_t oversize = 0, length = sizeof oversize;
  if (!oversize_blocks_too && mallctl("opt.oversize_threshold", &oversize, &length, nullptr, 0) == 0 && oversize > 0) {
    void* volatile block = std::malloc(oversize + 1);  // creates that arena, with its immediate purge, now
    std::free(block);                                   // (volatile: a malloc/free pair may be elided)
  }
  ssize_t never = -1;
  mallctl("arenas.dirty_decay_ms", nullptr, nullptr, &never, sizeof never);  // arenas made from now on
  unsigned ordinary = 0, all = 0;  // ordinary arenas are 0 .. opt.narenas - 1; the oversize one follows
  length = sizeof ordinary;
  if (mallctl("opt.narenas", &ordinary, &length, nullptr, 0) != 0) return;
  length = sizeof all;
  if (mallctl("arenas.narenas", &all, &length, nullptr, 0) != 0) return;
  for (unsigned i = 0; i < (oversize_blocks_too ? all + 1 : ordinary); ++i)  // those in use: others refuse
    mallctl(("arena." + std::to_string(i) + ".dirty_decay_ms").c_str(), nullptr, nullptr, &never, sizeof never);
}

void return_freed_pages() {
  auto mallctl = reinterpret_cast<Mallctl>(::dlsym(RTLD_DEFAULT, "mallctl"));
  if (mallctl == nullptr) return;
  mallctl("thread.tcache.flush", nullptr, nullptr, nullptr, 0);
  mallctl("arena.4096.purge", nullptr, nullptr, nullptr, 0);  // 4096: MALLCTL_ARENAS_ALL
}

}  // namespace tessera::host
