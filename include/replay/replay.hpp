// replay/replay.hpp: the whole toolkit in one include.
#pragma once

#include <replay/version.hpp>
#include <replay/error.hpp>
#include <replay/stream.hpp>
#include <replay/event.hpp>
#include <replay/buffer.hpp>
#include <replay/graph.hpp>
#include <replay/graph_exec.hpp>
#include <replay/capture.hpp>
#include <replay/launch.hpp>
#include <replay/step_meta.hpp>
#include <replay/bucket.hpp>
#include <replay/graph_key.hpp>
#include <replay/pool_stats.hpp>
#include <replay/cuda_graph_backend.hpp>
#include <replay/graph_pool.hpp>
#include <replay/warnings.hpp>
#include <replay/kill_switch.hpp>
#include <replay/runner.hpp>
#include <replay/conditional.hpp>
#include <replay/device_loop.hpp>
#include <replay/nvtx.hpp>
#include <replay/graph_summary.hpp>
#include <replay/inspect.hpp>
#include <replay/audit.hpp>
#include <replay/lockstep.hpp>
#if defined(REPLAY_HAS_NCCL)  // targets that link replay::nccl
#  include <replay/nccl.hpp>
#endif
// replay/capture_watch.hpp (CUPTI) is included on its own: it is opt-in diagnostics.
