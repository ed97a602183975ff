// replay/nccl.hpp: NCCL communicators and collectives that are safe to capture into CUDA graphs.
//
// Needs NCCL (link replay::nccl, which defines REPLAY_HAS_NCCL). NCCL is the engine for every
// collective; this header only owns its handles, checks its results and refuses the misuses that
// make a captured tensor-parallel step hang:
//
// - `nccl_error` (a `cuda_error`): an NCCL call failed; carries the ncclResult_t, NCCL's own text
//   (ncclGetLastError), the API name and the caller's source location. `REPLAY_NCCL_CHECK(expr)`
//   throws it, building the message only on failure.
// - `nccl_unique_id`: the bootstrap id rank 0 makes and sends to the others (as bytes).
// - `nccl_comm`: an owning, move-only communicator (null when moved from) on one device. Made one
//   rank per process or thread with `init_rank`, or for all local devices at once with `init_all`
//   (single-process tests and benchmarks). The destructor calls ncclCommDestroy and never throws.
//   Destroy every graph that captured a collective of a communicator before the communicator.
// - `all_reduce(comm, send, recv, count, type, op, stream)` and a typed overload: check that the
//   stream belongs to the communicator's device, and that a collective issued while this thread
//   captures goes to a capturing stream (an uncaptured collective in the middle of a captured
//   step runs once, now, while the other ranks' copies run at every replay: a hang).
// - `all_gather(comm, send, recv, count, type, stream)` and a typed overload: the same checks.
// - `nccl_group`: ncclGroupStart/End as a scope, for one thread driving several devices.
// - `nccl_agreement(comm)`: the cross-rank minimum that lockstep_runner (lockstep.hpp) needs, as a
//   blocking one-element all-reduce on its own stream. Use a communicator reserved for it
//   (`comm.split()`), so that an agreement can never be matched with a collective of the step.
//
// Thread safety: a communicator is driven by one thread at a time (NCCL's rule). Exception
// safety: constructors and init functions leave nothing behind when they throw.
//
// Example (one thread per rank; rank 0 sends id.bytes() to the others):
//   cudaSetDevice(rank);
//   replay::nccl_comm comm = replay::nccl_comm::init_rank(world, id, rank);
//   replay::all_reduce(comm, x, x, n, ncclSum, s);   // x: __nv_bfloat16*, in place, capturable
#pragma once

#if !defined(REPLAY_HAS_NCCL)
#  if !__has_include(<nccl.h>)
#    error "replay/nccl.hpp needs NCCL: link the replay::nccl target (configure found no nccl.h)"
#  endif
#endif

#include <replay/error.hpp>
#include <replay/lockstep.hpp>
#include <replay/stream.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>
#if __has_include(<cuda_bf16.h>)
#  include <cuda_bf16.h>
#endif
#include <cuda_fp16.h>

#include <fmt/format.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <source_location>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace replay {

/// An NCCL call failed. `code()` is cudaErrorUnknown unless NCCL reported an unhandled CUDA error
/// and CUDA still holds it. Thread safety: immutable after construction.
class nccl_error : public cuda_error {
 public:
  nccl_error(ncclResult_t result, std::string api, std::string detail, std::string context,
             capture_state capture, std::source_location where)
      : cuda_error(format(result, api, detail, context, capture, where), cudaErrorUnknown, api,
                   capture, where),
        result_(result) {}

  /// The NCCL result the call returned.
  [[nodiscard]] ncclResult_t result() const noexcept { return result_; }

  /// The message for these fields (host-testable).
  static std::string format(ncclResult_t result, std::string_view api, std::string_view detail,
                            std::string_view context, capture_state capture,
                            const std::source_location& where) {
    std::string msg = fmt::format("{} failed: NCCL {} ({})", api, ncclGetErrorString(result),
                                  static_cast<int>(result));
    if (!detail.empty()) msg += fmt::format(": {}", detail);
    if (!context.empty()) msg += fmt::format(" [{}]", context);
    if (capture != capture_state::none)
      msg += " while the stream was capturing; hint: NCCL calls inside a capture must go to the "
             "capturing stream, ranks must capture the same collectives in the same order, and "
             "communicator setup (init, split, destroy) must happen before capture";
    msg += fmt::format(" at {}:{} in {}", where.file_name(), where.line(), where.function_name());
    return msg;
  }

 private:
  ncclResult_t result_;
};

