// replay/step_meta.hpp: device-resident per-step metadata (token, position, sequence length, ...).
//
// A graph bakes in kernel arguments, so a value that changes every step (position, token id,
// sequence length, block table) must not be passed by value: kernels read it through a pointer to
// a fixed device address, and the host writes the new value there before each replay.
//
// - `step_meta<T>`: one trivially copyable struct, e.g. `struct decode_meta { int token, pos; };`
// - `step_meta_array<T>`: `size()` elements for a batch (token ids, positions, sequence lengths,
//   flattened block-table rows).
//
// Two ways to get the staged values to the device:
// 1. `push(stream)` before `graph_exec::launch(stream)`: an async host-to-device copy on the stream.
//    Staging is double-buffered: after push() the next staging() call returns the other slot, and
//    if that slot's copy from two pushes ago is still in flight, staging() waits for it (an event
//    guard). Writing new values can therefore never corrupt a copy that is still reading.
// 2. In-graph copy: call `capture_copy(stream)` inside the capture, so the graph itself copies the
//    dedicated graph-staging slot to the device at the start of each replay; per step, write
//    `graph_staging()` and launch. No host-side copy call per step. capture_copy() also captures an
//    event-record node right after the copy, so every replay marks when it has read the staging
//    slot and graph_staging() waits for that mark: writing the next step's values can never race
//    with a replay that is still copying, whoever launches the graph (a pool, a runner, your own
//    loop). The cost: one event-record node per graph, and one cudaEventSynchronize per
//    graph_staging() call (immediate when the copy is done). On a stream that is not capturing
//    (a pool's warm-up, a runner's eager fallback or kill switch, your own eager step) capture_copy()
//    makes the same copy eagerly, guarded the same way, so one step function serves both paths.
//
// `push_range(stream, offset, count)` copies part of the staged array (one row of a block table, the
// rows a batch uses) to the same part of the device copy.
//
// push() refuses to run while `s` is capturing (usage_error): a captured push would bake in
// whichever staging slot was current, and later eager pushes alternate slots, so replays would copy
// stale values. Use capture_copy() inside a capture.
//
// Guarantees: the device address (`device()`) never changes for the object's lifetime and may be
// baked into graphs. The device copy is zero before the constructor returns (ordered before work on
// any stream). Destruction and move-assignment wait for copies still reading the staging memory.
// Move-only; a moved-from object throws usage_error on every use. Not thread-safe: one thread
// stages and pushes. Destructors never throw.
//
// Example:
//   struct meta_t { int token; int pos; };
//   replay::step_meta<meta_t> meta;
//   kernel<<<1, 32, 0, s.get()>>>(meta.device(), ...);       // captured once, reads meta->pos
//   for (int pos = 0; pos < n; ++pos) {
//     meta.staging() = {next_token, pos};
//     meta.push(s);
//     exec.launch(s);
//   }
#pragma once

#include <replay/buffer.hpp>
#include <replay/error.hpp>
#include <replay/event.hpp>
#include <replay/stream.hpp>

#include <array>
#include <memory>
#include <cstddef>
#include <span>
#include <type_traits>
#include <utility>

namespace replay {

/// Device-resident array of per-step values with pinned, guarded host staging.
template <class T>
class step_meta_array {
  static_assert(std::is_trivially_copyable_v<T>, "step metadata must be trivially copyable");

 public:
  /// Number of host staging slots used by push(): one being written while one may be in flight.
  static constexpr std::size_t slots = 2;

  step_meta_array() noexcept = default;
  /// Allocates `count` elements on the device and `slots + 1` staging copies in pinned memory
  /// (the extra one is the in-graph copy's source). The device copy is zero when this returns.
  /// Throws usage_error (before allocating) when `count` is 0 or its sizes overflow.
  explicit step_meta_array(std::size_t count)
      : count_(checked_count(count)), device_(count), staging_((slots + 1) * count), state_(std::make_unique<state>()) {
    // Zeroed on the legacy stream and waited for: a kernel on a non-blocking stream that reads the
    // metadata right after construction must not see the allocation's old contents.
    REPLAY_CHECK(cudaMemsetAsync(device_.data(), 0, device_.size_bytes(), cudaStreamLegacy));
    REPLAY_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
    for (std::size_t i = 0; i < staging_.size(); ++i) staging_[i] = T{};
  }

  step_meta_array(step_meta_array&&) noexcept = default;
  /// Waits for copies that still read this object's staging, then takes `o`'s state.
  step_meta_array& operator=(step_meta_array&& o) noexcept {
    if (this != &o) {
      drain();
      count_ = std::exchange(o.count_, 0);
      device_ = std::move(o.device_);
      staging_ = std::move(o.staging_);
      state_ = std::move(o.state_);
    }
    return *this;
  }
  step_meta_array(const step_meta_array&) = delete;
  step_meta_array& operator=(const step_meta_array&) = delete;
  /// Waits for copies that still read the staging memory, then frees it. Never throws.
  ~step_meta_array() { drain(); }

  [[nodiscard]] std::size_t size() const noexcept { return count_; }
  /// The fixed device address kernels read from. Valid until destruction.
  [[nodiscard]] T* device() const { return live("device"), device_.data(); }
  [[nodiscard]] replay::device_span<T> span() const { return {device(), count_}; }

  /// The staging slot for the next push(). Waits if that slot's previous copy is still running.
  [[nodiscard]] std::span<T> staging() {
    live("staging");
    guard(state_->current);
    return {staging_.data() + state_->current * count_, count_};
  }

