// GPU tests of capture_scope's exception safety when an allocation fails: this program replaces the
// global operator new so that a test can make the next allocations throw std::bad_alloc.
#include <doctest/doctest.h>
#include <gpu_test.hpp>
#include <replay/replay.hpp>

#include <cstdlib>
#include <new>
#include <vector>

namespace {
thread_local int fail_after = -1;  // -1: never fail; n >= 0: the allocation after n more succeeds fails

void* checked_alloc(std::size_t n) {
  if (fail_after == 0) {
    fail_after = -1;
    throw std::bad_alloc();
  }
  if (fail_after > 0) --fail_after;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}

__global__ void add_one(float* x) { x[threadIdx.x] += 1.0f; }

/// Makes the next `n`-th allocation of this thread throw (0: the very next one).
struct fail_next {
  explicit fail_next(int n) { fail_after = n; }
  ~fail_next() { fail_after = -1; }
};
}  // namespace

// nvcc sees the global allocation functions as __host__ __device__; these are host-only.
#pragma nv_diag_suppress 20011
void* operator new(std::size_t n) { return checked_alloc(n); }
void* operator new[](std::size_t n) { return checked_alloc(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

TEST_CASE("capture_scope construction that fails to allocate leaves the stream not capturing") {
  replay::stream s;
  replay::device_buffer<float> x(32);
  bool threw = false;
  {
    // Empty the capture stack's storage so that its push_back must allocate.
    replay::detail::capturing_streams().shrink_to_fit();
    fail_next f(0);
    try {
      replay::capture_scope scope(s);
    } catch (const std::bad_alloc&) {
      threw = true;
    }
  }
  CHECK(threw);
  CHECK_FALSE(s.is_capturing());
  add_one<<<1, 32, 0, s.get()>>>(x.data());  // eager work still runs
  REPLAY_CHECK_LAUNCH("add_one");
  s.synchronize();
}

TEST_CASE("capture_scope::fork that fails to allocate leaves the side stream outside the capture") {
  replay::stream s, side;
  replay::device_buffer<float> x(32);
  bool threw = false;
  {
    replay::capture_scope scope(s);
    add_one<<<1, 32, 0, s.get()>>>(x.data());
    {
      fail_next f(0);  // the fork's bookkeeping is the next allocation
      try {
        scope.fork(side);
      } catch (const std::bad_alloc&) {
        threw = true;
      }
    }
    CHECK_FALSE(side.is_capturing());
    replay::graph g = scope.finish();  // the capture is intact and ends cleanly
    CHECK(g.kernel_node_count() == 1);
  }
  CHECK(threw);
  CHECK_FALSE(s.is_capturing());
  CHECK_FALSE(side.is_capturing());
  s.synchronize();
}
