// replay/buffer.hpp: device and pinned buffers, a device span, and the static arena.
//
// A captured graph bakes in every device address it touches, so decode buffers must be allocated
// once, before capture, and never move. These types make that the default:
// - `device_buffer<T>`: one cudaMalloc'd array, move-only, address fixed for its lifetime (moving
//   the owner does not move the memory).
// - `pinned_buffer<T>`: page-locked host memory (cudaMallocHost), needed for truly asynchronous
//   copies and for in-graph host<->device copies.
// - `device_span<T>`: a non-owning (pointer, size) pair usable in host and device code; pass it to
//   kernels by value (it is an address, which may be baked into a graph).
// - `static_arena`: one allocation carved into aligned sub-buffers during setup, then frozen. After
//   freeze() (or beyond capacity) allocate() throws usage_error, so every address a graph captured
//   stays valid for as long as the arena lives.
//
// Thread safety: none of these types synchronise; share them across threads only read-only.
// Exception safety: constructors throw cuda_error on allocation failure and leak nothing, and
// usage_error before allocating when a size in bytes would overflow; the destructors never throw.
//
// Example:
//   replay::static_arena arena(64 << 20);
//   auto x      = arena.allocate<float>(n_embd);        // 256-byte aligned
//   auto logits = arena.allocate<float>(vocab);
//   arena.freeze();                                    // addresses are now fixed for capture
#pragma once

#include <replay/error.hpp>
#include <replay/stream.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <utility>

#if defined(__CUDACC__)
#define REPLAY_HOST_DEVICE __host__ __device__
#else
#define REPLAY_HOST_DEVICE
#endif

namespace replay {

/// A non-owning view of `size` elements of T in device memory. Trivially copyable; pass by value.
template <class T>
struct device_span {
  T* ptr = nullptr;
  std::size_t count = 0;

  REPLAY_HOST_DEVICE constexpr T* data() const noexcept { return ptr; }
  REPLAY_HOST_DEVICE constexpr std::size_t size() const noexcept { return count; }
  REPLAY_HOST_DEVICE constexpr std::size_t size_bytes() const noexcept { return count * sizeof(T); }
  REPLAY_HOST_DEVICE constexpr bool empty() const noexcept { return count == 0; }
  /// Element access (device code; on the host the address is not dereferenceable).
  REPLAY_HOST_DEVICE constexpr T& operator[](std::size_t i) const noexcept { return ptr[i]; }
  REPLAY_HOST_DEVICE constexpr device_span subspan(std::size_t offset, std::size_t n) const noexcept {
    return {ptr + offset, n};
  }
  REPLAY_HOST_DEVICE constexpr operator device_span<const T>() const noexcept  // NOLINT
    requires(!std::is_const_v<T>)
  {
    return {ptr, count};
  }
};

namespace detail {

/// Rounds `n` up to a multiple of `alignment` (a power of two).
constexpr std::size_t align_up(std::size_t n, std::size_t alignment) noexcept {
  return (n + alignment - 1) & ~(alignment - 1);
}
constexpr bool is_power_of_two(std::size_t n) noexcept { return n != 0 && (n & (n - 1)) == 0; }

/// `count * sizeof(T)`, or usage_error naming `what` when the product does not fit in size_t (it
/// would wrap to a small allocation while the owner claims `count` elements).
template <class T>
std::size_t checked_bytes(std::size_t count, const char* what) {
  if (count > static_cast<std::size_t>(-1) / sizeof(T))
    throw usage_error(fmt::format("replay::{}: {} elements of {} bytes overflow the size type", what, count,
                                  sizeof(T)));
  return count * sizeof(T);
}

/// The bookkeeping of static_arena without any memory: offsets, alignment, capacity, freezing.
/// Host-testable.
class arena_layout {
 public:
  explicit constexpr arena_layout(std::size_t capacity) noexcept : capacity_(capacity) {}

