// replay/device_loop.hpp: decode K tokens per graph launch with a WHILE node (conditional.hpp).
//
// A decode step normally costs a host round trip per token: write the step metadata, launch the
// graph, read the token back. A device loop puts the step in the body of a WHILE node and lets the
// device do what the host did between steps:
//   - the step's last kernel appends its token to a device-resident buffer of generated tokens
//     (`token_loop_ref::append`), which also decides whether to stop: after `limit` steps, on the
//     stop token, or when the caller says the context is full;
//   - the same kernel writes the next step's metadata (token, position, sequence length; a sampler
//     whose random draw is a function of a seed and the position needs nothing more);
// and the host launches once per K tokens and fetches the generated tokens with one asynchronous
// copy. `token_loop` owns the buffer and adds the loop to a capture:
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
//   loop.fetch(s);                                           // one copy: why it stopped + tokens
//   const replay::loop_result r = loop.wait();               // r.tokens, r.stop
//
// The step limit and the stop token are data on the device (arm() pushes them), and the graph
// resets the count at the start of every launch, so one graph serves every K and a pool key need
// not contain it. A run of the body may hold several steps (a WHILE iteration costs more than a
// kernel handoff); the loop stops only at the end of a run, so the steps after the one whose
// append() returned false must skip their work (e.g. on a flag that kernel sets). Nothing else of the loop lives on the host: whatever the step reads per step must
// be advanced by the device (see docs/guide.md, "Device-side loops").
//
// Guarantees: `token_loop` is move-only (moved-from: every use throws usage_error); its device
// addresses never change, so graphs may hold them. Not thread-safe. The device side
// (`token_loop_ref`) is trivially copyable; append() must be called by one thread, once per step.
// arm() never overwrites staging that an earlier push still reads; wait() reads the copy made by the
// last fetch(). Destructors never throw.
#pragma once

#include <replay/buffer.hpp>
#include <replay/conditional.hpp>
#include <replay/error.hpp>
#include <replay/event.hpp>
#include <replay/step_meta.hpp>
#include <replay/stream.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
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

/// The device-resident header of a token loop's output, followed by the tokens.
struct loop_header {
  std::int32_t produced = 0;    ///< tokens appended in this launch (reset by the graph)
  std::int32_t stopped = 0;     ///< loop_stop (reset by the graph)
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

/// What a kernel in the loop body uses: pass it by value.
struct token_loop_ref {
  loop_header* header = nullptr;   ///< produced, stopped, limit, stop token
  std::int32_t* tokens = nullptr;  ///< capacity slots, filled from 0 in every launch
  std::int32_t capacity = 0;
  condition cond;                  ///< the WHILE node's condition

#if defined(__CUDACC__)
  /// Appends `token` and, when the loop must stop (stop_reason), records why and clears the WHILE
  /// condition. `context_full`: the token just appended fills the context (no further step fits).
  /// Call from one thread of the step's last kernel, once per step. Returns whether the loop goes
  /// on. Reads the header from L2: the previous run of the body wrote it, maybe on another SM.
  __device__ bool append(std::int32_t token, bool context_full = false) const {
    volatile loop_header* h = header;
    const std::int32_t n = h->produced;
    if (n < capacity) tokens[n] = token;
    h->produced = n + 1;
    const loop_stop why = stop_reason(n + 1, token, context_full, h->limit, h->stop_token, capacity);
    if (why == loop_stop::running) return true;
    h->stopped = static_cast<std::int32_t>(why);
    cond.set(false);
    return false;
  }
#endif
};

/// What one launch of a token loop produced (host side, after token_loop::wait()).
struct loop_result {
  std::span<const std::int32_t> tokens;  ///< the tokens appended, in order (valid until the next fetch)
  loop_stop stop = loop_stop::running;   ///< why the loop stopped
};

/// Owns a device loop's output buffer (header + tokens), its pinned readback copy, and adds the
/// WHILE node to a capture.
class token_loop {
 public:
  token_loop() noexcept = default;
  /// Room for `capacity` tokens per launch (>= 1).
  explicit token_loop(std::size_t capacity)
      : capacity_(capacity),
        block_(words + (capacity == 0 ? 1 : capacity)),
        readback_(words + (capacity == 0 ? 1 : capacity)),
        fetched_(std::make_unique<event>()) {
    if (capacity == 0 || capacity > 1u << 24)
      throw usage_error(fmt::format("replay::token_loop: capacity {} (it must be 1 to 2^24)", capacity));
    readback_[0] = 0;
    readback_[1] = static_cast<std::int32_t>(loop_stop::running);
  }

