// replay/graph_exec.hpp: an owning executable graph.
//
// `graph_exec` launches (replays) an instantiated graph, uploads it ahead of the first launch, and
// updates it in place from a new capture of the same topology with `update(graph)`. When the update
// is impossible (topology or node type changed, ...) it reports the failing node and the reason,
// and re-instantiates from the new graph, so the exec always runs the graph it was last given.
//
// Guarantees: move-only; a moved-from or default-constructed exec is empty and launch/upload/update
// on it throw usage_error. Launch is as cheap as cudaGraphLaunch plus one null check. Not
// thread-safe: serialise use of one exec (CUDA forbids concurrent launches of the same exec anyway).
// Every device address the graph captured must stay valid while the exec may be launched.
//
// Example:
//   replay::graph_exec exec = g.instantiate();
//   exec.upload(s);
//   for (int t = 0; t < n; ++t) { meta.push(s); exec.launch(s); }
//   auto r = exec.update(replay::capture(s, step));   // new parameters, same topology
//   if (!r) fmt::print("re-instantiated: {}\n", r.message);
#pragma once

#include <replay/error.hpp>
#include <replay/graph.hpp>
#include <replay/nvtx.hpp>
#include <replay/stream.hpp>

#include <source_location>
#include <string>
#include <string_view>
#include <utility>

namespace replay {

/// A readable name for a cudaGraphExecUpdateResult.
constexpr std::string_view to_string(cudaGraphExecUpdateResult r) noexcept {
  switch (r) {
    case cudaGraphExecUpdateSuccess: return "success";
    case cudaGraphExecUpdateError: return "error";
    case cudaGraphExecUpdateErrorTopologyChanged: return "topology changed";
    case cudaGraphExecUpdateErrorNodeTypeChanged: return "node type changed";
    case cudaGraphExecUpdateErrorFunctionChanged: return "kernel function changed";
    case cudaGraphExecUpdateErrorParametersChanged: return "parameters changed in an unsupported way";
    case cudaGraphExecUpdateErrorNotSupported: return "node not supported for update";
    case cudaGraphExecUpdateErrorUnsupportedFunctionChange: return "unsupported kernel function change";
    case cudaGraphExecUpdateErrorAttributesChanged: return "node attributes changed";
  }
  return "unknown";
}

/// A readable name for a graph node type.
constexpr std::string_view to_string(cudaGraphNodeType t) noexcept {
  switch (t) {
    case cudaGraphNodeTypeKernel: return "kernel";
    case cudaGraphNodeTypeMemcpy: return "memcpy";
    case cudaGraphNodeTypeMemset: return "memset";
    case cudaGraphNodeTypeHost: return "host";
    case cudaGraphNodeTypeGraph: return "child graph";
    case cudaGraphNodeTypeEmpty: return "empty";
    case cudaGraphNodeTypeWaitEvent: return "wait event";
    case cudaGraphNodeTypeEventRecord: return "event record";
    case cudaGraphNodeTypeMemAlloc: return "mem alloc";
    case cudaGraphNodeTypeMemFree: return "mem free";
    case cudaGraphNodeTypeConditional: return "conditional";
    default: return "other";
  }
}

/// What graph_exec::update() did.
struct update_result {
  bool updated = false;         ///< the exec was updated in place (cheap path)
  bool reinstantiated = false;  ///< the update was impossible and the exec was rebuilt
  cudaGraphExecUpdateResult reason = cudaGraphExecUpdateSuccess;  ///< why an update failed
  cudaGraphNode_t error_node = nullptr;  ///< the node in the new graph that could not be updated
  std::string message;                   ///< human-readable: reason and failing node
  explicit operator bool() const noexcept { return updated; }
};

/// An owning cudaGraphExec_t. Move-only; moved-from state is empty.
class graph_exec {
 public:
  graph_exec() noexcept = default;
  explicit graph_exec(cudaGraphExec_t e) noexcept : e_(e) {}
  /// Takes ownership of `e`, remembering the options it was instantiated with (update() keeps them).
  graph_exec(cudaGraphExec_t e, const instantiate_options& options) noexcept : e_(e), options_(options) {}

