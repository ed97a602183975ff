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

#include <replay/detail/conditional_table.hpp>
#include <replay/error.hpp>

#include <cstddef>
#include <memory>
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
  /// graphs that device code launches: a host launch of such an exec is slower.
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
  /// Takes ownership of a captured graph and what its capture recorded about its conditional nodes
  /// (capture_scope::finish()).
  graph(cudaGraph_t g, detail::conditional_table conditionals)
      : g_(g),
        conditionals_(conditionals.nodes.empty() && conditionals.unused_handles() == 0
                          ? nullptr
                          : std::make_shared<const detail::conditional_table>(std::move(conditionals))) {}
  /// Creates a new empty graph (for building graphs by hand).
  [[nodiscard]] static graph create() {
    cudaGraph_t g = nullptr;
    REPLAY_CHECK(cudaGraphCreate(&g, 0));
    return graph(g);
  }

  graph(graph&& o) noexcept : g_(std::exchange(o.g_, nullptr)), conditionals_(std::move(o.conditionals_)) {}
  graph& operator=(graph&& o) noexcept {
    if (this != &o) {
      reset(std::exchange(o.g_, nullptr));
      conditionals_ = std::move(o.conditionals_);
    }
    return *this;
  }
  graph(const graph&) = delete;
  graph& operator=(const graph&) = delete;
  ~graph() { reset(); }

  [[nodiscard]] cudaGraph_t get() const noexcept { return g_; }
  [[nodiscard]] cudaGraph_t release() noexcept {
    conditionals_.reset();
    return std::exchange(g_, nullptr);
  }
  void reset(cudaGraph_t g = nullptr) noexcept {
    if (g_ != nullptr) (void)detail::check_noexcept(cudaGraphDestroy(g_));
    g_ = g;
    conditionals_.reset();
  }
  /// What the capture recorded about the graph's conditional nodes (their bodies, the condition
  /// handles made for it), or nullptr: none, or a graph capture_scope did not make.
  [[nodiscard]] const detail::conditional_table* conditionals() const noexcept { return conditionals_.get(); }
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

  /// One dependency of the graph (top level): `to` runs after `from`. `programmatic` is true for an
  /// edge made by programmatic dependent launch (PDL), where `to` may start before `from` ends.
  struct edge {
    cudaGraphNode_t from = nullptr;
    cudaGraphNode_t to = nullptr;
    bool programmatic = false;
  };
  /// All edges of the graph (top level). Edge types need CUDA 12.3+; older runtimes report none
  /// as programmatic.
  [[nodiscard]] std::vector<edge> edges() const {
    std::size_t n = 0;
    REPLAY_CHECK(get_edges(checked(), nullptr, nullptr, nullptr, &n));
    std::vector<cudaGraphNode_t> from(n), to(n);
    std::vector<edge> out(n);
    if (n == 0) return out;
#if CUDART_VERSION >= 12030
    std::vector<cudaGraphEdgeData> data(n);
    REPLAY_CHECK(get_edges(g_, from.data(), to.data(), data.data(), &n));
#else
    REPLAY_CHECK(get_edges(g_, from.data(), to.data(), nullptr, &n));
#endif
    out.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      out[i].from = from[i];
      out[i].to = to[i];
#if CUDART_VERSION >= 12030
      out[i].programmatic = data[i].type == cudaGraphDependencyTypeProgrammatic ||
                            data[i].from_port == cudaGraphKernelNodePortProgrammatic ||
                            data[i].from_port == cudaGraphKernelNodePortLaunchCompletion;
#endif
    }
    return out;
  }
  /// Number of edges made by programmatic dependent launch (see launch.hpp).
  [[nodiscard]] std::size_t programmatic_edge_count() const {
    std::size_t n = 0;
    for (const edge& e : edges()) n += e.programmatic ? 1 : 0;
    return n;
  }

  /// Writes a Graphviz DOT description of the graph (verbose by default).
  void write_dot(const std::string& path, unsigned flags = cudaGraphDebugDotFlagsVerbose) const {
    REPLAY_CHECK(cudaGraphDebugDotPrint(checked(), path.c_str(), flags), "path {}", path);
  }

  /// A deep copy of the graph (CUDA refuses to clone a graph with conditional nodes).
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
  // cudaGraphGetEdges with edge data: the plain name from CUDA 13, the _v2 name in 12.3..12.x.
  static cudaError_t get_edges(cudaGraph_t g, cudaGraphNode_t* from, cudaGraphNode_t* to,
                               [[maybe_unused]] void* data, std::size_t* n) {
#if CUDART_VERSION >= 13000
    return cudaGraphGetEdges(g, from, to, static_cast<cudaGraphEdgeData*>(data), n);
#elif CUDART_VERSION >= 12030
    return cudaGraphGetEdges_v2(g, from, to, static_cast<cudaGraphEdgeData*>(data), n);
#else
    return cudaGraphGetEdges(g, from, to, n);
#endif
  }

  cudaGraph_t g_ = nullptr;
  std::shared_ptr<const detail::conditional_table> conditionals_;  // shared: graph stays cheap to move
};

}  // namespace replay

#include <replay/graph_exec.hpp>  // completes graph::instantiate
