// replay/error.hpp: the exception types and the checking macros.
//
// Every CUDA call replay makes goes through REPLAY_CHECK. A failure throws `replay::cuda_error`,
// which carries the `cudaError_t`, the name of the API that failed, the caller's source location and
// optional context. When the calling thread was capturing a stream (see capture.hpp), the message
// says so and adds a hint about the usual cause (allocation, synchronisation, legacy-stream use or a
// host read inside a capture). Misuse of replay's own types (launching an empty graph_exec, finishing
// a capture twice, ...) throws `replay::usage_error`.
//
// Example:
//   REPLAY_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, s.get()));
//   my_kernel<<<grid, block, 0, s.get()>>>(args);
//   REPLAY_CHECK_LAUNCH("my_kernel");
//   REPLAY_CHECK(cudaMalloc(&p, n), "KV cache of {} blocks", blocks);   // context is fmt-formatted
#pragma once

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <atomic>
#include <cstdint>
#include <source_location>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace replay {

/// What the calling thread's capture state was when an error happened.
enum class capture_state : std::uint8_t {
  none,         ///< no stream of replay's was capturing on this thread
  active,       ///< a capture was in progress on this thread
  invalidated,  ///< a capture was in progress and CUDA has invalidated it
};

/// The one exception type for failed CUDA calls. Thread safety: immutable after construction.
class cuda_error : public std::runtime_error {
 public:
  cuda_error(cudaError_t code, std::string api, std::string context, capture_state capture,
             std::source_location where);

  /// The CUDA error code the call returned.
  [[nodiscard]] cudaError_t code() const noexcept { return code_; }
  /// The API that failed, e.g. "cudaMalloc" or "kernel launch (my_kernel)".
  [[nodiscard]] const std::string& api() const noexcept { return api_; }
  /// Where REPLAY_CHECK was written.
  [[nodiscard]] const std::source_location& where() const noexcept { return where_; }
  /// The capture state of the calling thread when the call failed.
  [[nodiscard]] capture_state capture() const noexcept { return capture_; }
  /// True when the call failed while this thread was capturing a stream.
  [[nodiscard]] bool during_capture() const noexcept { return capture_ != capture_state::none; }

 protected:
  /// For errors of libraries that run on CUDA (NCCL): the message is already formatted; `code` is
  /// the CUDA error behind it, or cudaErrorUnknown when the library's own result has none.
  cuda_error(std::string message, cudaError_t code, std::string api, capture_state capture,
             std::source_location where)
      : std::runtime_error(std::move(message)),
        code_(code),
        api_(std::move(api)),
        capture_(capture),
        where_(where) {}

 private:
  cudaError_t code_;
  std::string api_;
  capture_state capture_;
  std::source_location where_;
};

/// Misuse of a replay type: an empty or moved-from handle, finishing a capture twice, allocating
/// from a frozen arena. Always a programming error in the caller, never a CUDA failure.
class usage_error : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

namespace detail {

/// Streams that replay is capturing on this thread (innermost last). Maintained by capture_scope so
/// that errors can say a capture was in progress.
inline std::vector<cudaStream_t>& capturing_streams() noexcept {
  thread_local std::vector<cudaStream_t> streams;
  return streams;
}

/// Diagnostics told about captures (capture_watch.hpp installs one while it is alive): when a
/// capture begins, and when a call fails inside one or it ends invalidated (the returned text is
/// added to the error message).
struct capture_observer {
  virtual void capture_begins(cudaStream_t s) noexcept = 0;
  virtual std::string capture_failed(cudaStream_t s) noexcept = 0;

 protected:
  ~capture_observer() = default;
};
/// The installed observer, or null (the default: a capture pays one atomic load).
inline std::atomic<capture_observer*>& capture_observer_slot() noexcept {
  static std::atomic<capture_observer*> slot{nullptr};
  return slot;
}

/// The capture state of this thread, asked of CUDA for the innermost capture. Never throws.
inline capture_state current_capture_state() noexcept {
  const auto& streams = capturing_streams();
  if (streams.empty()) return capture_state::none;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(streams.back(), &status) != cudaSuccess) return capture_state::active;
  return status == cudaStreamCaptureStatusInvalidated ? capture_state::invalidated : capture_state::active;
}

/// True for the error codes CUDA uses for stream-capture violations.
constexpr bool is_capture_error(cudaError_t code) noexcept {
  switch (code) {
    case cudaErrorStreamCaptureUnsupported:
    case cudaErrorStreamCaptureInvalidated:
    case cudaErrorStreamCaptureMerge:
    case cudaErrorStreamCaptureUnmatched:
    case cudaErrorStreamCaptureUnjoined:
    case cudaErrorStreamCaptureIsolation:
    case cudaErrorStreamCaptureImplicit:
    case cudaErrorCapturedEvent:
    case cudaErrorStreamCaptureWrongThread:
      return true;
    default:
      return false;
  }
}

/// The API name in a call expression: "cudaMalloc(&p, n)" -> "cudaMalloc".
constexpr std::string_view api_name(std::string_view expr) noexcept {
  const auto paren = expr.find('(');
  std::string_view name = expr.substr(0, paren);
  while (!name.empty() && (name.back() == ' ' || name.back() == '\t')) name.remove_suffix(1);
  const auto scope = name.rfind("::");
  if (scope != std::string_view::npos) name.remove_prefix(scope + 2);
  return name;
}

