// replay/conditional.hpp: conditional graph nodes (WHILE and IF) whose bodies are captured from
// callables, and the condition that device code sets.
//
// A conditional node runs a body graph depending on a condition value that kernels set on the
// device (`condition::set`), so a graph can loop or branch without the host. `while_loop(s, body)`
// appends a WHILE node to the capture in progress on `s` and captures `body` into the node's body
// graph: the body runs again and again while the condition is non-zero, and the condition is
// checked before the first run too. `if_then(s, c, body)` appends an IF node whose body runs once
// when `c` is non-zero; `c` comes from `make_condition(s)` and is set by a kernel captured before
// the node.
//
// Defaults, per node type (each assigned at the start of every launch, cudaGraphCondAssignDefault):
// - the condition while_loop(s, body) makes for itself starts at 1: the body runs at least once;
// - a condition from make_condition() starts at 0, as CUDA's own default: an IF body (or a WHILE on
//   it) runs only when a kernel set the condition during this launch.
// With `assign_default = false` CUDA leaves the value at the start of a launch undefined: a kernel
// of the same launch must set it before the node reads it.
//
// Everything that decides how often a body runs is data on the device (a trip count, a stop
// token), never a captured value, so one graph serves any count and a pool key need not contain
// it. Kernels in a body are captured as on any stream, PDL launches (replay::launch with .pdl)
// included; the first kernel of each run of the body starts after the previous run has completed.
// A WHILE body that captured no work is refused (usage_error): with its condition at 1 it would
// spin forever; the usual cause is launching on the outer stream instead of the body's stream.
//
// On a stream that is not capturing, while_loop() builds the node in a graph of its own,
// instantiates it and launches it on `s`: correct, but it pays an instantiation per call. That is
// what step_runner's eager paths (fallback, kill switch) get; capture to get speed. During a pool's
// warm-up (replay::warming_up()) it does nothing: a loop's work is not repeatable. if_then() and
// make_condition() need a capture (their condition belongs to the captured graph).
//
// The bodies of every node made here are recorded with the graph capture_scope returns, so
// inspect() and the audit look inside them on any CUDA version.
//
// Guarantees: `condition` is a trivially copyable handle, passed to kernels by value; it is valid
// in the graph it was made for (and in its execs) only, and drives one conditional node (CUDA
// refuses a second node on the same condition: make one condition per node; a condition that
// drives no node makes instantiation fail, and replay names it). Bodies are captured on a stream
// of their own (created and destroyed by the call), in capture_mode::thread_local_mode unless told
// otherwise. An exception from a body ends the body capture and propagates; the enclosing
// capture_scope then discards the whole graph. Errors: usage_error for a stream that is not
// capturing where a capture is needed, a null condition, an empty WHILE body, or a condition set
// on the host; a null condition set from a kernel traps in builds without NDEBUG; cuda_error
// naming the CUDA call otherwise. Needs CUDA 12.4+ (if_then_else: 12.8+).
//
// Example (a device-side loop that runs until a kernel clears the condition):
//   __global__ void step(int* counter, const int* limit, replay::condition c) {
//     if (++*counter >= *limit) c.set(false);             // stop after *limit runs
//   }
//   replay::graph g = replay::capture(s, [&](replay::stream_ref cs) {
//     replay::while_loop(cs, [&](replay::stream_ref body, replay::condition c) {
//       replay::launch(step, {.stream = body}, counter, limit, c);
//     });
//   });
#pragma once

#include <replay/capture.hpp>
#include <replay/error.hpp>
#include <replay/graph.hpp>
#include <replay/graph_exec.hpp>
#include <replay/stream.hpp>

#include <cuda_runtime_api.h>
#if defined(__CUDACC__)
#include <cuda_device_runtime_api.h>
#endif

#include <cassert>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#if !defined(CUDART_VERSION) || CUDART_VERSION < 12040
#error "replay/conditional.hpp needs the CUDA 12.4 runtime or newer (conditional graph nodes)"
#endif

namespace replay {

/// The condition of a conditional node: a handle into the graph the node belongs to. Trivially
/// copyable, with no padding bytes (a captured kernel's parameters are fully determined, so
/// replay::audit_step can compare them byte for byte); pass it to kernels by value.
/// Default-constructed: null (setting it is a usage error on the host; on the device it traps in
/// builds without NDEBUG and does nothing otherwise).
class condition {
 public:
  constexpr condition() noexcept = default;
  constexpr explicit condition(cudaGraphConditionalHandle h) noexcept : h_(h), valid_(1) {}

