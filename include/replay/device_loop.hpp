// replay/device_loop.hpp: decode K tokens per graph launch with a WHILE node (conditional.hpp).
//
// A decode step normally costs a host round trip per token: write the step metadata, launch the
// graph, read the token back. A device loop puts the step in the body of a WHILE node and lets the
// device do what the host did between steps:
//   - the step's last kernel appends its token (`token_loop_ref::append`), which also decides
//     whether to stop: after `limit` steps, on the stop token, or when the caller says the context
//     is full. The token goes straight to pinned host memory; the step that stops the loop also
//     writes the count, why it stopped, the limit it ran with and the launch's number there, and
//     the host polls for that number;
//   - the same kernel writes the next step's metadata (token, position, sequence length; a sampler
//     whose random draw is a function of a seed and the position needs nothing more);
// and the host launches once per K tokens, with no copy node and no event. `token_loop` owns the
// header and the result and adds the loop to a capture:
//
//   replay::token_loop loop(64);                             // up to 64 tokens per launch
//   graph g = replay::capture(s, [&](replay::stream_ref cs) {
//     loop.capture(cs, [&](replay::stream_ref body, replay::token_loop_ref ref) {
//       decode_step(body, ref);     // its last kernel: ref.append(token, seq_len + 1 >= context)
//     });                           //                  and writes the next step's metadata
//   });
//   exec = g.instantiate();
//   meta.push(s);                                            // the first step's metadata
//   loop.arm(s, 16, stop_token);                             // pushed only when it changes
//   exec.launch(s);
//   const replay::loop_result r = loop.wait(s);              // polls: r.tokens, r.stop
//
// The step limit and the stop token are data on the device (arm() pushes them), and the graph
// resets the count and the stop flag at the start of every launch (one memset node), so one graph
// serves every K and a pool key need not contain it. A run of the body may hold several steps (a
// WHILE iteration costs more than a kernel handoff); the loop stops only at the end of a run, so
// the steps after the one whose append() returned false must skip their work: they see
// `read_header().stopped != 0`. Nothing else of the loop lives on the host: whatever the step reads
// per step must be advanced by the device (see docs/guide.md, "Device-side loops").
//
// Launches are numbered on the device, and wait() takes exactly the launch after the one it took
// last: a launch it did not expect (two launches per wait(), or a loop run eagerly behind the
// caller's back) is a usage_error naming both numbers, never another launch's tokens. wait() checks
// the count against the limit that launch ran with, so the next launch may be armed before the
// wait. Inside pools and runners: a pool's warm-up does not run the loop (replay::warming_up()),
// and an eager run (the runner's fallback or kill switch) is one real launch, numbered like a
// replay.
//
// Guarantees: `token_loop` is move-only (moved-from: every use throws usage_error); its device and
// pinned addresses never change, so graphs may hold them. Not thread-safe. The device side
// (`token_loop_ref`) is trivially copyable; append() must be called by one thread, once per step.
// arm() never overwrites staging that an earlier push still reads. wait() is called once per
// launch, before the next launch: the tokens it returns stay valid until then. The capacity is
// checked before anything is allocated. Destructors never throw.
#pragma once

#include <replay/buffer.hpp>
#include <replay/capture.hpp>
#include <replay/conditional.hpp>
#include <replay/error.hpp>
#include <replay/step_meta.hpp>
#include <replay/stream.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>

namespace replay {

/// Why a device loop stopped.
enum class loop_stop : std::int32_t {
  running = 0,     ///< not stopped (the loop is still running, or never ran)
  steps = 1,       ///< it ran the number of steps it was armed with
  stop_token = 2,  ///< the last token appended was the stop token
  context = 3,     ///< the caller reported the context full
};

constexpr std::string_view to_string(loop_stop s) noexcept {
  switch (s) {
    case loop_stop::running: return "running";
    case loop_stop::steps: return "steps";
    case loop_stop::stop_token: return "stop token";
    case loop_stop::context: return "context full";
  }
  return "unknown";
}

/// The device-resident header of a token loop: the count and stop flag of the launch in progress
/// and the stop rule's inputs. (The device copy is followed by the number of launches finished.)
struct loop_header {
  std::int32_t produced = 0;    ///< tokens appended in this launch (reset by the graph)
  std::int32_t stopped = 0;     ///< loop_stop once the launch has stopped (reset by the graph)
  std::int32_t limit = 1;       ///< stop after this many steps (arm())
  std::int32_t stop_token = -1; ///< stop after appending this token; -1: none (arm())
};
static_assert(sizeof(loop_header) == 4 * sizeof(std::int32_t));

/// The stop rule, shared by the device and the host tests: after appending `token` as the
/// `produced`-th token of this launch (1-based), why the loop stops, or running. A stop token
/// outranks the context, which outranks the step count; `capacity` is a safety net.
REPLAY_HOST_DEVICE constexpr loop_stop stop_reason(std::int32_t produced, std::int32_t token, bool context_full,
                                                   std::int32_t limit, std::int32_t stop_token,
                                                   std::int32_t capacity) noexcept {
  if (stop_token >= 0 && token == stop_token) return loop_stop::stop_token;
  if (context_full) return loop_stop::context;
  if (produced >= limit || produced >= capacity) return loop_stop::steps;
  return loop_stop::running;
}

/// What a kernel in the loop body uses: pass it by value. No padding bytes (a kernel parameter of
/// this type is fully determined, also when default-constructed for a step outside the loop).
struct token_loop_ref {
  /// Words of the pinned result before the tokens: count, loop_stop, limit, launch number.
  static constexpr std::int32_t result_header = 4;

