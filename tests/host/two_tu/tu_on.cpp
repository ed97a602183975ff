// The two-TU test's translation unit with NVTX on (see test_two_tu.cpp).
#define REPLAY_NVTX 1
#include <replay/capture_watch.hpp>
#include <replay/graph_pool.hpp>
#include <replay/nvtx.hpp>

#include "../pool_fake_backend.hpp"
#include "layout.hpp"

namespace two_tu {

layout layout_nvtx_on() {
  return {REPLAY_NVTX, REPLAY_HAS_CUPTI, sizeof(replay::nvtx_label), alignof(replay::nvtx_label),
          sizeof(replay::capture_watch), alignof(replay::capture_watch)};
}

std::size_t run_on(void* pool, unsigned bucket) {
  auto& p = *static_cast<pool_fake::fake_pool<replay::graph_key>*>(pool);
  (void)p.run(replay::graph_key{.bucket = bucket}, 0, [](int) {});
  return p.size();
}

}  // namespace two_tu
