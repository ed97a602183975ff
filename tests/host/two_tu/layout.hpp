// What each translation unit of the two-TU test reports about the classes whose members once
// depended on configuration macros (REPLAY_NVTX, REPLAY_HAS_CUPTI).
#pragma once

#include <cstddef>

namespace two_tu {

struct layout {
  int nvtx = -1;   ///< REPLAY_NVTX in this translation unit
  int cupti = -1;  ///< REPLAY_HAS_CUPTI in this translation unit
  std::size_t nvtx_label_size = 0, nvtx_label_align = 0;
  std::size_t capture_watch_size = 0, capture_watch_align = 0;
};

layout layout_nvtx_on();    // built with REPLAY_NVTX=1, CUPTI where found
layout layout_nvtx_off();   // built with REPLAY_NVTX=0 and REPLAY_HAS_CUPTI=0

/// Runs the shared pool for `bucket` from the translation unit named; returns the pool's size.
std::size_t run_on(void* pool, unsigned bucket);   // REPLAY_NVTX=1
std::size_t run_off(void* pool, unsigned bucket);  // REPLAY_NVTX=0

}  // namespace two_tu