  token_loop(token_loop&&) noexcept = default;
  token_loop& operator=(token_loop&&) noexcept = default;

  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }

  /// The device view (fixed addresses; the condition is filled in by capture()).
  [[nodiscard]] token_loop_ref ref(condition c = {}) const {
    live("ref");
    return {reinterpret_cast<loop_header*>(block_.device()), block_.device() + words,
            static_cast<std::int32_t>(capacity_), c};
  }

  /// Adds the loop to the capture on `s`: a reset of the header's count, then a WHILE node whose
  /// body is `step(stream_ref body, token_loop_ref loop)`, one decode step that ends with
  /// loop.append(). The body runs at least once per launch. On a stream that is not capturing it
  /// runs once, eagerly, as while_loop() does.
  template <class Step>
    requires std::is_invocable_v<Step&, stream_ref, token_loop_ref>
  void capture(stream_ref s, Step&& step, const body_options& options = {}) {
    live("capture");
    REPLAY_CHECK(cudaMemsetAsync(block_.device(), 0, 2 * sizeof(std::int32_t), s.get()),
                 "token_loop: resetting the count");
    while_loop(
        s, [&](stream_ref body, condition c) { step(body, ref(c)); }, {.default_value = 1, .assign_default = true},
        options);
  }

  /// Sets the step limit (1..capacity) and stop token (-1: none) of the next launches; pushes them on
  /// `s` only when they differ from the last values pushed.
  void arm(stream_ref s, int limit, int stop_token = -1) {
    live("arm");
    if (limit < 1 || static_cast<std::size_t>(limit) > capacity_)
      throw usage_error(fmt::format("replay::token_loop::arm: limit {} outside 1..{} (the capacity)", limit,
                                    capacity_));
    if (armed_ && limit == limit_ && stop_token == stop_token_) return;
    auto st = block_.staging();
    st[0] = 0;
    st[1] = 0;
    st[2] = limit;
    st[3] = stop_token;
    block_.push(s, words);
    armed_ = true;
    limit_ = limit;
    stop_token_ = stop_token;
  }

  /// Copies the header and the tokens of the last launch on `s` to pinned host memory (one
  /// asynchronous copy, ordered after the launch).
  void fetch(stream_ref s) {
    live("fetch");
    if (!armed_) throw usage_error("replay::token_loop::fetch: arm() was never called");
    REPLAY_CHECK(cudaMemcpyAsync(readback_.data(), block_.device(),
                                 (words + static_cast<std::size_t>(limit_)) * sizeof(std::int32_t),
                                 cudaMemcpyDeviceToHost, s.get()));
    fetched_->record(s);
  }

  /// Waits for the last fetch() and returns what the launch produced.
  [[nodiscard]] loop_result wait() {
    live("wait");
    fetched_->synchronize();
    const std::int32_t n = readback_[0];
    const std::int32_t why = readback_[1];
    if (n < 0 || n > limit_ || why < 0 || why > static_cast<std::int32_t>(loop_stop::context))
      throw usage_error(fmt::format("replay::token_loop::wait: the fetched header is not a finished loop "
                                    "(count {}, stop {}); was the loop launched before fetch()?",
                                    n, why));
    return {std::span<const std::int32_t>(readback_.data() + words, static_cast<std::size_t>(n)),
            static_cast<loop_stop>(why)};
  }

 private:
  static constexpr std::size_t words = sizeof(loop_header) / sizeof(std::int32_t);
  void live(const char* what) const {
    if (!fetched_) throw usage_error(fmt::format("replay::token_loop::{}: use of a moved-from token_loop", what));
  }

  std::size_t capacity_ = 0;
  step_meta_array<std::int32_t> block_;   // device: header + tokens; staging: the header
  pinned_buffer<std::int32_t> readback_;  // header + tokens, copied by fetch()
  std::unique_ptr<event> fetched_;        // null when moved-from
  bool armed_ = false;
  int limit_ = 0;
  int stop_token_ = -1;
};

}  // namespace replay
