#pragma once
/// Memory figures are not the product's in a build with AddressSanitizer (.ci/sanitize): its
/// shadow memory, redzones and quarantine add to every process's RSS, and tessera runs on the C
/// library's malloc there (TESSERA_JEMALLOC=OFF). A test of peak RSS or of jemalloc's settings
/// starts with TESSERA_SKIP_IF_ADDRESS_SANITIZER(), reported as skipped, never as passed.
#include <gtest/gtest.h>

#if defined(__SANITIZE_ADDRESS__)
/// An instrumented build runs a few times slower: a wall-clock bound in a test (a budget that
/// must refuse "at once") is multiplied by it, as ctest's limits are by TESSERA_TEST_TIMEOUT_SCALE.
inline constexpr int kSanitizerSlowdown = 4;
#define TESSERA_SKIP_IF_ADDRESS_SANITIZER()                                                                   \
  GTEST_SKIP() << "SKIPPED: built with AddressSanitizer, whose shadow memory and allocator change what this " \
                  "test measures (bash .ci/run runs it)"
#else
inline constexpr int kSanitizerSlowdown = 1;
#define TESSERA_SKIP_IF_ADDRESS_SANITIZER() static_cast<void>(0)
#endif