  /// Reserves `bytes` at an offset aligned to `alignment`; returns the offset. Throws usage_error
  /// when frozen, when the alignment is not a power of two, or when capacity would be exceeded.
  std::size_t reserve(std::size_t bytes, std::size_t alignment) {
    if (frozen_)
      throw usage_error(fmt::format("replay::static_arena: allocate({} bytes) after freeze(); every "
                                    "buffer must be carved out during setup, before capture", bytes));
    if (!is_power_of_two(alignment))
      throw usage_error(fmt::format("replay::static_arena: alignment {} is not a power of two",
                                    alignment));
    const std::size_t offset = align_up(used_, alignment);
    if (offset < used_ || offset > capacity_ || bytes > capacity_ - offset)
      throw usage_error(fmt::format("replay::static_arena: out of capacity: {} bytes at alignment {} "
                                    "requested, {} of {} bytes used", bytes, alignment, used_,
                                    capacity_));
    used_ = offset + bytes;
    ++allocations_;
    return offset;
  }
  constexpr void freeze() noexcept { frozen_ = true; }
  [[nodiscard]] constexpr bool frozen() const noexcept { return frozen_; }
  [[nodiscard]] constexpr std::size_t used() const noexcept { return used_; }
  [[nodiscard]] constexpr std::size_t capacity() const noexcept { return capacity_; }
  [[nodiscard]] constexpr std::size_t remaining() const noexcept { return capacity_ - used_; }
  [[nodiscard]] constexpr std::size_t allocations() const noexcept { return allocations_; }

 private:
  std::size_t capacity_;
  std::size_t used_ = 0;
  std::size_t allocations_ = 0;
  bool frozen_ = false;
};

}  // namespace detail

/// An owning array of `size()` elements of T in device memory. Move-only; moved-from is empty.
/// The contents are uninitialised.
template <class T>
class device_buffer {
  static_assert(std::is_trivially_copyable_v<T>, "device_buffer holds trivially copyable types");

 public:
  device_buffer() noexcept = default;
  /// Allocates `count` elements; usage_error (before allocating) when the byte size overflows.
  explicit device_buffer(std::size_t count) : count_(count) {
    const std::size_t bytes = detail::checked_bytes<T>(count, "device_buffer");
    if (count != 0) {
      void* p = nullptr;
      REPLAY_CHECK(cudaMalloc(&p, bytes), "device_buffer of {} bytes", bytes);
      ptr_ = static_cast<T*>(p);
    }
  }
  device_buffer(device_buffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), count_(std::exchange(o.count_, 0)) {}
  device_buffer& operator=(device_buffer&& o) noexcept {
    if (this != &o) {
      reset();
      ptr_ = std::exchange(o.ptr_, nullptr);
      count_ = std::exchange(o.count_, 0);
    }
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { reset(); }

  [[nodiscard]] T* data() const noexcept { return ptr_; }
  [[nodiscard]] T* get() const noexcept { return ptr_; }
  [[nodiscard]] std::size_t size() const noexcept { return count_; }
  [[nodiscard]] std::size_t size_bytes() const noexcept { return count_ * sizeof(T); }
  [[nodiscard]] bool empty() const noexcept { return count_ == 0; }
  explicit operator bool() const noexcept { return ptr_ != nullptr; }
  [[nodiscard]] device_span<T> span() const noexcept { return {ptr_, count_}; }
  operator device_span<T>() const noexcept { return span(); }  // NOLINT
  operator device_span<const T>() const noexcept { return {ptr_, count_}; }  // NOLINT

  /// Frees the memory (errors ignored; never throws). Call only when no graph or kernel in flight
  /// still uses the address.
  void reset() noexcept {
    if (ptr_ != nullptr) (void)detail::check_noexcept(cudaFree(ptr_));
    ptr_ = nullptr;
    count_ = 0;
  }
  /// Gives up ownership; the caller frees with cudaFree.
  [[nodiscard]] T* release() noexcept {
    count_ = 0;
    return std::exchange(ptr_, nullptr);
  }

  /// Asynchronous copies from/to host memory (use pinned memory for true asynchrony).
  void copy_from_host(std::span<const T> src, stream_ref s) {
    require_fits(src.size());
    REPLAY_CHECK(cudaMemcpyAsync(ptr_, src.data(), src.size_bytes(), cudaMemcpyHostToDevice, s.get()));
  }
  void copy_to_host(std::span<T> dst, stream_ref s) const {
    require_fits(dst.size());
    REPLAY_CHECK(cudaMemcpyAsync(dst.data(), ptr_, dst.size_bytes(), cudaMemcpyDeviceToHost, s.get()));
  }
  /// Sets every byte to `value` on the stream.
  void fill_bytes(int value, stream_ref s) {
    if (count_ != 0) REPLAY_CHECK(cudaMemsetAsync(ptr_, value, size_bytes(), s.get()));
  }

 private:
  void require_fits(std::size_t n) const {
    if (n > count_)
      throw usage_error(fmt::format("replay::device_buffer: copy of {} elements into a buffer of {}",
                                    n, count_));
  }
  T* ptr_ = nullptr;
  std::size_t count_ = 0;
};

/// Page-locked host memory for `size()` elements of T. Move-only; moved-from is empty.
template <class T>
class pinned_buffer {
  static_assert(std::is_trivially_copyable_v<T>, "pinned_buffer holds trivially copyable types");