  [[nodiscard]] constexpr cudaGraphConditionalHandle handle() const noexcept { return h_; }
  [[nodiscard]] constexpr explicit operator bool() const noexcept { return valid_ != 0; }

#if defined(__CUDACC__)
  /// Sets the condition from device code: a WHILE body runs again when it is true when the body
  /// ends, an IF body runs when it is true when the node starts. Call it from one thread (racing
  /// calls are undefined), in a kernel of the graph the condition belongs to.
  __device__ void set(bool value) const { set_value(value ? 1u : 0u); }
  __device__ void set_value(unsigned value) const {
#if defined(__CUDA_ARCH__)
    assert(valid_ != 0 && "replay::condition::set on a null condition (made outside the graph's capture?)");
    if (valid_ != 0) cudaGraphSetConditional(h_, value);
#else
    (void)value;
#endif
  }
#endif

 private:
  cudaGraphConditionalHandle h_ = 0;
  std::uint32_t valid_ = 0;
  std::uint32_t reserved_ = 0;  // explicit: no padding bytes
};
static_assert(std::has_unique_object_representations_v<condition>, "condition has padding bytes");

/// How a condition starts each launch. The defaults are make_condition()'s: 0 at every launch, so
/// an IF body runs only when a kernel of this launch set the condition. while_loop(s, body) uses
/// `while_defaults()` (1: the body runs at least once) unless told otherwise.
struct condition_options {
  /// The value the condition gets at the start of every launch of the graph (with
  /// assign_default). A WHILE loop with 1 runs its body at least once; with 0, only when a kernel
  /// before the node set the condition.
  unsigned default_value = 0;
  /// Assign default_value at every launch (cudaGraphCondAssignDefault). Off: CUDA leaves the value
  /// undefined at the start of each launch (it does not persist from the previous one), so a kernel
  /// of the same launch must set it before the node reads it.
  bool assign_default = true;