namespace detail {

[[noreturn]] inline void throw_nccl_error(ncclResult_t result, std::string_view api, std::string context,
                                          std::source_location where) {
  const char* last = ncclGetLastError(nullptr);
  throw nccl_error(result, std::string(api), last ? std::string(last) : std::string(),
                   std::move(context), current_capture_state(), where);
}

/// The device a stream belongs to. Not while the calling thread captures (CUDA refuses it then).
inline int stream_device(cudaStream_t s) {
#if CUDART_VERSION >= 12080
  int device = -1;
  REPLAY_CHECK(cudaStreamGetDevice(s, &device));
  return device;
#else
  (void)s;  // older toolkits: the current device is the best available answer
  int device = -1;
  REPLAY_CHECK(cudaGetDevice(&device));
  return device;
#endif
}

/// Sets a device for a scope and restores the previous one (noexcept restore).
class device_scope {
 public:
  explicit device_scope(int device) {
    REPLAY_CHECK(cudaGetDevice(&old_));
    if (old_ != device) REPLAY_CHECK(cudaSetDevice(device));
  }
  ~device_scope() { (void)check_noexcept(cudaSetDevice(old_)); }
  device_scope(const device_scope&) = delete;
  device_scope& operator=(const device_scope&) = delete;

 private:
  int old_ = 0;
};

}  // namespace detail
}  // namespace replay