  loop_header* header = nullptr;   ///< device memory: produced, stopped, limit, stop token, launches
  std::int32_t* result = nullptr;  ///< pinned host memory: count, loop_stop, limit, launch, then the tokens
  std::int32_t capacity = 0;
  std::int32_t reserved = 0;       ///< explicit: no padding bytes
  condition cond;                  ///< the WHILE node's condition

#if defined(__CUDACC__)
  /// The header as the previous step left it, read from L2 (that step may have run on another SM).
  /// Read it after the step's wait for the previous step, as early as possible: append() needs it,
  /// and `stopped != 0` tells a step after the one that stopped the loop (in the same run of the
  /// body) to skip its work.
  __device__ loop_header read_header() const {
    const int4 h = __ldcg(reinterpret_cast<const int4*>(header));
    return {h.x, h.y, h.z, h.w};
  }

  /// Appends `token` and, when the loop must stop (stop_reason), records why and clears the WHILE
  /// condition. `now`: read_header() of this step. `context_full`: the token just appended fills
  /// the context (no further step fits). Call from one thread of the step's last kernel, once per
  /// step. Returns whether the loop goes on. The token goes straight to pinned host memory; the
  /// step that stops the loop writes the count, why it stopped and the limit, and then, after a
  /// system-scope fence, the launch's number, which is what token_loop::wait() polls.
  __device__ bool append(const loop_header& now, std::int32_t token, bool context_full = false) const {
    const std::int32_t n = now.produced;
    volatile std::int32_t* out = result;
    if (n < capacity) out[result_header + n] = token;
    header->produced = n + 1;
    const loop_stop why = stop_reason(n + 1, token, context_full, now.limit, now.stop_token, capacity);
    if (why == loop_stop::running) return true;
    header->stopped = static_cast<std::int32_t>(why);
    cond.set(false);
    std::int32_t* launches = reinterpret_cast<std::int32_t*>(header + 1);
    const std::int32_t launch = *launches + 1;
    *launches = launch;
    out[0] = n + 1 < capacity ? n + 1 : capacity;
    out[1] = static_cast<std::int32_t>(why);
    out[2] = now.limit;
    __threadfence_system();  // the tokens, count, reason and limit reach the host before the number
    out[3] = launch;
    return false;
  }
  /// append(read_header(), token, context_full).
  __device__ bool append(std::int32_t token, bool context_full = false) const {
    return append(read_header(), token, context_full);
  }
#endif
};

static_assert(std::has_unique_object_representations_v<token_loop_ref>, "token_loop_ref has padding bytes");

/// What one launch of a token loop produced (host side, after token_loop::wait()).
struct loop_result {
  std::span<const std::int32_t> tokens;  ///< the tokens appended, in order (valid until the next launch)
  loop_stop stop = loop_stop::running;   ///< why the loop stopped
};

/// Owns a device loop's header (device memory) and its result (pinned host memory: count, stop
/// reason, tokens, written by the device), and adds the WHILE node to a capture.
class token_loop {
 public:
  token_loop() noexcept = default;
  /// Room for `capacity` tokens per launch (1 to 2^24; checked before anything is allocated).
  explicit token_loop(std::size_t capacity)
      : capacity_(checked_capacity(capacity)),
        header_(device_words),
        result_(token_loop_ref::result_header + capacity) {
    for (auto& v : result_) v = 0;  // launch number 0: no launch has finished yet
  }

  token_loop(token_loop&&) noexcept = default;
  token_loop& operator=(token_loop&&) noexcept = default;

  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }

  /// The device view (fixed addresses; the condition is filled in by capture()).
  [[nodiscard]] token_loop_ref ref(condition c = {}) const {
    live("ref");
    return {reinterpret_cast<loop_header*>(header_.device()), result_.data(), static_cast<std::int32_t>(capacity_), 0,
            c};
  }

