// sdk/autocast.hpp and sdk/openblas.hpp: LibTorch's and OpenBLAS's thread-wide state, read and
// set through the SDK, checked against what the libraries themselves report.
#include <gtest/gtest.h>
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <dlfcn.h>

#include "tessera/sdk/autocast.hpp"
#include "tessera/toolkit/openblas.hpp"

namespace {

namespace openblas = tessera::toolkit::openblas;

TEST(ThreadState, AutocastIsSetAndRestoredOnTheCpu) {
  ASSERT_FALSE(tessera::sdk::autocast_enabled(/*cuda=*/false));
  const at::ScalarType before = tessera::sdk::autocast_dtype(/*cuda=*/false);
  tessera::sdk::set_autocast(/*cuda=*/false, true, at::kBFloat16);
  EXPECT_TRUE(tessera::sdk::autocast_enabled(/*cuda=*/false));
  EXPECT_FALSE(tessera::sdk::autocast_enabled(/*cuda=*/true));
  EXPECT_EQ(tessera::sdk::autocast_dtype(/*cuda=*/false), at::kBFloat16);
  // What autocast does with it: a CPU matmul under it computes in bf16.
  EXPECT_EQ(at::mm(at::ones({2, 2}), at::ones({2, 2})).scalar_type(), at::kBFloat16);
  tessera::sdk::set_autocast(/*cuda=*/false, false, before);
  EXPECT_FALSE(tessera::sdk::autocast_enabled(/*cuda=*/false));
  EXPECT_EQ(at::mm(at::ones({2, 2}), at::ones({2, 2})).scalar_type(), at::kFloat);
}

TEST(ThreadState, OpenBlasThreadsAreSetWhereOpenBlasIsLinked) {
  // OpenBLAS's own answers, looked up independently of the SDK.
  using GetInt = int (*)();
  auto get_threads = reinterpret_cast<GetInt>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  auto get_parallel = reinterpret_cast<GetInt>(::dlsym(RTLD_DEFAULT, "openblas_get_parallel"));
  ASSERT_EQ(openblas::loaded(), get_threads != nullptr && get_parallel != nullptr);
  if (!openblas::loaded()) {
    openblas::set_num_threads(3);  // nothing to set, and nothing fails
    EXPECT_EQ(openblas::num_threads(), 1);
    EXPECT_FALSE(openblas::has_own_threads());
    GTEST_SKIP() << "LibTorch's BLAS here is not OpenBLAS: only the no-op was checked";
  }
  EXPECT_EQ(openblas::has_own_threads(), get_parallel() == 1);
  const int before = openblas::num_threads();
  EXPECT_EQ(before, get_threads());
  openblas::set_num_threads(1);
  EXPECT_EQ(get_threads(), 1);
  openblas::set_num_threads(2);
  // Its serial build has one thread whatever it is told.
  EXPECT_EQ(get_threads(), get_parallel() == 0 ? 1 : 2);
  openblas::set_num_threads(before);
  EXPECT_EQ(openblas::num_threads(), before);
}

}  // namespace