  /// Instantiates `g` with the given options.
  static graph_exec instantiate(const graph& g, const instantiate_options& options = {}) {
    unsigned long long flags = 0;
    if (options.auto_free_on_launch) flags |= cudaGraphInstantiateFlagAutoFreeOnLaunch;
    if (options.use_node_priority) flags |= cudaGraphInstantiateFlagUseNodePriority;
    if (options.device_launch) flags |= cudaGraphInstantiateFlagDeviceLaunch;
    const bool upload = options.upload || options.upload_stream != nullptr;
    if (upload) flags |= cudaGraphInstantiateFlagUpload;
    cudaGraphInstantiateParams params{};
    params.flags = flags;
    params.uploadStream = options.upload_stream;
    cudaGraphExec_t e = nullptr;
    const cudaError_t err = cudaGraphInstantiateWithParams(&e, g.checked(), &params);
    if (err != cudaSuccess) {
      const char* why = "";
      switch (params.result_out) {
        case cudaGraphInstantiateInvalidStructure: why = "invalid structure (e.g. a cycle)"; break;
        case cudaGraphInstantiateNodeOperationNotSupported: why = "a node operation is not supported"; break;
        case cudaGraphInstantiateMultipleDevicesNotSupported: why = "nodes on several devices"; break;
        default: break;
      }
      std::string context = why;
      // CUDA answers "invalid argument" for a condition handle that drives no conditional node.
      const detail::conditional_table* conds = g.conditionals();
      if (err == cudaErrorInvalidValue && conds != nullptr && conds->unused_handles() != 0)
        context = fmt::format("{} condition(s) made for this graph (replay::make_condition) drive no "
                              "conditional node; CUDA refuses to instantiate a graph with an unused "
                              "condition: pass each one to if_then / while_loop, or do not make it",
                              conds->unused_handles());
      detail::throw_cuda_error(err, "cudaGraphInstantiateWithParams", context, std::source_location::current());
    }
    return graph_exec(e, options);
  }

  graph_exec(graph_exec&& o) noexcept
      : e_(std::exchange(o.e_, nullptr)), options_(std::exchange(o.options_, {})) {}
  graph_exec& operator=(graph_exec&& o) noexcept {
    if (this != &o) {
      reset(std::exchange(o.e_, nullptr));
      options_ = std::exchange(o.options_, {});
    }
    return *this;
  }
  graph_exec(const graph_exec&) = delete;
  graph_exec& operator=(const graph_exec&) = delete;
  ~graph_exec() { reset(); }

  [[nodiscard]] cudaGraphExec_t get() const noexcept { return e_; }
  [[nodiscard]] cudaGraphExec_t release() noexcept { return std::exchange(e_, nullptr); }
  void reset(cudaGraphExec_t e = nullptr) noexcept {
    if (e_ != nullptr) (void)detail::check_noexcept(cudaGraphExecDestroy(e_));
    e_ = e;
  }
  explicit operator bool() const noexcept { return e_ != nullptr; }
  [[nodiscard]] bool empty() const noexcept { return e_ == nullptr; }

  /// Replays the graph on `s`. Asynchronous; errors of the launch itself throw cuda_error.
  void launch(stream_ref s) const { REPLAY_CHECK(cudaGraphLaunch(checked("launch"), s.get())); }

  /// Uploads the exec's work descriptors to the device on `s`, so the first launch is not slower.
  void upload(stream_ref s) const {
    const nvtx_range range("upload");
    REPLAY_CHECK(cudaGraphUpload(checked("upload"), s.get()));
  }

  /// The options the exec was instantiated with (default for an adopted handle).
  [[nodiscard]] const instantiate_options& options() const noexcept { return options_; }

  /// Updates the exec from `g` (same topology, new parameters) with cudaGraphExecUpdate. When CUDA
  /// refuses, the result names the reason and the failing node, and the exec is re-instantiated
  /// from `g` with the options it was instantiated with (flags and upload; the upload stream given
  /// then must still exist). Either way, the next launch runs `g`.
  update_result update(const graph& g) { return update(g, options_); }
  /// As update(g), re-instantiating with `options` when an in-place update is impossible.
  update_result update(const graph& g, const instantiate_options& options) {
    const nvtx_range range("update");
    checked("update");
    cudaGraphExecUpdateResultInfo info{};
    const cudaError_t err = cudaGraphExecUpdate(e_, g.checked(), &info);
    update_result r;
    r.reason = info.result;
    r.error_node = info.errorNode;
    if (err == cudaSuccess) {
      r.updated = true;
      r.message = "updated in place";
      return r;
    }
    if (err != cudaErrorGraphExecUpdateFailure)
      detail::throw_cuda_error(err, "cudaGraphExecUpdate", {}, std::source_location::current());
    (void)cudaGetLastError();  // the failure is reported in the result, not left for the next check
    r.message = fmt::format("cudaGraphExecUpdate refused: {}", to_string(info.result));
    if (info.errorNode != nullptr) {
      cudaGraphNodeType t{};
      if (cudaGraphNodeGetType(info.errorNode, &t) == cudaSuccess)
        r.message += fmt::format("; failing node {} ({})", static_cast<const void*>(info.errorNode),
                                 to_string(t));
    }
    *this = instantiate(g, options);
    r.reinstantiated = true;
    r.message += "; re-instantiated";
    return r;
  }

 private:
  cudaGraphExec_t checked(const char* what) const {
    if (e_ == nullptr)
      throw usage_error(fmt::format("replay::graph_exec::{}: the exec is empty (moved-from or never "
                                    "instantiated)", what));
    return e_;
  }
  cudaGraphExec_t e_ = nullptr;
  instantiate_options options_{};
};

inline graph_exec graph::instantiate(const instantiate_options& options) const {
  return graph_exec::instantiate(*this, options);
}

}  // namespace replay