/// A hint for a failure inside a capture: what usually causes it and what to do instead.
inline std::string_view capture_hint(cudaError_t code, std::string_view api) noexcept {
  const auto has = [&](std::string_view s) { return api.find(s) != std::string_view::npos; };
  if (code == cudaErrorStreamCaptureImplicit)
    return "work was issued to the legacy default stream (stream 0) while a stream was capturing; "
           "launch on the capturing stream (a replay::stream) instead";
  if (code == cudaErrorStreamCaptureIsolation || code == cudaErrorStreamCaptureMerge)
    return "a stream or event from outside the capture was mixed into it; fork side streams with "
           "capture_scope::fork() and join them before finish()";
  if (code == cudaErrorStreamCaptureUnjoined)
    return "a side stream forked into the capture was not joined back; call capture_scope::join()";
  if (code == cudaErrorStreamCaptureWrongThread)
    return "the capture was ended on another thread than the one that began it";
  if (has("Malloc") || has("Free") || has("Alloc"))
    return "memory cannot be allocated or freed while capturing; allocate every buffer before "
           "capture (replay::static_arena / device_buffer) and reuse it";
  if (has("Synchronize") || has("Query"))
    return "a captured step must not synchronise or query; synchronise after graph_exec::launch() "
           "instead";
  if (has("Memcpy") && !has("Async"))
    return "synchronous copies (host reads) are not allowed while capturing; use cudaMemcpyAsync on "
           "the capturing stream and read results after the replay";
  if (code == cudaErrorStreamCaptureInvalidated)
    return "an earlier capture-unsafe call (allocation, synchronisation, legacy-stream launch or a "
           "host read) invalidated the capture; the partial graph is discarded";
  if (code == cudaErrorStreamCaptureUnsupported)
    return "this operation is not permitted while a stream is capturing (allocation, "
           "synchronisation, legacy-stream use or a host read)";
  return "errors inside a capture are usually allocation, synchronisation, legacy-stream use or a "
         "host read in the captured step";
}

/// The full message of a cuda_error. Pure function of its arguments (host-testable).
inline std::string format_cuda_error(cudaError_t code, std::string_view api, std::string_view context,
                                     capture_state capture, const std::source_location& where) {
  std::string msg = fmt::format("{} failed: {} ({}: {})", api, cudaGetErrorName(code),
                                static_cast<int>(code), cudaGetErrorString(code));
  if (!context.empty()) msg += fmt::format(" [{}]", context);
  if (capture != capture_state::none || is_capture_error(code)) {
    msg += fmt::format(" while the stream was capturing{}; hint: {}",
                       capture == capture_state::invalidated ? " (capture now invalidated)" : "",
                       capture_hint(code, api));
  }
  msg += fmt::format(" at {}:{} in {}", where.file_name(), where.line(), where.function_name());
  return msg;
}

inline std::string format_context() { return {}; }
template <class... Args>
std::string format_context(fmt::format_string<Args...> f, Args&&... args) {
  return fmt::format(f, std::forward<Args>(args)...);
}

}  // namespace detail

inline cuda_error::cuda_error(cudaError_t code, std::string api, std::string context,
                              capture_state capture, std::source_location where)
    : std::runtime_error(detail::format_cuda_error(code, api, context, capture, where)),
      code_(code),
      api_(std::move(api)),
      capture_(capture),
      where_(where) {}

namespace detail {

/// Cold path of REPLAY_CHECK: clears CUDA's last-error slot and throws.
[[noreturn]] inline void throw_cuda_error(cudaError_t code, std::string_view api, std::string context,
                                          std::source_location where) {
  (void)cudaGetLastError();  // the error is reported here; don't leave it for the next check
  const capture_state state = current_capture_state();
  if (state != capture_state::none || is_capture_error(code))
    if (capture_observer* o = capture_observer_slot().load(std::memory_order_acquire))
      if (std::string note = o->capture_failed(capturing_streams().empty() ? nullptr : capturing_streams().back());
          !note.empty() && context.find(note) == std::string::npos)
        context += (context.empty() ? "" : "; ") + note;
  throw cuda_error(code, std::string(api), std::move(context), state, where);
}

/// Destructor-safe check: logs nothing, never throws; returns whether the call succeeded.
inline bool check_noexcept(cudaError_t code) noexcept {
  if (code == cudaSuccess) return true;
  (void)cudaGetLastError();
  return false;
}

}  // namespace detail
}  // namespace replay

/// Evaluates a CUDA runtime call; on failure throws replay::cuda_error naming the API, the caller's
/// location and an optional fmt-formatted context (built only on failure).
#define REPLAY_CHECK(expr, ...)                                                                  \
  do {                                                                                           \
    const cudaError_t replay_check_err_ = (expr);                                               \
    if (replay_check_err_ != cudaSuccess) [[unlikely]]                                           \
      ::replay::detail::throw_cuda_error(replay_check_err_, ::replay::detail::api_name(#expr),  \
                                         ::replay::detail::format_context(__VA_ARGS__),          \
                                         std::source_location::current());                      \
  } while (false)

/// Checks the launch just made (cudaGetLastError); `name` names the kernel in the message.
#define REPLAY_CHECK_LAUNCH(name)                                                                \
  do {                                                                                           \
    const cudaError_t replay_check_err_ = cudaGetLastError();                                   \
    if (replay_check_err_ != cudaSuccess) [[unlikely]]                                           \
      ::replay::detail::throw_cuda_error(replay_check_err_,                                     \
                                         std::string("kernel launch (") + (name) + ")", {},      \
                                         std::source_location::current());                      \
  } while (false)