 public:
  pinned_buffer() noexcept = default;
  /// Allocates `count` elements; usage_error (before allocating) when the byte size overflows.
  explicit pinned_buffer(std::size_t count) : count_(count) {
    const std::size_t bytes = detail::checked_bytes<T>(count, "pinned_buffer");
    if (count != 0) {
      void* p = nullptr;
      REPLAY_CHECK(cudaMallocHost(&p, bytes), "pinned_buffer of {} bytes", bytes);
      ptr_ = static_cast<T*>(p);
    }
  }
  pinned_buffer(pinned_buffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), count_(std::exchange(o.count_, 0)) {}
  pinned_buffer& operator=(pinned_buffer&& o) noexcept {
    if (this != &o) {
      reset();
      ptr_ = std::exchange(o.ptr_, nullptr);
      count_ = std::exchange(o.count_, 0);
    }
    return *this;
  }
  pinned_buffer(const pinned_buffer&) = delete;
  pinned_buffer& operator=(const pinned_buffer&) = delete;
  ~pinned_buffer() { reset(); }

  [[nodiscard]] T* data() const noexcept { return ptr_; }
  [[nodiscard]] std::size_t size() const noexcept { return count_; }
  [[nodiscard]] std::size_t size_bytes() const noexcept { return count_ * sizeof(T); }
  [[nodiscard]] bool empty() const noexcept { return count_ == 0; }
  explicit operator bool() const noexcept { return ptr_ != nullptr; }
  [[nodiscard]] std::span<T> span() const noexcept { return {ptr_, count_}; }
  T& operator[](std::size_t i) const noexcept { return ptr_[i]; }
  T* begin() const noexcept { return ptr_; }
  T* end() const noexcept { return ptr_ + count_; }

  void reset() noexcept {
    if (ptr_ != nullptr) (void)detail::check_noexcept(cudaFreeHost(ptr_));
    ptr_ = nullptr;
    count_ = 0;
  }

 private:
  T* ptr_ = nullptr;
  std::size_t count_ = 0;
};

/// One device allocation carved into aligned sub-buffers at setup, then frozen.
///
/// Guarantees: the base address never changes for the arena's lifetime, so every span it handed
/// out stays valid while a graph holds it; allocate() after freeze() or beyond capacity throws
/// usage_error and allocates nothing. Move-only; a moved-from arena is empty (capacity 0).
class static_arena {
 public:
  /// Default alignment of sub-buffers: 256 bytes (cudaMalloc's own alignment, enough for vector
  /// loads and TMA).
  static constexpr std::size_t default_alignment = 256;

  static_arena() noexcept : layout_(0) {}
  explicit static_arena(std::size_t capacity_bytes) : layout_(capacity_bytes), base_(capacity_bytes) {}
  static_arena(static_arena&& o) noexcept
      : layout_(std::exchange(o.layout_, detail::arena_layout(0))), base_(std::move(o.base_)) {}
  static_arena& operator=(static_arena&& o) noexcept {
    layout_ = std::exchange(o.layout_, detail::arena_layout(0));
    base_ = std::move(o.base_);
    return *this;
  }
  static_arena(const static_arena&) = delete;
  static_arena& operator=(const static_arena&) = delete;

  /// Carves `count` elements of T, aligned to `alignment` bytes (a power of two, at least alignof(T)).
  template <class T>
  [[nodiscard]] device_span<T> allocate(std::size_t count, std::size_t alignment = default_alignment) {
    const std::size_t align = alignment < alignof(T) ? alignof(T) : alignment;
    const std::size_t offset = layout_.reserve(detail::checked_bytes<T>(count, "static_arena::allocate"), align);
    return {reinterpret_cast<T*>(base_.data() + offset), count};
  }

  /// No allocation is possible after this; addresses handed out stay valid.
  void freeze() noexcept { layout_.freeze(); }
  [[nodiscard]] bool frozen() const noexcept { return layout_.frozen(); }
  [[nodiscard]] std::size_t capacity() const noexcept { return layout_.capacity(); }
  [[nodiscard]] std::size_t used() const noexcept { return layout_.used(); }
  [[nodiscard]] std::size_t remaining() const noexcept { return layout_.remaining(); }
  [[nodiscard]] std::byte* base() const noexcept { return base_.data(); }

 private:
  detail::arena_layout layout_;
  device_buffer<std::byte> base_;
};

}  // namespace replay
