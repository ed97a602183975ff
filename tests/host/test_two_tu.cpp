// Two translation units built with different configuration macros (REPLAY_NVTX on and off,
// REPLAY_HAS_CUPTI as found and 0) share the classes whose inline code the linker keeps once: their
// layouts must not depend on the macros, and a pool made in one works when driven from the other.
#include <doctest/doctest.h>
#include <replay/graph_pool.hpp>

#include "pool_fake_backend.hpp"
#include "two_tu/layout.hpp"

TEST_CASE("layouts do not depend on REPLAY_NVTX or REPLAY_HAS_CUPTI") {
  const two_tu::layout on = two_tu::layout_nvtx_on(), off = two_tu::layout_nvtx_off();
  CHECK(on.nvtx == 1);
  CHECK(off.nvtx == 0);
  CHECK(off.cupti == 0);
  CHECK(on.nvtx_label_size == off.nvtx_label_size);
  CHECK(on.nvtx_label_align == off.nvtx_label_align);
  CHECK(on.capture_watch_size == off.capture_watch_size);
  CHECK(on.capture_watch_align == off.capture_watch_align);
}

TEST_CASE("a pool made in one translation unit runs from both") {
  pool_fake::fake_pool<replay::graph_key> pool;
  for (unsigned b = 1; b <= 64; b *= 2) {
    CHECK(two_tu::run_on(&pool, b) == two_tu::run_off(&pool, b));
    CHECK(two_tu::run_off(&pool, b + 1000) == two_tu::run_on(&pool, b + 1000));
  }
  CHECK(pool.size() == 14);
  CHECK(pool.stats().hits == 14);
  CHECK(pool.stats().misses == 14);
}