  /// Adds the loop to the capture on `s`: a reset of the header's count and stop flag, then a WHILE
  /// node whose body is `step(stream_ref body, token_loop_ref loop)`, one decode step that ends
  /// with loop.append(). The body runs at least once per launch. On a stream that is not capturing
  /// it runs once, eagerly, as while_loop() does (one launch, numbered), and during a pool's
  /// warm-up not at all.
  template <class Step>
    requires std::is_invocable_v<Step&, stream_ref, token_loop_ref>
  void capture(stream_ref s, Step&& step, const body_options& options = {}) {
    live("capture");
    if (warming_up() && s.capture_status() == cudaStreamCaptureStatusNone) return;
    REPLAY_CHECK(cudaMemsetAsync(header_.device(), 0, 2 * sizeof(std::int32_t), s.get()),
                 "token_loop: resetting the count");
    while_loop(
        s, [&](stream_ref body, condition c) { step(body, ref(c)); }, condition_options::while_defaults(), options);
  }

  /// Sets the step limit (1..capacity) and stop token (-1: none) of the next launches; pushes them on
  /// `s` only when they differ from the last values pushed.
  void arm(stream_ref s, int limit, int stop_token = -1) {
    live("arm");
    if (limit < 1 || static_cast<std::size_t>(limit) > capacity_)
      throw usage_error(fmt::format("replay::token_loop::arm: limit {} outside 1..{} (the capacity)", limit,
                                    capacity_));
    if (armed_ && limit == limit_ && stop_token == stop_token_) return;
    auto st = header_.staging();
    st[0] = 0;
    st[1] = 0;
    st[2] = limit;
    st[3] = stop_token;
    header_.push(s, words);
    armed_ = true;
    limit_ = limit;
    stop_token_ = stop_token;
  }

  /// Waits for the next launch on `s` (the one after the launch the previous wait() took) to stop
  /// and returns what it produced. Polls the pinned result the device writes (no copy, no event);
  /// if the loop takes unusually long (a slow tool, a failed kernel) it synchronises `s`, which
  /// also reports any CUDA error. Call once per launch. Throws usage_error when no launch finished,
  /// or when a later launch than the expected one did (the result of the expected one was
  /// overwritten); the next wait() then expects the launch after the one found.
  [[nodiscard]] loop_result wait(stream_ref s) {
    live("wait");
    if (!armed_) throw usage_error("replay::token_loop::wait: arm() was never called");
    volatile std::int32_t* out = result_.data();
    const std::int32_t expected = waited_ + 1;
    std::int32_t launch = out[3];
    for (int i = 0; launch < expected && i < (1 << 22); ++i) launch = out[3];
    if (launch < expected) {
      REPLAY_CHECK(cudaStreamSynchronize(s.get()));
      launch = out[3];
    }
    std::atomic_thread_fence(std::memory_order_acquire);  // the rest was written before the number
    if (launch < expected)
      throw usage_error(fmt::format("replay::token_loop::wait: no finished launch on the stream (expected launch "
                                    "{}, the last finished is {}); was the loop launched?",
                                    expected, launch));
    waited_ = launch;
    if (launch != expected)
      throw usage_error(fmt::format("replay::token_loop::wait: expected launch {} but launch {} finished: the loop "
                                    "was launched more often than wait() was called (wait once per launch), and "
                                    "the tokens of launch {} are lost",
                                    expected, launch, expected));
    const std::int32_t n = out[0], why = out[1], limit = out[2];
    if (n < 1 || n > limit || why < 1 || why > static_cast<std::int32_t>(loop_stop::context))
      throw usage_error(fmt::format("replay::token_loop::wait: launch {} left an inconsistent result (count {}, "
                                    "limit {}, stop {})",
                                    launch, n, limit, why));
    return {std::span<const std::int32_t>(result_.data() + token_loop_ref::result_header, static_cast<std::size_t>(n)),
            static_cast<loop_stop>(why)};
  }

 private:
  static constexpr std::size_t words = sizeof(loop_header) / sizeof(std::int32_t);
  static constexpr std::size_t device_words = 2 * words;  // the header, then the launch count (+ padding)
  static std::size_t checked_capacity(std::size_t capacity) {
    if (capacity == 0 || capacity > 1u << 24)
      throw usage_error(fmt::format("replay::token_loop: capacity {} (it must be 1 to 2^24)", capacity));
    return capacity;
  }
  void live(const char* what) const {
    if (!result_) throw usage_error(fmt::format("replay::token_loop::{}: use of a moved-from token_loop", what));
  }

  std::size_t capacity_ = 0;
  step_meta_array<std::int32_t> header_;  // device: the header, launches; staging: what arm() pushes
  pinned_buffer<std::int32_t> result_;    // count, stop reason, limit, launch, tokens: written by the device
  std::int32_t waited_ = 0;               // the launch the last wait() took
  bool armed_ = false;
  int limit_ = 0;
  int stop_token_ = -1;
};

}  // namespace replay