  /// Copies the first `count` staged elements to the device on `s` (async), guards the slot with an
  /// event, and moves staging to the other slot. Throws usage_error while `s` is capturing (use
  /// capture_copy() there).
  void push(stream_ref s) { push_range(s, 0, count_); }
  void push(stream_ref s, std::size_t count) { push_range(s, 0, count); }
  /// Copies staged elements [offset, offset + count) to the same elements of the device copy on `s`
  /// (async), guards the slot with an event, and moves staging to the other slot. Throws usage_error
  /// while `s` is capturing, or when the range exceeds size().
  void push_range(stream_ref s, std::size_t offset, std::size_t count) {
    live("push");
    if (s.capture_status() != cudaStreamCaptureStatusNone)
      throw usage_error("replay::step_meta::push: the stream is capturing; a captured push would "
                        "replay a stale staging slot. Call capture_copy() inside the capture and "
                        "write graph_staging() before each launch instead");
    if (offset > count_ || count > count_ - offset)
      throw usage_error(fmt::format("replay::step_meta_array::push: elements [{}, {} + {}) outside the "
                                    "size {}",
                                    offset, offset, count, count_));
    const std::size_t slot = state_->current;
    REPLAY_CHECK(cudaMemcpyAsync(device_.data() + offset, staging_.data() + slot * count_ + offset,
                                 count * sizeof(T), cudaMemcpyHostToDevice, s.get()));
    state_->events[slot].record(s);
    state_->pending[slot] = true;
    state_->current = (slot + 1) % slots;
  }

  /// Records, inside a capture on `s`, a copy from the graph-staging slot to the device followed by
  /// an event-record node: every replay then starts by copying whatever graph_staging() holds and
  /// marks when the copy is done. On a stream that is not capturing it makes the same copy now,
  /// followed by the same event, so an eager run of the step reads the same values. Throws
  /// usage_error when the capture on `s` was invalidated.
  void capture_copy(stream_ref s) {
    live("capture_copy");
    const cudaStreamCaptureStatus status = s.capture_status();
    if (status == cudaStreamCaptureStatusInvalidated)
      throw usage_error("replay::step_meta::capture_copy: the capture on the stream was invalidated by an "
                        "earlier failed call");
    REPLAY_CHECK(cudaMemcpyAsync(device_.data(), staging_.data() + slots * count_, count_ * sizeof(T),
                                 cudaMemcpyHostToDevice, s.get()));
    if (status == cudaStreamCaptureStatusActive)
      REPLAY_CHECK(cudaEventRecordWithFlags(state_->events[slots].get(), s.get(), cudaEventRecordExternal));
    else
      REPLAY_CHECK(cudaEventRecord(state_->events[slots].get(), s.get()));
    state_->pending[slots] = true;
  }
  /// The source of the in-graph copy. Waits until every launched replay has finished copying it
  /// (the event-record node that capture_copy() captured).
  [[nodiscard]] std::span<T> graph_staging() {
    live("graph_staging");
    if (state_->pending[slots]) state_->events[slots].synchronize();  // stays pending: every replay re-records
    return {staging_.data() + slots * count_, count_};
  }

  /// Waits for every copy that may still read staging memory.
  void wait_idle() {
    live("wait_idle");
    for (std::size_t i = 0; i <= slots; ++i) guard(i);
  }

 private:
  struct state {
    std::array<event, slots + 1> events;
    std::array<bool, slots + 1> pending{};
    std::size_t current = 0;
  };
  void live(const char* what) const {
    if (!state_)
      throw usage_error(fmt::format("replay::step_meta::{}: use of a moved-from step_meta", what));
  }
  static std::size_t checked_count(std::size_t count) {
    if (count == 0) throw usage_error("replay::step_meta_array: size must be at least 1");
    if (count > static_cast<std::size_t>(-1) / (slots + 1))
      throw usage_error(fmt::format("replay::step_meta_array: {} elements overflow the staging size", count));
    (void)detail::checked_bytes<T>((slots + 1) * count, "step_meta_array");
    return count;
  }
  void guard(std::size_t slot) {
    if (state_->pending[slot]) {
      state_->events[slot].synchronize();
      if (slot != slots) state_->pending[slot] = false;  // the graph slot's event is re-recorded by replays
    }
  }
  void drain() noexcept {
    if (!state_) return;
    for (std::size_t i = 0; i <= slots; ++i)
      if (state_->pending[i]) (void)detail::check_noexcept(cudaEventSynchronize(state_->events[i].get()));
  }

  std::size_t count_ = 0;
  device_buffer<T> device_;
  pinned_buffer<T> staging_;
  std::unique_ptr<state> state_;  // null when moved-from
};

/// Device-resident single struct of per-step values: a step_meta_array of one element with
/// struct-shaped accessors.
template <class T>
class step_meta {
 public:
  /// Allocates the device copy (zeroed) and pinned staging.
  step_meta() : a_(1) {}
  /// Allocates and stages `initial` (not pushed yet).
  explicit step_meta(const T& initial) : a_(1) { a_.staging()[0] = initial; }

  [[nodiscard]] T* device() const { return a_.device(); }
  /// The value the next push() copies.
  [[nodiscard]] T& staging() { return a_.staging()[0]; }
  /// Stages `v` (shorthand for `staging() = v`).
  void set(const T& v) { staging() = v; }
  void push(stream_ref s) { a_.push(s); }
  /// Stages `v` and pushes it.
  void push(stream_ref s, const T& v) {
    set(v);
    push(s);
  }
  void capture_copy(stream_ref s) { a_.capture_copy(s); }
  [[nodiscard]] T& graph_staging() { return a_.graph_staging()[0]; }
  void wait_idle() { a_.wait_idle(); }

 private:
  step_meta_array<T> a_;
};

}  // namespace replay
