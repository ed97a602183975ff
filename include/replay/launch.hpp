// replay/launch.hpp: one kernel launch with named options, and programmatic dependent launch (PDL).
//
// `replay::launch(kernel, config, args...)` launches through cudaLaunchKernelExC with the launch
// attributes named in `launch_config`: grid, block, dynamic shared memory, stream, programmatic
// dependent launch (PDL), a thread-block cluster shape and cooperative launch. It checks the launch
// and a failure throws `cuda_error` naming the kernel (demangled where the runtime knows its name).
// Eagerly and under stream capture alike: captured with `pdl = true`, the launch becomes a kernel
// node with a programmatic edge from its predecessor (`graph::programmatic_edge_count()` counts them).
//
// PDL lets a kernel start while its predecessor on the stream is still running. The dependent
// kernel does whatever does not read the predecessor's output (load weights, read step metadata)
// and then calls `replay::pdl::wait()`, which returns once the predecessor has completed and its
// memory is visible. A kernel may call `replay::pdl::launch_dependents()` to let its own dependents
// start early (without it they start when it finishes). Both compile to nothing below sm_90, where
// the launch attribute is ignored and launches simply serialise. A kernel launched with `pdl =
// true` that reads its predecessor's output must call `pdl::wait()` first: that is the contract.
//
// Guarantees: the argument conversion is the one a `<<<...>>>` launch makes (each argument converted
// to the kernel's parameter type). No allocation on the launch path. Thread-safe as CUDA is.
//
// Example:
//   __global__ void scale(const float* x, float* y, float a) {
//     const float w = a * 2.0f;          // independent work before the wait
//     replay::pdl::wait();               // the predecessor's writes of x are visible now
//     y[threadIdx.x] = w * x[threadIdx.x];
//   }
//   replay::launch(scale, {.grid = 1, .block = 256, .stream = s, .pdl = true}, x, y, 0.5f);
#pragma once

#include <replay/error.hpp>
#include <replay/stream.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <source_location>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#if defined(__GNUC__) || defined(__clang__)
#include <cxxabi.h>
#endif

namespace replay {

/// How to launch one kernel. Use designated initialisers; `stream` has no default, so it must be
/// named: `{.grid = blocks, .block = 256, .stream = s, .pdl = true}`.
struct launch_config {
  dim3 grid{1, 1, 1};              ///< blocks in the grid
  dim3 block{1, 1, 1};             ///< threads per block
  std::size_t shared_bytes = 0;    ///< dynamic shared memory per block, in bytes
  stream_ref stream;               ///< where the kernel runs (captured if the stream is capturing)
  bool pdl = false;                ///< programmatic dependent launch: may start before its predecessor ends
  dim3 cluster{0, 0, 0};           ///< thread-block cluster shape; {0,0,0}: no cluster attribute
  bool cooperative = false;        ///< cooperative launch: every block resident at once
  /// Where the configuration was written (named in a launch error); leave it defaulted.
  std::source_location where = std::source_location::current();
};

namespace detail {

/// The demangled name of a kernel, or "<unknown kernel>". Cold path only (error messages).
inline std::string kernel_name(const void* func) noexcept {
  try {
    const char* raw = nullptr;
    if (cudaFuncGetName(&raw, func) != cudaSuccess || raw == nullptr) {
      (void)cudaGetLastError();
      return "<unknown kernel>";
    }
#if defined(__GNUC__) || defined(__clang__)
    int status = 0;
    std::unique_ptr<char, decltype(&std::free)> d(abi::__cxa_demangle(raw, nullptr, nullptr, &status),
                                                  &std::free);
    if (status == 0 && d) return std::string(d.get());
#endif
    return std::string(raw);
  } catch (...) {
    return "<unknown kernel>";
  }
}

/// Fills `attrs` from `c`; returns how many were set.
inline unsigned launch_attributes(const launch_config& c, cudaLaunchAttribute (&attrs)[3]) noexcept {
  unsigned n = 0;
  if (c.pdl) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (c.cluster.x != 0 || c.cluster.y != 0 || c.cluster.z != 0) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = c.cluster.x == 0 ? 1 : c.cluster.x;
    attrs[n].val.clusterDim.y = c.cluster.y == 0 ? 1 : c.cluster.y;
    attrs[n].val.clusterDim.z = c.cluster.z == 0 ? 1 : c.cluster.z;
    ++n;
  }
  if (c.cooperative) {
    attrs[n].id = cudaLaunchAttributeCooperative;
    attrs[n].val.cooperative = 1;
    ++n;
  }
  return n;
}

[[noreturn]] inline void throw_launch_error(cudaError_t err, const void* func, const launch_config& c,
                                            std::source_location where) {
  (void)cudaGetLastError();
  throw cuda_error(err, fmt::format("kernel launch ({})", kernel_name(func)),
                   fmt::format("grid ({},{},{}), block ({},{},{}), {} B shared{}{}{}", c.grid.x, c.grid.y,
                               c.grid.z, c.block.x, c.block.y, c.block.z, c.shared_bytes,
                               c.pdl ? ", PDL" : "",
                               c.cluster.x != 0 ? fmt::format(", cluster ({},{},{})", c.cluster.x,
                                                              c.cluster.y, c.cluster.z)
                                                : std::string(),
                               c.cooperative ? ", cooperative" : ""),
                   current_capture_state(), where);
}

template <class Tuple, std::size_t... I>
void argument_addresses(Tuple& t, void** out, std::index_sequence<I...>) noexcept {
  ((out[I] = const_cast<void*>(static_cast<const void*>(&std::get<I>(t)))), ...);
}

}  // namespace detail

/// Launches `kernel<<<c.grid, c.block, c.shared_bytes, c.stream>>>(args...)` with the PDL, cluster
/// and cooperative attributes of `c`, and checks it. Each argument is converted to the kernel's
/// parameter type first. Throws cuda_error naming the kernel and the configuration on failure.
template <class... Params, class... Args>
  requires(sizeof...(Params) == sizeof...(Args) && (std::is_convertible_v<Args&&, Params> && ...))
void launch(void (*kernel)(Params...), const launch_config& c, Args&&... args) {
  std::tuple<std::remove_cvref_t<Params>...> converted(std::forward<Args>(args)...);
  void* addresses[sizeof...(Params) == 0 ? 1 : sizeof...(Params)] = {};
  detail::argument_addresses(converted, addresses, std::index_sequence_for<Params...>{});
  cudaLaunchAttribute attrs[3];
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = c.grid;
  cfg.blockDim = c.block;
  cfg.dynamicSmemBytes = c.shared_bytes;
  cfg.stream = c.stream.get();
  cfg.attrs = attrs;
  cfg.numAttrs = detail::launch_attributes(c, attrs);
  const void* func = reinterpret_cast<const void*>(kernel);
  const cudaError_t err = cudaLaunchKernelExC(&cfg, func, addresses);
  if (err != cudaSuccess) [[unlikely]]
    detail::throw_launch_error(err, func, c, c.where);
}

}  // namespace replay

#if defined(__CUDACC__)
namespace replay::pdl {

/// Waits until every grid this one depends on programmatically (its predecessor launched with or
/// before it under PDL) has completed and its memory is visible. A no-op below sm_90 and for a
/// kernel launched without PDL (its predecessor has already finished).
__device__ __forceinline__ void wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/// Lets the kernels that depend on this one programmatically be scheduled now (they still wait in
/// pdl::wait() for this grid to complete). A no-op below sm_90.
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace replay::pdl
#endif
