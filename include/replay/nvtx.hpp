// replay/nvtx.hpp: NVTX ranges around what replay does (capture, instantiate, upload, replay, eager
// fallback, eviction), so that Nsight Systems shows them on the timeline next to the kernels.
//
// Header-only NVTX3 from the CUDA Toolkit (<nvtx3/nvToolsExt.h>): nothing to link. Ranges are pushed
// in the "replay" NVTX domain; their names carry the graph key, e.g. "capture bucket 8". Without a
// profiler attached a range costs a call through a null hook. Build with `-DREPLAY_NVTX=0` (or
// `-DREPLAY_DISABLE_NVTX`) to compile every range out: the types stay, and do nothing.
//
// `nvtx_range` is an RAII scope: the range opens in the constructor and closes in the destructor
// (on the same thread, as NVTX requires for push/pop ranges). The name is copied by NVTX when the
// range opens, so it may be a temporary. For a range opened on every step, build the name once
// (an `nvtx_label`, as the graph pool keeps one per key) and pass it: no formatting per step.
//
// Where replay opens ranges: "capture <key>" and "instantiate <key>" (cuda_graph_backend.hpp: the
// capture of a pool miss, its instantiation with upload), "replay <key>" (graph_pool.hpp: every
// cudaGraphLaunch of a pool hit or miss), "evict <key>" (graph_pool.hpp), "eager fallback <key>",
// "eager oversize <key>" and "eager disabled <key>" (runner.hpp: a step run without its graph),
// "warmup <key>" (graph_pool.hpp: eager runs before a capture), and "upload" / "update"
// (graph_exec.hpp, which knows no key).
//
// Guarantees: never throws (a failure to format the name gives a shorter name); not copyable or
// movable (it is a scope). Thread-safe as NVTX is.
//
// Example:
//   {
//     replay::nvtx_range r("capture", key);     // "capture bucket 8" in Nsight Systems
//     g = replay::capture(s, step);
//   }
//   // nsys profile --trace=cuda,nvtx ./decoder     (see docs/guide.md)
#pragma once

#if defined(REPLAY_DISABLE_NVTX) && !defined(REPLAY_NVTX)
#define REPLAY_NVTX 0
#endif
#ifndef REPLAY_NVTX
#if __has_include(<nvtx3/nvToolsExt.h>)
#define REPLAY_NVTX 1
#else
#define REPLAY_NVTX 0
#endif
#endif

#if REPLAY_NVTX
#include <nvtx3/nvToolsExt.h>
#endif

#include <fmt/format.h>

#include <string>
#include <string_view>

namespace replay {

/// The name of a range about `key`: "<what> <key>" (the key printed with fmt), or just `what` when
/// the key cannot be printed. Never throws.
template <class Key>
[[nodiscard]] std::string nvtx_name(std::string_view what, const Key& key) noexcept {
  try {
    if constexpr (fmt::is_formattable<Key>::value)
      return fmt::format("{} {}", what, key);
    else
      return std::string(what);
  } catch (...) {
    return {};
  }
}

#if REPLAY_NVTX

namespace detail {
/// replay's NVTX domain, created on first use.
inline nvtxDomainHandle_t nvtx_domain() noexcept {
  static const nvtxDomainHandle_t d = nvtxDomainCreateA("replay");
  return d;
}
inline void nvtx_push(const char* name) noexcept {
  nvtxEventAttributes_t a{};
  a.version = NVTX_VERSION;
  a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  a.messageType = NVTX_MESSAGE_TYPE_ASCII;
  a.message.ascii = name;
  (void)nvtxDomainRangePushEx(nvtx_domain(), &a);
}
inline void nvtx_pop() noexcept { (void)nvtxDomainRangePop(nvtx_domain()); }
}  // namespace detail

/// A range name built once and kept (e.g. per graph key) so that a range opened every step does
/// no formatting. Empty when NVTX is compiled out; its layout is the same either way.
struct nvtx_label {
  std::string name;
  template <class Key>
  void set(std::string_view what, const Key& key) noexcept {
    name = nvtx_name(what, key);
  }
};

/// An NVTX push/pop range in the "replay" domain, open for the object's lifetime.
class nvtx_range {
 public:
  /// A range named by a kept label (no formatting).
  explicit nvtx_range(const nvtx_label& label) noexcept { detail::nvtx_push(label.name.c_str()); }
  /// A range named `name` (copied by NVTX now).
  explicit nvtx_range(const char* name) noexcept { detail::nvtx_push(name); }
  explicit nvtx_range(const std::string& name) noexcept { detail::nvtx_push(name.c_str()); }
  /// A range named "<what> <key>" (formats the key: use for rare events, or cache nvtx_name()).
  template <class Key>
  nvtx_range(std::string_view what, const Key& key) noexcept {
    const std::string name = nvtx_name(what, key);
    detail::nvtx_push(name.c_str());
  }
  nvtx_range(const nvtx_range&) = delete;
  nvtx_range& operator=(const nvtx_range&) = delete;
  ~nvtx_range() { detail::nvtx_pop(); }
};

#else

/// NVTX compiled out (REPLAY_NVTX=0): the same layout as with NVTX (a pool slot holds one, and
/// translation units built with and without NVTX share the pool's code), never filled.
struct nvtx_label {
  std::string name;
  template <class Key>
  void set(std::string_view, const Key&) noexcept {}
};

/// NVTX compiled out (REPLAY_NVTX=0): does nothing.
class nvtx_range {
 public:
  explicit nvtx_range(const nvtx_label&) noexcept {}
  explicit nvtx_range(const char*) noexcept {}
  explicit nvtx_range(const std::string&) noexcept {}
  template <class Key>
  nvtx_range(std::string_view, const Key&) noexcept {}
  nvtx_range(const nvtx_range&) = delete;
  nvtx_range& operator=(const nvtx_range&) = delete;
};

#endif

}  // namespace replay
