// replay/capture_watch.hpp: name the call that broke a capture, even when it was made inside a
// library (cuBLAS, NCCL, ...) and never went through REPLAY_CHECK.
//
// A capture is invalidated by the first capture-unsafe CUDA call made while it runs (an
// allocation, a synchronisation, a synchronous copy, ...). When that call is made by a library, its
// error is often swallowed or turned into the library's own status, and cudaStreamEndCapture only
// says "invalidated". While a `capture_watch` is alive, CUPTI's callback API reports the return
// value of every CUDA runtime and driver call; on each thread the first call that fails while one
// of replay's captures (capture_scope) is active on that thread is recorded: its API name, error,
// the runtime call around a failing driver call, and the module (shared object or executable)
// that made the call, with the nearest exported symbol. capture_scope::finish() then adds it to
// the cuda_error it throws (as does any REPLAY_CHECK that fails inside the capture), and
// `first_failure()` returns it.
//
// Opt-in and free when off: nothing is loaded until a capture_watch is constructed; libcupti is
// loaded then with dlopen (no link dependency). The CMake target `replay::cupti` (an INTERFACE
// target that links nothing) passes the toolkit's libcupti path as REPLAY_CUPTI_LIBRARY; without it
// the usual names and toolkit locations are tried. While a watch is alive every CUDA call pays for
// a callback: use it to diagnose a capture, not in production decode.
//
// Guarantees: constructing a watch never throws for a missing CUPTI: `available()` is false and
// `unavailable_reason()` says why (CUPTI not found, another CUPTI client such as a profiler already
// subscribed, headers missing at build time). At most one watch is active per process (CUPTI allows
// one subscriber); a second one is unavailable. Not copyable or movable. The destructor
// unsubscribes and never throws. Failures are recorded per thread; `first_failure()` reads the
// calling thread's.
//
// Example:
//   replay::capture_watch watch;                     // before the capture
//   try {
//     replay::graph g = replay::capture(s, [&](replay::stream_ref cs) { gemm_with_cublas(cs); });
//   } catch (const replay::cuda_error& e) {
//     fmt::print(stderr, "{}\n", e.what());   // "... first failed call while capturing:
//   }                                         //  cudaStreamSynchronize (...) returned ...,
//                                             //  called from libcublas.so.13 (+0x...)"
#pragma once

#include <replay/capture.hpp>
#include <replay/error.hpp>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

// REPLAY_HAS_CUPTI: 1 where CUPTI's header and dlopen exist (define it to 0 to leave CUPTI out).
// capture_watch has the same layout either way, so translation units may differ in it.
#if !defined(REPLAY_HAS_CUPTI) && defined(__linux__) && __has_include(<cupti.h>) && __has_include(<dlfcn.h>) && \
    __has_include(<execinfo.h>)
#define REPLAY_HAS_CUPTI 1
#endif
#if REPLAY_HAS_CUPTI
#include <cupti.h>
#include <dlfcn.h>
#include <execinfo.h>
#if defined(__GNUC__) || defined(__clang__)
#include <cxxabi.h>
#endif
#else
#undef REPLAY_HAS_CUPTI
#define REPLAY_HAS_CUPTI 0
#endif

namespace replay {

/// A CUDA call that failed while a capture was active on the calling thread.
struct failed_call {
  std::string api;          ///< e.g. "cudaStreamSynchronize" or "cuMemAlloc_v2"
  bool driver = false;      ///< a driver API call (cu*) rather than a runtime one (cuda*)
  int code = 0;             ///< its return value (cudaError_t or CUresult)
  std::string outer_api;    ///< for a failing driver call: the runtime call that made it, if any
  std::string module;       ///< the shared object or executable that made the call
  std::string symbol;       ///< the nearest exported symbol there (may be empty), demangled
  std::uintptr_t offset = 0;  ///< offset of the call site from that symbol (or from the module base)