  /// The defaults of the condition while_loop(s, body) makes for itself: 1 at every launch.
  [[nodiscard]] static constexpr condition_options while_defaults() noexcept { return {1, true}; }
};

/// How a conditional node's bodies are captured.
struct body_options {
  /// Capture mode of the body captures (see capture.hpp).
  capture_mode mode = capture_mode::thread_local_mode;
};

namespace detail {

/// The graph a capture on `s` is adding to and the nodes the next node will depend on.
struct capture_point {
  cudaGraph_t graph = nullptr;
  std::vector<cudaGraphNode_t> dependencies;
};

inline cudaStreamCaptureStatus capture_status_of(cudaStream_t s) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  REPLAY_CHECK(cudaStreamIsCapturing(s, &status));
  return status;
}

inline capture_point capture_point_of(stream_ref s, const char* what) {
  if (s.get() == nullptr)
    throw usage_error(fmt::format("replay::{}: the legacy default stream (0) cannot be captured; use a "
                                  "replay::stream",
                                  what));
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaGraph_t g = nullptr;
  const cudaGraphNode_t* deps = nullptr;
  std::size_t n = 0;
#if CUDART_VERSION >= 13000
  REPLAY_CHECK(cudaStreamGetCaptureInfo(s.get(), &status, nullptr, &g, &deps, nullptr, &n), "{}", what);
#else
  REPLAY_CHECK(cudaStreamGetCaptureInfo(s.get(), &status, nullptr, &g, &deps, &n), "{}", what);
#endif
  if (status == cudaStreamCaptureStatusNone)
    throw usage_error(fmt::format("replay::{}: stream {} is not capturing; call it inside replay::capture "
                                  "or a capture_scope",
                                  what, static_cast<const void*>(s.get())));
  if (status != cudaStreamCaptureStatusActive)
    throw usage_error(fmt::format("replay::{}: the capture on stream {} was invalidated by an earlier "
                                  "failed call",
                                  what, static_cast<const void*>(s.get())));
  capture_point p;
  p.graph = g;
  p.dependencies.assign(deps, deps + n);
  return p;
}

inline condition create_condition(cudaGraph_t g, const condition_options& o, const char* what) {
  cudaGraphConditionalHandle h = 0;
  REPLAY_CHECK(cudaGraphConditionalHandleCreate(&h, g, o.default_value,
                                                o.assign_default ? static_cast<unsigned>(cudaGraphCondAssignDefault) : 0u),
               "{}: default value {}", what, o.default_value);
  record_condition(h);
  return condition(h);
}

/// Appends a conditional node after everything captured on `s` so far and makes it the point the
/// next capture on `s` depends on. Returns the node's body graphs (owned by the node).
inline std::vector<cudaGraph_t> add_conditional(stream_ref s, capture_point& at, condition c,
                                                cudaGraphConditionalNodeType type, unsigned bodies,
                                                const char* what) {
  if (!c) throw usage_error(fmt::format("replay::{}: the condition is null", what));
  cudaGraphNodeParams params{};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = c.handle();
  params.conditional.type = type;
  params.conditional.size = bodies;
  cudaGraphNode_t node = nullptr;
  const cudaGraphNode_t* deps = at.dependencies.empty() ? nullptr : at.dependencies.data();
#if CUDART_VERSION >= 13000
  REPLAY_CHECK(cudaGraphAddNode(&node, at.graph, deps, nullptr, at.dependencies.size(), &params),
               "{}: adding the conditional node (a condition drives one node only)", what);
  REPLAY_CHECK(cudaStreamUpdateCaptureDependencies(s.get(), &node, nullptr, 1, cudaStreamSetCaptureDependencies),
               "{}", what);
#else
  REPLAY_CHECK(cudaGraphAddNode(&node, at.graph, deps, at.dependencies.size(), &params),
               "{}: adding the conditional node (a condition drives one node only)", what);
  REPLAY_CHECK(cudaStreamUpdateCaptureDependencies(s.get(), &node, 1, cudaStreamSetCaptureDependencies), "{}",
               what);
#endif
  std::vector<cudaGraph_t> out(params.conditional.phGraph_out, params.conditional.phGraph_out + bodies);
  record_conditional_node(node, c.handle(), out);
  return out;
}

/// Captures `fn(stream_ref)` into `body` (a conditional node's body graph) on a stream of its own.
/// The stream a body is captured on, made and destroyed while this thread may be capturing: the
/// thread's capture mode is relaxed around both calls (they are not stream work), as CUDA documents
/// for such calls.
class body_stream {
 public:
  body_stream() {
    relaxed r;
    REPLAY_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking),
                 "the stream a conditional body is captured on");
  }
  body_stream(const body_stream&) = delete;
  body_stream& operator=(const body_stream&) = delete;
  ~body_stream() {
    relaxed r;
    (void)check_noexcept(cudaStreamDestroy(s_));
  }
  [[nodiscard]] cudaStream_t get() const noexcept { return s_; }

 private:
  struct relaxed {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    relaxed() noexcept { (void)check_noexcept(cudaThreadExchangeStreamCaptureMode(&mode)); }
    ~relaxed() { (void)check_noexcept(cudaThreadExchangeStreamCaptureMode(&mode)); }
  };
  cudaStream_t s_ = nullptr;
};

/// Captures `fn(stream_ref)` into `body`. `must_work`: an empty body is refused (a WHILE body).
template <class Fn>
void capture_body(cudaGraph_t body, const body_options& o, const char* what, Fn&& fn, bool must_work = false) {
  body_stream bs;
  REPLAY_CHECK(cudaStreamBeginCaptureToGraph(bs.get(), body, nullptr, nullptr, 0,
                                             static_cast<cudaStreamCaptureMode>(o.mode)),
               "{}: capturing the body", what);
  auto& capturing = capturing_streams();
  capturing.push_back(bs.get());
  struct end_guard {
    cudaStream_t s;
    bool done = false;
    ~end_guard() {
      if (done) return;
      auto& v = capturing_streams();
      if (!v.empty() && v.back() == s) v.pop_back();
      cudaGraph_t g = nullptr;
      (void)cudaStreamEndCapture(s, &g);  // the body graph belongs to the node: not destroyed here
      (void)cudaGetLastError();
    }
  } guard{bs.get()};
  std::forward<Fn>(fn)(stream_ref(bs.get()));
  guard.done = true;
  if (!capturing.empty() && capturing.back() == bs.get()) capturing.pop_back();
  cudaGraph_t g = nullptr;
  REPLAY_CHECK(cudaStreamEndCapture(bs.get(), &g), "{}: ending the body capture", what);
  if (must_work) {
    std::size_t n = 0;
    REPLAY_CHECK(cudaGraphGetNodes(body, nullptr, &n), "{}: counting the body's nodes", what);
    if (n == 0)
      throw usage_error(fmt::format("replay::{}: the WHILE body captured no work, so the loop would never "
                                    "end; launch the body's kernels on the stream the body callable "
                                    "receives, not on the outer stream",
                                    what));
  }
}

}  // namespace detail

