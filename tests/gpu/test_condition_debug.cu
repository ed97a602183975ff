// A null condition set from a kernel traps in builds without NDEBUG (a silent no-op otherwise).
// Its own executable: a device-side assertion leaves the CUDA context unusable.
#undef NDEBUG
#include <doctest/doctest.h>
#include <replay/replay.hpp>

namespace {
__global__ void set_null(replay::condition c) { c.set(true); }
}  // namespace

TEST_CASE("setting a null condition from a kernel is a device-side assertion" *
          doctest::test_suite("expected_cuda_errors")) {
  replay::stream s;
  set_null<<<1, 1, 0, s.get()>>>(replay::condition{});
  REQUIRE(cudaGetLastError() == cudaSuccess);
  const cudaError_t e = cudaStreamSynchronize(s.get());
  CHECK(e == cudaErrorAssert);
}