/// Evaluates an NCCL call; on failure throws replay::nccl_error naming the API, NCCL's last error
/// text, the caller's location and an optional fmt-formatted context (built only on failure).
#define REPLAY_NCCL_CHECK(expr, ...)                                                             \
  do {                                                                                           \
    const ncclResult_t replay_nccl_res_ = (expr);                                               \
    if (replay_nccl_res_ != ncclSuccess) [[unlikely]]                                            \
      ::replay::detail::throw_nccl_error(replay_nccl_res_, ::replay::detail::api_name(#expr),   \
                                         ::replay::detail::format_context(__VA_ARGS__),          \
                                         std::source_location::current());                      \
  } while (false)

namespace replay {

/// NCCL's bootstrap id: made once (rank 0) and given to every rank of the communicator.
class nccl_unique_id {
 public:
  static constexpr std::size_t size = sizeof(ncclUniqueId);

  /// A fresh id (ncclGetUniqueId).
  [[nodiscard]] static nccl_unique_id create() {
    nccl_unique_id id;
    REPLAY_NCCL_CHECK(ncclGetUniqueId(&id.id_));
    return id;
  }
  /// The id received as bytes from rank 0. Throws usage_error on a wrong size.
  [[nodiscard]] static nccl_unique_id from_bytes(std::span<const std::byte> bytes) {
    if (bytes.size() != size)
      throw usage_error(fmt::format("replay::nccl_unique_id::from_bytes: {} bytes, expected {}",
                                    bytes.size(), size));
    nccl_unique_id id;
    std::memcpy(&id.id_, bytes.data(), size);
    return id;
  }
  /// The bytes to send to the other ranks.
  [[nodiscard]] std::span<const std::byte, size> bytes() const noexcept {
    return std::span<const std::byte, size>(reinterpret_cast<const std::byte*>(&id_), size);
  }
  [[nodiscard]] const ncclUniqueId& get() const noexcept { return id_; }

 private:
  nccl_unique_id() = default;
  ncclUniqueId id_{};
};

/// A borrowed communicator: handle, device, rank and size. Copyable; does not own.
class nccl_comm_ref {
 public:
  nccl_comm_ref() = default;
  nccl_comm_ref(ncclComm_t c, int device, int rank, int size) noexcept
      : comm_(c), device_(device), rank_(rank), size_(size) {}
  [[nodiscard]] ncclComm_t get() const noexcept { return comm_; }
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  explicit operator bool() const noexcept { return comm_ != nullptr; }

 protected:
  ncclComm_t comm_ = nullptr;
  int device_ = -1;
  int rank_ = -1;
  int size_ = 0;
};

/// An owning NCCL communicator on one device. Move-only; null when moved from. See the header.
class nccl_comm : public nccl_comm_ref {
 public:
  nccl_comm() = default;

  /// Takes ownership of `c`, which lives on `device` (queried from NCCL).
  explicit nccl_comm(ncclComm_t c) {
    if (c == nullptr) return;
    int device = -1, rank = -1, size = 0;
    const ncclResult_t r1 = ncclCommCuDevice(c, &device);
    const ncclResult_t r2 = r1 == ncclSuccess ? ncclCommUserRank(c, &rank) : r1;
    const ncclResult_t r3 = r2 == ncclSuccess ? ncclCommCount(c, &size) : r2;
    if (r3 != ncclSuccess) {
      (void)ncclCommDestroy(c);
      detail::throw_nccl_error(r3, "ncclCommCuDevice/UserRank/Count", {}, std::source_location::current());
    }
    static_cast<nccl_comm_ref&>(*this) = nccl_comm_ref(c, device, rank, size);
  }

  /// One rank of `nranks` on the current device (every rank calls it with the same id; blocks
  /// until all have joined). One rank per process or per host thread.
  [[nodiscard]] static nccl_comm init_rank(int nranks, const nccl_unique_id& id, int rank) {
    if (nranks < 1 || rank < 0 || rank >= nranks)
      throw usage_error(fmt::format("replay::nccl_comm::init_rank: rank {} of {}", rank, nranks));
    ncclComm_t c = nullptr;
    REPLAY_NCCL_CHECK(ncclCommInitRank(&c, nranks, id.get(), rank), "rank {} of {}", rank, nranks);
    return nccl_comm(c);
  }

  /// One communicator per listed device, rank i on devices[i], from one thread (ncclCommInitAll).
  [[nodiscard]] static std::vector<nccl_comm> init_all(std::span<const int> devices) {
    if (devices.empty()) throw usage_error("replay::nccl_comm::init_all: no devices");
    std::vector<ncclComm_t> raw(devices.size(), nullptr);
    REPLAY_NCCL_CHECK(ncclCommInitAll(raw.data(), static_cast<int>(raw.size()), devices.data()),
                      "{} devices", devices.size());
    std::vector<nccl_comm> out;
    out.reserve(raw.size());
    std::size_t i = 0;
    try {
      for (; i < raw.size(); ++i) out.emplace_back(raw[i]);
    } catch (...) {
      for (std::size_t j = i + 1; j < raw.size(); ++j) (void)ncclCommDestroy(raw[j]);
      throw;
    }
    return out;
  }

  /// A new communicator over the same ranks (ncclCommSplit, same rank order). Collective: every
  /// rank calls it. For agreements, so that they never interleave with the step's collectives.
  [[nodiscard]] nccl_comm split() const {
    require("split");
    ncclComm_t c = nullptr;
    REPLAY_NCCL_CHECK(ncclCommSplit(comm_, 0, rank_, &c, nullptr), "rank {}", rank_);
    return nccl_comm(c);
  }

  nccl_comm(nccl_comm&& o) noexcept : nccl_comm_ref(o) { o.reset_ref(); }
  nccl_comm& operator=(nccl_comm&& o) noexcept {
    if (this != &o) {
      destroy();
      static_cast<nccl_comm_ref&>(*this) = o;
      o.reset_ref();
    }
    return *this;
  }
  nccl_comm(const nccl_comm&) = delete;
  nccl_comm& operator=(const nccl_comm&) = delete;
  ~nccl_comm() { destroy(); }

  /// Aborts the communicator (ncclCommAbort): uncompleted collectives are cancelled. Use after a
  /// rank failed mid-step (lockstep_error). Leaves it null. Never throws: returns ncclCommAbort's
  /// result (ncclSuccess for an empty communicator), for the caller to report; it runs on error
  /// paths that are already rethrowing a root cause.
  [[nodiscard]] ncclResult_t abort() noexcept {
    const ncclResult_t r = comm_ != nullptr ? ncclCommAbort(comm_) : ncclSuccess;
    reset_ref();
    return r;
  }

  /// Releases ownership.
  [[nodiscard]] ncclComm_t release() noexcept {
    ncclComm_t c = comm_;
    reset_ref();
    return c;
  }

  [[nodiscard]] nccl_comm_ref ref() const noexcept { return *this; }

 private:
  void require(const char* what) const {
    if (comm_ == nullptr)
      throw usage_error(fmt::format("replay::nccl_comm::{}: the communicator is empty (moved from?)", what));
  }
  void reset_ref() noexcept { static_cast<nccl_comm_ref&>(*this) = nccl_comm_ref(); }
  void destroy() noexcept {
    if (comm_ != nullptr) (void)ncclCommDestroy(comm_);
    reset_ref();
  }
};

/// Destroys communicators that one thread drives on several devices: finalizes them inside one
/// group (so that no finalize waits for a peer this thread has not reached), then destroys them.
/// Never throws; leaves them null.
inline void destroy_all(std::span<nccl_comm> comms) noexcept {
  (void)ncclGroupStart();
  for (auto& c : comms)
    if (c) (void)ncclCommFinalize(c.get());
  (void)ncclGroupEnd();
  for (auto& c : comms) c = nccl_comm();
}

/// ncclGroupStart/End as a scope, for one thread that issues a collective on several devices.
/// Leave it with end() (throws on failure); a scope left by an exception ends the group in its
/// destructor, ignoring errors. Not copyable or movable.
class nccl_group {
 public:
  nccl_group() { REPLAY_NCCL_CHECK(ncclGroupStart()); }
  ~nccl_group() {
    if (open_) (void)ncclGroupEnd();
  }
  nccl_group(const nccl_group&) = delete;
  nccl_group& operator=(const nccl_group&) = delete;

  /// Ends the group: the collectives issued in it are posted to their streams.
  void end() {
    if (!open_) throw usage_error("replay::nccl_group::end: the group already ended");
    open_ = false;
    REPLAY_NCCL_CHECK(ncclGroupEnd());
  }

 private:
  bool open_ = true;
};

/// The NCCL data type of T (float, double, __half, __nv_bfloat16, int32, int64, uint8...).
template <class T> struct nccl_type;
template <> struct nccl_type<float> { static constexpr ncclDataType_t value = ncclFloat32; };
template <> struct nccl_type<double> { static constexpr ncclDataType_t value = ncclFloat64; };
template <> struct nccl_type<__half> { static constexpr ncclDataType_t value = ncclFloat16; };
#if __has_include(<cuda_bf16.h>)
template <> struct nccl_type<__nv_bfloat16> { static constexpr ncclDataType_t value = ncclBfloat16; };
#endif
template <> struct nccl_type<std::int8_t> { static constexpr ncclDataType_t value = ncclInt8; };
template <> struct nccl_type<std::uint8_t> { static constexpr ncclDataType_t value = ncclUint8; };
template <> struct nccl_type<std::int32_t> { static constexpr ncclDataType_t value = ncclInt32; };
template <> struct nccl_type<std::uint32_t> { static constexpr ncclDataType_t value = ncclUint32; };
template <> struct nccl_type<std::int64_t> { static constexpr ncclDataType_t value = ncclInt64; };
template <> struct nccl_type<std::uint64_t> { static constexpr ncclDataType_t value = ncclUint64; };

namespace detail {

/// Refuses a collective that would break a captured step: a stream of another device, the legacy
/// default stream, or an uncaptured stream while this thread is capturing.
inline void check_collective(const nccl_comm_ref& comm, cudaStream_t s, const char* what) {
  if (!comm)
    throw usage_error(fmt::format("replay::{}: the communicator is empty (moved from?)", what));
  if (s == nullptr)
    throw usage_error(fmt::format("replay::{}: the legacy default stream (0) cannot be captured and "
                                  "serialises every device; pass a replay::stream", what));
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  REPLAY_CHECK(cudaStreamIsCapturing(s, &status));
  if (status == cudaStreamCaptureStatusInvalidated)
    throw usage_error(fmt::format("replay::{}: the stream's capture was already invalidated by an "
                                  "earlier call; the collective would never run", what));
  if (status == cudaStreamCaptureStatusNone && !capturing_streams().empty())
    throw usage_error(fmt::format(
        "replay::{}: this thread is capturing another stream, but the collective goes to an "
        "uncaptured stream: it would run once now while the other ranks run theirs at every "
        "replay; issue it to the capturing stream (or a stream forked into the capture)", what));
  // cudaStreamGetDevice is not permitted while capturing (it would invalidate the capture): then
  // the current device stands in for the stream's.
  const bool capturing = status != cudaStreamCaptureStatusNone;
  int sdev = -1;
  if (capturing) REPLAY_CHECK(cudaGetDevice(&sdev));
  else sdev = stream_device(s);
  if (sdev != comm.device())
    throw usage_error(fmt::format("replay::{}: the {} belongs to device {}, the communicator (rank "
                                  "{}) to device {}", what, capturing ? "current device while capturing" : "stream",
                                  sdev, comm.rank(), comm.device()));
}

}  // namespace detail

/// All-reduce of `count` elements of `type` (in place when send == recv) on `s`, which must belong
/// to the communicator's device. Capturable. Throws usage_error on misuse, nccl_error on failure.
inline void all_reduce(const nccl_comm_ref& comm, const void* send, void* recv, std::size_t count,
                       ncclDataType_t type, ncclRedOp_t op, stream_ref s) {
  detail::check_collective(comm, s.get(), "all_reduce");
  REPLAY_NCCL_CHECK(ncclAllReduce(send, recv, count, type, op, comm.get(), s.get()),
                    "rank {}, {} elements", comm.rank(), count);
}

/// Typed all-reduce: T is float, __nv_bfloat16, __half, an integer type... (see nccl_type).
template <class T>
void all_reduce(const nccl_comm_ref& comm, const T* send, T* recv, std::size_t count, ncclRedOp_t op,
                stream_ref s) {
  all_reduce(comm, static_cast<const void*>(send), static_cast<void*>(recv), count,
             nccl_type<T>::value, op, s);
}

/// All-gather: rank k's `count` elements of `send` land at recv + k * count on every rank (recv
/// holds size() * count elements; send may be recv + rank * count). Same stream checks as
/// all_reduce; capturable. Throws usage_error on misuse, nccl_error on failure.
inline void all_gather(const nccl_comm_ref& comm, const void* send, void* recv, std::size_t count,
                       ncclDataType_t type, stream_ref s) {
  detail::check_collective(comm, s.get(), "all_gather");
  REPLAY_NCCL_CHECK(ncclAllGather(send, recv, count, type, comm.get(), s.get()),
                    "rank {}, {} elements per rank", comm.rank(), count);
}

/// Typed all-gather (see nccl_type).
template <class T>
void all_gather(const nccl_comm_ref& comm, const T* send, T* recv, std::size_t count, stream_ref s) {
  all_gather(comm, static_cast<const void*>(send), static_cast<void*>(recv), count, nccl_type<T>::value, s);
}

namespace detail {

// The state behind nccl_agreement: one int64 on the device, one pinned, a stream.
struct nccl_agreement_state {
  nccl_comm_ref comm;
  cudaStream_t stream = nullptr;
  std::int64_t* dev = nullptr;
  std::int64_t* host = nullptr;

  explicit nccl_agreement_state(nccl_comm_ref c) : comm(c) {
    if (!comm) throw usage_error("replay::nccl_agreement: the communicator is empty");
    const device_scope on(comm.device());
    try {
      REPLAY_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      REPLAY_CHECK(cudaMalloc(reinterpret_cast<void**>(&dev), sizeof(std::int64_t)));
      REPLAY_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host), sizeof(std::int64_t)));
    } catch (...) {
      release();
      throw;
    }
  }
  ~nccl_agreement_state() { release(); }
  nccl_agreement_state(const nccl_agreement_state&) = delete;
  nccl_agreement_state& operator=(const nccl_agreement_state&) = delete;

  void release() noexcept {
    if (stream) (void)check_noexcept(cudaStreamSynchronize(stream));
    if (host) (void)check_noexcept(cudaFreeHost(host));
    if (dev) (void)check_noexcept(cudaFree(dev));
    if (stream) (void)check_noexcept(cudaStreamDestroy(stream));
    host = nullptr;
    dev = nullptr;
    stream = nullptr;
  }

  std::int64_t min(std::int64_t value) {
    if (!capturing_streams().empty())
      throw usage_error("replay::nccl_agreement: called while this thread is capturing; agreements "
                        "happen between steps, never inside one");
    *host = value;
    REPLAY_CHECK(cudaMemcpyAsync(dev, host, sizeof(std::int64_t), cudaMemcpyHostToDevice, stream));
    REPLAY_NCCL_CHECK(ncclAllReduce(dev, dev, 1, ncclInt64, ncclMin, comm.get(), stream),
                      "agreement on rank {}", comm.rank());
    REPLAY_CHECK(cudaMemcpyAsync(host, dev, sizeof(std::int64_t), cudaMemcpyDeviceToHost, stream));
    REPLAY_CHECK(cudaStreamSynchronize(stream));
    return *host;
  }
};

}  // namespace detail

/// The lockstep agreement over `comm`: a blocking one-element ncclMin all-reduce on its own stream.
/// `comm` must outlive the returned function; give it a communicator that no step uses
/// (`comm.split()`). Allocates its buffers now, on the communicator's device.
[[nodiscard]] inline rank_min_function nccl_agreement(nccl_comm_ref comm) {
  auto state = std::make_shared<detail::nccl_agreement_state>(comm);
  return [state](std::int64_t v) { return state->min(v); };
}

}  // namespace replay