  /// One line, e.g. "cudaStreamSynchronize (driver call cuStreamSynchronize) returned CUresult 900
  /// (cudaErrorStreamCaptureUnsupported), called from libcublas.so.13 (+0x8f1a2c)".
  [[nodiscard]] std::string describe() const {
    // Driver and runtime share the numbering of the capture errors (900-908), so one name serves.
    const char* name = cudaGetErrorName(static_cast<cudaError_t>(code));
    std::string s = driver && !outer_api.empty() ? fmt::format("{} (driver call {})", outer_api, api) : api;
    s += fmt::format(" returned {}", driver ? fmt::format("CUresult {} ({})", code, name) : std::string(name));
    if (!module.empty()) {
      s += fmt::format(", called from {}", module);
      if (!symbol.empty()) s += fmt::format(" ({}+{:#x})", symbol, offset);
      else s += fmt::format(" (+{:#x})", offset);
    }
    return s;
  }
};

/// Watches CUDA calls through CUPTI while alive; see the header comment.
class capture_watch;

namespace detail {

/// The CUPTI state of a capture_watch (defined where CUPTI is available).
struct cupti_session;

/// The module name of a path: "/usr/lib/x86_64-linux-gnu/libcublas.so.13" -> "libcublas.so.13".
constexpr std::string_view module_basename(std::string_view path) noexcept {
  const auto slash = path.rfind('/');
  return slash == std::string_view::npos ? path : path.substr(slash + 1);
}

/// True for modules that sit between a caller and the failing call: CUPTI, the driver, the runtime.
constexpr bool is_cuda_stack_module(std::string_view path) noexcept {
  const std::string_view b = module_basename(path);
  return b.starts_with("libcupti") || b.starts_with("libcuda.") || b.starts_with("libcudart") ||
         b.starts_with("libnvidia-");
}

/// Calls whose failure says nothing about the capture: error queries, capability probes, polling.
constexpr bool ignored_failure(std::string_view api, int code) noexcept {
  if (code == 600) return true;  // cudaErrorNotReady / CUDA_ERROR_NOT_READY: polling
  for (std::string_view name : {"GetLastError", "PeekAtLastError", "GetProcAddress", "GetExportTable",
                                "DriverEntryPoint", "StreamIsCapturing", "StreamGetCaptureInfo",
                                "FuncGetParamInfo", "PointerGetAttributes"})
    if (api.find(name) != std::string_view::npos) return true;
  return false;
}

/// Per-thread record of the first failure in the current capture.
struct watch_thread_state {
  std::optional<failed_call> first;
};
inline watch_thread_state& watch_state() noexcept {
  thread_local watch_thread_state s;
  return s;
}

#if REPLAY_HAS_CUPTI

/// Fills module / symbol / offset of `f` from the calling thread's stack: the first frame after the
/// CUPTI / driver / runtime frames that the callback was called through.
inline void locate_caller(failed_call& f) noexcept {
  void* frames[48];
  const int n = ::backtrace(frames, 48);
  bool in_cuda = false;
  for (int i = 1; i < n; ++i) {
    Dl_info info{};
    if (::dladdr(frames[i], &info) == 0 || info.dli_fname == nullptr) continue;
    const bool cuda = is_cuda_stack_module(info.dli_fname);
    if (cuda) {
      in_cuda = true;
      continue;
    }
    if (!in_cuda) continue;  // our own callback's frames
    try {
      f.module = std::string(module_basename(info.dli_fname));
      if (info.dli_sname != nullptr) {
        f.symbol = info.dli_sname;
#if defined(__GNUC__) || defined(__clang__)
        int status = 0;
        std::unique_ptr<char, decltype(&std::free)> d(abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status),
                                                      &std::free);
        if (status == 0 && d) f.symbol = d.get();
#endif
        f.offset = reinterpret_cast<std::uintptr_t>(frames[i]) - reinterpret_cast<std::uintptr_t>(info.dli_saddr);
      }
      // dladdr names the nearest *exported* symbol: far from it, the call site is in an internal
      // function, so give the offset in the module instead of a misleading name.
      if (f.symbol.empty() || f.offset > 0x10000) {
        f.symbol.clear();
        f.offset = reinterpret_cast<std::uintptr_t>(frames[i]) - reinterpret_cast<std::uintptr_t>(info.dli_fbase);
      }
    } catch (...) {
    }
    return;
  }
}

inline void CUPTIAPI watch_callback(void*, CUpti_CallbackDomain domain, CUpti_CallbackId, const void* data) {
  if (domain != CUPTI_CB_DOMAIN_RUNTIME_API && domain != CUPTI_CB_DOMAIN_DRIVER_API) return;
  const auto* cb = static_cast<const CUpti_CallbackData*>(data);
  if (cb->callbackSite != CUPTI_API_EXIT || cb->functionReturnValue == nullptr) return;
  const int code = domain == CUPTI_CB_DOMAIN_RUNTIME_API ? static_cast<int>(*static_cast<cudaError_t*>(cb->functionReturnValue))
                                                         : static_cast<int>(*static_cast<CUresult*>(cb->functionReturnValue));
  if (code == 0) return;
  if (capturing_streams().empty()) return;  // only while one of replay's captures runs on this thread
  const std::string_view api = cb->functionName != nullptr ? cb->functionName : "<unknown>";
  if (ignored_failure(api, code)) return;
  watch_thread_state& st = watch_state();
  try {
    if (st.first) {
      // A runtime call returning the failure of the driver call it made: name it as the outer call.
      if (domain == CUPTI_CB_DOMAIN_RUNTIME_API && st.first->driver && st.first->outer_api.empty())
        st.first->outer_api = std::string(api);
      return;
    }
    failed_call f;
    f.api = std::string(api);
    f.driver = domain == CUPTI_CB_DOMAIN_DRIVER_API;
    f.code = code;
    locate_caller(f);
    st.first = std::move(f);
  } catch (...) {
  }
}

/// The libcupti entry points a watch uses.
struct cupti_api {
  void* handle = nullptr;
  CUptiResult (*subscribe)(CUpti_SubscriberHandle*, CUpti_CallbackFunc, void*) = nullptr;
  CUptiResult (*unsubscribe)(CUpti_SubscriberHandle) = nullptr;
  CUptiResult (*enable_domain)(uint32_t, CUpti_SubscriberHandle, CUpti_CallbackDomain) = nullptr;
  CUptiResult (*result_string)(CUptiResult, const char**) = nullptr;

