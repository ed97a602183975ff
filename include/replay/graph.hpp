// replay/graph.hpp: an owning CUDA graph (the captured, not yet executable form).
//
// A `graph` is what a capture produces (see capture.hpp). It can be inspected (node counts, DOT
// dump), cloned, and instantiated into a `graph_exec` (graph_exec.hpp) with named options.
// Move-only; a moved-from graph is empty and every operation on it throws usage_error.
//
// Thread safety: CUDA graph objects are not thread-safe; do not use one graph from two threads at
// once. Destroying a graph after instantiation is fine: the graph_exec does not depend on it.
//
// Example:
//   replay::graph g = replay::capture(s, [&](replay::stream_ref cs) { step(cs); });
//   fmt::print("{} nodes, {} kernels\n", g.node_count(), g.kernel_node_count());
//   replay::graph_exec exec = g.instantiate({.upload_stream = s.get()});
#pragma once

#include <replay/error.hpp>

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace replay {

class graph_exec;

/// Named instantiate options (no bare booleans). Use designated initialisers:
/// `g.instantiate({.auto_free_on_launch = true, .upload_stream = s.get()})`.
struct instantiate_options {
  /// Free memory allocated by graph allocation nodes before each relaunch.
  bool auto_free_on_launch = false;
  /// Run with per-node priorities instead of the launching stream's priority.
  bool use_node_priority = false;
  /// Make the exec launchable from device code (cannot combine with auto_free_on_launch). Only for
  /// graphs that device code launches: a host launch of such an exec is slower (the NanoGPT
  /// example's 10-kernel step on an H200: 18.2-18.9 instead of 15.3-15.9 us).
  bool device_launch = false;
  /// When set, the exec is uploaded to the device on this stream as part of instantiation, so the
  /// first launch does not pay for it.
  cudaStream_t upload_stream = nullptr;
  bool upload = false;  ///< upload on `upload_stream` (implied when upload_stream is set)
};

/// An owning cudaGraph_t. Move-only; moved-from state is empty.
class graph {
 public:
  graph() noexcept = default;
  /// Takes ownership of a graph handle (e.g. from cudaStreamEndCapture).
  explicit graph(cudaGraph_t g) noexcept : g_(g) {}
  /// Creates a new empty graph (for building graphs by hand).
  [[nodiscard]] static graph create() {
    cudaGraph_t g = nullptr;
    REPLAY_CHECK(cudaGraphCreate(&g, 0));
    return graph(g);
  }

  graph(graph&& o) noexcept : g_(std::exchange(o.g_, nullptr)) {}
  graph& operator=(graph&& o) noexcept {
    if (this != &o) reset(std::exchange(o.g_, nullptr));
    return *this;
  }
  graph(const graph&) = delete;
  graph& operator=(const graph&) = delete;
  ~graph() { reset(); }

  [[nodiscard]] cudaGraph_t get() const noexcept { return g_; }
  [[nodiscard]] cudaGraph_t release() noexcept { return std::exchange(g_, nullptr); }
  void reset(cudaGraph_t g = nullptr) noexcept {
    if (g_ != nullptr) (void)detail::check_noexcept(cudaGraphDestroy(g_));
    g_ = g;
  }
  explicit operator bool() const noexcept { return g_ != nullptr; }
  [[nodiscard]] bool empty() const noexcept { return g_ == nullptr; }

  /// All nodes of the graph (top level).
  [[nodiscard]] std::vector<cudaGraphNode_t> nodes() const {
    std::size_t n = 0;
    REPLAY_CHECK(cudaGraphGetNodes(checked(), nullptr, &n));
    std::vector<cudaGraphNode_t> out(n);
    if (n != 0) REPLAY_CHECK(cudaGraphGetNodes(g_, out.data(), &n));
    out.resize(n);
    return out;
  }
  [[nodiscard]] std::size_t node_count() const {
    std::size_t n = 0;
    REPLAY_CHECK(cudaGraphGetNodes(checked(), nullptr, &n));
    return n;
  }
  /// Number of nodes of the given type.
  [[nodiscard]] std::size_t count_nodes(cudaGraphNodeType type) const {
    std::size_t n = 0;
    for (cudaGraphNode_t node : nodes()) {
      cudaGraphNodeType t{};
      REPLAY_CHECK(cudaGraphNodeGetType(node, &t));
      n += (t == type) ? 1 : 0;
    }
    return n;
  }
  [[nodiscard]] std::size_t kernel_node_count() const { return count_nodes(cudaGraphNodeTypeKernel); }

  /// Writes a Graphviz DOT description of the graph (verbose by default).
  void write_dot(const std::string& path, unsigned flags = cudaGraphDebugDotFlagsVerbose) const {
    REPLAY_CHECK(cudaGraphDebugDotPrint(checked(), path.c_str(), flags), "path {}", path);
  }

  /// A deep copy of the graph.
  [[nodiscard]] graph clone() const {
    cudaGraph_t c = nullptr;
    REPLAY_CHECK(cudaGraphClone(&c, checked()));
    return graph(c);
  }

  /// Instantiates an executable graph (defined in graph_exec.hpp).
  [[nodiscard]] graph_exec instantiate(const instantiate_options& options = {}) const;

  /// The handle, or usage_error when the graph is empty.
  [[nodiscard]] cudaGraph_t checked() const {
    if (g_ == nullptr) throw usage_error("replay::graph: use of an empty (moved-from) graph");
    return g_;
  }

 private:
  cudaGraph_t g_ = nullptr;
};

}  // namespace replay

#include <replay/graph_exec.hpp>  // completes graph::instantiate