/// Creates a condition in the graph being captured on `s`, for one IF (or WHILE) node captured
/// later on `s` and set by a kernel captured before it. By default it is 0 at the start of every
/// launch (see condition_options). Throws usage_error when `s` is not capturing.
[[nodiscard]] inline condition make_condition(stream_ref s, const condition_options& options = {}) {
  const detail::capture_point at = detail::capture_point_of(s, "make_condition");
  return detail::create_condition(at.graph, options, "make_condition");
}

/// Appends a WHILE node on `c` (from make_condition on the same capture) to the capture on `s`
/// and captures `body(stream_ref)` into it. The body runs while `c` is non-zero. Throws
/// usage_error when `s` is not capturing or `c` is null.
template <class Body>
  requires std::is_invocable_v<Body&, stream_ref>
void while_loop(stream_ref s, condition c, Body&& body, const body_options& options = {}) {
  detail::capture_point at = detail::capture_point_of(s, "while_loop");
  const auto bodies = detail::add_conditional(s, at, c, cudaGraphCondTypeWhile, 1, "while_loop");
  detail::capture_body(bodies[0], options, "while_loop", body, true);
}

/// Appends a WHILE node to the capture on `s` with a new condition (`cond`, by default 1 at every
/// launch: the body runs at least once) and captures `body(stream_ref body_stream, condition c)`
/// into it; a kernel of the body clears `c` to stop. On a stream that is not capturing, the node is
/// built in a graph of its own that is instantiated and launched on `s`, except during a warm-up,
/// when nothing runs (see the file comment).
template <class Body>
  requires std::is_invocable_v<Body&, stream_ref, condition>
void while_loop(stream_ref s, Body&& body, const condition_options& cond = condition_options::while_defaults(),
                const body_options& options = {}) {
  if (s.get() != nullptr && detail::capture_status_of(s.get()) == cudaStreamCaptureStatusNone) {
    if (warming_up()) return;
    // Eager: the same node in a one-off graph. The exec may be destroyed while it runs (CUDA frees
    // it when the launch completes).
    graph g = capture(s, [&](stream_ref cs) { while_loop(cs, body, cond, options); }, options.mode);
    graph_exec e = g.instantiate();
    e.launch(s);
    return;
  }
  detail::capture_point at = detail::capture_point_of(s, "while_loop");
  const condition c = detail::create_condition(at.graph, cond, "while_loop");
  const auto bodies = detail::add_conditional(s, at, c, cudaGraphCondTypeWhile, 1, "while_loop");
  detail::capture_body(bodies[0], options, "while_loop", [&](stream_ref bs) { body(bs, c); }, true);
}

/// Appends an IF node on `c` to the capture on `s` and captures `then_body(stream_ref)` into it:
/// it runs once when `c` is non-zero when the node starts. Throws usage_error when `s` is not
/// capturing or `c` is null.
template <class Then>
  requires std::is_invocable_v<Then&, stream_ref>
void if_then(stream_ref s, condition c, Then&& then_body, const body_options& options = {}) {
  detail::capture_point at = detail::capture_point_of(s, "if_then");
  const auto bodies = detail::add_conditional(s, at, c, cudaGraphCondTypeIf, 1, "if_then");
  detail::capture_body(bodies[0], options, "if_then", then_body);
}

#if CUDART_VERSION >= 12080
/// Appends an IF node with an ELSE body: `then_body` runs when `c` is non-zero, `else_body`
/// otherwise. Needs CUDA 12.8+.
template <class Then, class Else>
  requires std::is_invocable_v<Then&, stream_ref> && std::is_invocable_v<Else&, stream_ref>
void if_then_else(stream_ref s, condition c, Then&& then_body, Else&& else_body, const body_options& options = {}) {
  detail::capture_point at = detail::capture_point_of(s, "if_then_else");
  const auto bodies = detail::add_conditional(s, at, c, cudaGraphCondTypeIf, 2, "if_then_else");
  detail::capture_body(bodies[0], options, "if_then_else", then_body);
  detail::capture_body(bodies[1], options, "if_then_else", else_body);
}
#endif

}  // namespace replay