  /// Loads libcupti; returns an empty string or why it failed.
  std::string load() {
    std::vector<std::string> names;
#ifdef REPLAY_CUPTI_LIBRARY
    names.emplace_back(REPLAY_CUPTI_LIBRARY);
#endif
    for (const char* n : {"libcupti.so", "libcupti.so.13", "libcupti.so.12", "/usr/local/cuda/lib64/libcupti.so",
                          "/usr/local/cuda/lib/libcupti.so", "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so"})
      names.emplace_back(n);
    std::string tried;
    for (const std::string& n : names) {
      handle = ::dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle != nullptr) break;
      tried += (tried.empty() ? "" : ", ") + n;
    }
    if (handle == nullptr) return fmt::format("libcupti not found (tried {})", tried);
    subscribe = reinterpret_cast<decltype(subscribe)>(::dlsym(handle, "cuptiSubscribe"));
    unsubscribe = reinterpret_cast<decltype(unsubscribe)>(::dlsym(handle, "cuptiUnsubscribe"));
    enable_domain = reinterpret_cast<decltype(enable_domain)>(::dlsym(handle, "cuptiEnableDomain"));
    result_string = reinterpret_cast<decltype(result_string)>(::dlsym(handle, "cuptiGetResultString"));
    if (subscribe == nullptr || unsubscribe == nullptr || enable_domain == nullptr)
      return "libcupti lacks the callback API (cuptiSubscribe / cuptiEnableDomain)";
    return {};
  }
  std::string error(CUptiResult r) const {
    const char* s = nullptr;
    if (result_string != nullptr && result_string(r, &s) == CUPTI_SUCCESS && s != nullptr) return s;
    return fmt::format("CUptiResult {}", static_cast<int>(r));
  }
};

