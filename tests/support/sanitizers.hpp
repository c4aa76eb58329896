#pragma once
/// Memory figures are not the product's in a build with AddressSanitizer (.ci/sanitize): its
/// shadow memory, redzones and quarantine add to every process's RSS, and tessera runs on the C
/// library's malloc there (TESSERA_JEMALLOC=OFF). A test of peak RSS or of jemalloc's settings
/// starts with TESSERA_SKIP_IF_ADDRESS_SANITIZER(), reported as skipped, never as passed.
#include <gtest/gtest.h>

#if defined(__SANITIZE_ADDRESS__)
#define TESSERA_SKIP_IF_ADDRESS_SANITIZER()                                                                   \
  GTEST_SKIP() << "SKIPPED: built with AddressSanitizer, whose shadow memory and allocator change what this " \
                  "test measures (bash .ci/run runs it)"
#else
#define TESSERA_SKIP_IF_ADDRESS_SANITIZER() static_cast<void>(0)
#endif
