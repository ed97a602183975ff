// replay/stream.hpp: an owning CUDA stream and a borrowing stream_ref.
//
// `stream` owns a cudaStream_t (non-blocking by default, so it never synchronises implicitly with
// the legacy default stream). It is move-only; a moved-from stream is empty (`get() == nullptr`)
// and its destructor does nothing. `stream_ref` borrows any stream and is cheap to copy; it cannot
// be built from `0` or `nullptr`, because the legacy default stream cannot be captured and makes
// captures fail: pass `stream_ref::legacy()` if you really mean it.
//
// Thread safety: a stream may be used from several threads as CUDA allows; the wrapper adds no state.
//
// Example:
//   replay::stream s;                       // non-blocking stream
//   kernel<<<1, 32, 0, s.get()>>>(...);
//   s.synchronize();
#pragma once

#include <replay/error.hpp>

#include <cstddef>
#include <utility>

namespace replay {

/// How a stream relates to the legacy default stream.
enum class stream_flags : unsigned {
  non_blocking = cudaStreamNonBlocking,  ///< no implicit synchronisation with stream 0 (default)
  blocking = cudaStreamDefault,          ///< synchronises with the legacy default stream
};

/// A non-owning view of a CUDA stream. Trivially copyable.
class stream_ref {
 public:
  /// Borrow `s`. It must outlive the ref.
  constexpr explicit stream_ref(cudaStream_t s) noexcept : s_(s) {}
  stream_ref(int) = delete;             // no stream_ref(0): the legacy stream cannot be captured
  stream_ref(std::nullptr_t) = delete;  // no stream_ref(nullptr) either

  /// The legacy default stream, named explicitly.
  [[nodiscard]] static constexpr stream_ref legacy() noexcept { return stream_ref(cudaStream_t{}); }

  [[nodiscard]] constexpr cudaStream_t get() const noexcept { return s_; }

  /// Blocks until all work on the stream is done. Not allowed while the stream is capturing.
  void synchronize() const { REPLAY_CHECK(cudaStreamSynchronize(s_)); }

  /// True when all work on the stream has completed.
  [[nodiscard]] bool ready() const {
    const cudaError_t e = cudaStreamQuery(s_);
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    REPLAY_CHECK(e);
    return true;
  }

  /// The capture status of the stream (none, active or invalidated).
  [[nodiscard]] cudaStreamCaptureStatus capture_status() const {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    REPLAY_CHECK(cudaStreamIsCapturing(s_, &st));
    return st;
  }
  [[nodiscard]] bool is_capturing() const { return capture_status() != cudaStreamCaptureStatusNone; }

  friend constexpr bool operator==(stream_ref a, stream_ref b) noexcept { return a.s_ == b.s_; }

 private:
  cudaStream_t s_;
};

/// An owning CUDA stream. Move-only; moved-from state is empty.
class stream {
 public:
  /// Creates a new stream (non-blocking unless told otherwise) at the given priority (0 = default).
  explicit stream(stream_flags flags = stream_flags::non_blocking, int priority = 0) {
    REPLAY_CHECK(cudaStreamCreateWithPriority(&s_, static_cast<unsigned>(flags), priority));
  }
  /// Takes ownership of an existing stream handle.
  [[nodiscard]] static stream adopt(cudaStream_t s) noexcept { return stream(s, adopt_tag{}); }

  stream(stream&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  stream& operator=(stream&& o) noexcept {
    if (this != &o) reset(std::exchange(o.s_, nullptr));
    return *this;
  }
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;
  ~stream() { reset(); }

  [[nodiscard]] cudaStream_t get() const noexcept { return s_; }
  /// Gives up ownership; the caller destroys the handle.
  [[nodiscard]] cudaStream_t release() noexcept { return std::exchange(s_, nullptr); }
  /// Destroys the owned stream (errors ignored: destructors never throw) and takes `s`.
  void reset(cudaStream_t s = nullptr) noexcept {
    if (s_ != nullptr) (void)detail::check_noexcept(cudaStreamDestroy(s_));
    s_ = s;
  }
  explicit operator bool() const noexcept { return s_ != nullptr; }

  /// A borrowing view. Throws usage_error on an empty stream.
  [[nodiscard]] stream_ref ref() const {
    if (s_ == nullptr) throw usage_error("replay::stream: use of an empty (moved-from) stream");
    return stream_ref(s_);
  }
  operator stream_ref() const { return ref(); }  // NOLINT: implicit borrow is the point

  void synchronize() const { ref().synchronize(); }
  [[nodiscard]] bool ready() const { return ref().ready(); }
  [[nodiscard]] bool is_capturing() const { return ref().is_capturing(); }

 private:
  struct adopt_tag {};
  stream(cudaStream_t s, adopt_tag) noexcept : s_(s) {}
  cudaStream_t s_ = nullptr;
};

}  // namespace replay