struct cupti_session {
  cupti_api api;
  CUpti_SubscriberHandle subscriber = nullptr;
};

#endif  // REPLAY_HAS_CUPTI

/// The capture_observer a watch installs (capture.hpp): resets the thread's record when a capture
/// begins and names the recorded call when a capture fails.
struct watch_observer final : capture_observer {
  void capture_begins(cudaStream_t) noexcept override { watch_state().first.reset(); }
  std::string capture_failed(cudaStream_t) noexcept override {
    try {
      const auto& f = watch_state().first;
      return f ? "first failed call while capturing: " + f->describe()
               : std::string("capture_watch saw no failed CUDA call on this thread during the capture");
    } catch (...) {
      return {};
    }
  }
};

inline std::atomic<bool>& watch_claimed() noexcept {
  static std::atomic<bool> claimed{false};
  return claimed;
}

}  // namespace detail

class capture_watch {
 public:
  capture_watch() noexcept {
#if REPLAY_HAS_CUPTI
    if (detail::watch_claimed().exchange(true)) {
      reason_ = "another replay::capture_watch is active in this process (CUPTI allows one subscriber)";
      return;
    }
    claimed_ = true;
    try {
      session_ = new detail::cupti_session;
      detail::cupti_api& api = session_->api;
      reason_ = api.load();
      if (!reason_.empty()) {
        release();
        return;
      }
      if (const CUptiResult r = api.subscribe(&session_->subscriber, &detail::watch_callback, nullptr);
          r != CUPTI_SUCCESS) {
        reason_ = fmt::format("cuptiSubscribe failed: {} (a profiler or another CUPTI client may be attached)",
                              api.error(r));
        session_->subscriber = nullptr;
        release();
        return;
      }
      for (CUpti_CallbackDomain d : {CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_CB_DOMAIN_DRIVER_API}) {
        if (const CUptiResult r = api.enable_domain(1, session_->subscriber, d); r != CUPTI_SUCCESS) {
          reason_ = fmt::format("cuptiEnableDomain failed: {}", api.error(r));
          release();
          return;
        }
      }
      detail::capture_observer_slot().store(&observer_);
      active_ = true;
    } catch (...) {
      reason_ = "out of memory while loading CUPTI";
      release();
    }
#else
    reason_ = "replay was built without CUPTI headers (cupti.h) or on a platform without dlopen";
#endif
  }
  capture_watch(const capture_watch&) = delete;
  capture_watch& operator=(const capture_watch&) = delete;
  ~capture_watch() { release(); }

  /// True when CUPTI is loaded and calls are being watched.
  [[nodiscard]] bool available() const noexcept { return active_; }
  /// Why the watch is not available (empty when it is).
  [[nodiscard]] const std::string& unavailable_reason() const noexcept { return reason_; }

  /// The first failed call of the calling thread's most recent capture, if any.
  [[nodiscard]] std::optional<failed_call> first_failure() const { return detail::watch_state().first; }
  /// Forgets the calling thread's record (a new capture does this too).
  void reset() noexcept { detail::watch_state().first.reset(); }

 private:
  void release() noexcept {
    active_ = false;
#if REPLAY_HAS_CUPTI
    detail::capture_observer* mine = &observer_;
    (void)detail::capture_observer_slot().compare_exchange_strong(mine, nullptr);
    if (session_ != nullptr && session_->subscriber != nullptr) (void)session_->api.unsubscribe(session_->subscriber);
    // libcupti stays loaded: CUPTI does not support being unloaded from a process it attached to.
    delete session_;
    session_ = nullptr;
    if (claimed_) {
      detail::watch_claimed().store(false);
      claimed_ = false;
    }
#endif
  }

  // The same members whether or not CUPTI is available (translation units built either way share
  // this class): the CUPTI state sits behind a pointer.
  bool active_ = false;
  bool claimed_ = false;
  std::string reason_;
  detail::cupti_session* session_ = nullptr;  // CUPTI builds: the loaded API and the subscriber
  detail::watch_observer observer_;
};

}  // namespace replay
