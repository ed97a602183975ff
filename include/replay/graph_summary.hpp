// replay/graph_summary.hpp: what a graph holds, node by node, as plain data (inspect.hpp fills it).
//
// A `graph_summary` lists every node of a graph in topological order, bodies of child and
// conditional nodes after their node (with paths such as "7/0/2": node 7, body 0, node 2), and the
// edges between them, programmatic (PDL) edges marked. Kernel nodes carry the kernel's name, grid,
// block, dynamic shared memory and argument bytes; memcpy / memset nodes their fields. It prints
// as JSON (graph_summary_json.hpp) and Graphviz DOT (graph_summary_dot.hpp); the audit (audit.hpp)
// compares two of them.
//
// Guarantees: plain data; addresses it holds are numbers, never dereferenced; it stays valid after
// the graph it describes is destroyed. Thread safety: as any value type.
//
// Example:
//   const replay::graph_summary sum = replay::inspect(g);
//   fmt::print("{} kernels, {} PDL edges\n", sum.count(cudaGraphNodeTypeKernel), sum.programmatic_edges);
#pragma once

#include <cuda_runtime_api.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace replay {

/// One scalar field of a non-kernel node (memcpy / memset), e.g. {"dst", 0x7f..., true}.
struct node_field {
  std::string name;
  std::uint64_t value = 0;
  bool address = false;  ///< the field is a memory address (compared as one by the audit)
};

/// One kernel parameter: where it sits in the argument buffer and how large it is.
struct param_layout {
  std::size_t offset = 0;
  std::size_t size = 0;
};

/// One node of a graph (plain data).
struct node_info {
  std::size_t index = 0;           ///< position in the flattened, topologically ordered list
  std::string path;                ///< "3" at top level, "7/0/2" inside body 0 of node 7
  int depth = 0;                   ///< 0 at top level
  cudaGraphNodeType type = cudaGraphNodeTypeEmpty;
  // Kernel nodes.
  std::uintptr_t func = 0;         ///< the kernel's function handle (identity, not dereferenced)
  std::string kernel;              ///< demangled name ("<unknown kernel>" if the runtime has none)
  std::array<unsigned, 3> grid{};  ///< grid dimensions
  std::array<unsigned, 3> block{}; ///< block dimensions
  unsigned shared_bytes = 0;       ///< dynamic shared memory per block
  bool args_known = false;         ///< the argument layout was available (params / args valid)
  std::vector<param_layout> params;
  std::vector<std::uint8_t> args;  ///< the argument buffer: param i at params[i].offset
  // Memcpy / memset nodes (and the body count of child / conditional nodes).
  std::vector<node_field> fields;
  std::size_t bodies = 0;          ///< child graphs of a graph or conditional node
  bool bodies_known = true;        ///< false for a conditional node whose bodies can't be read
};

/// One dependency between two nodes of the same (sub)graph, as indices into graph_summary::nodes.
struct edge_info {
  std::size_t from = 0;
  std::size_t to = 0;
  bool programmatic = false;  ///< made by programmatic dependent launch
};

/// Everything inspect() found. Plain data.
struct graph_summary {
  std::vector<node_info> nodes;  ///< topological order per (sub)graph; bodies follow their node
  std::vector<edge_info> edges;
  std::size_t programmatic_edges = 0;

  /// Nodes of `type`, bodies included.
  [[nodiscard]] std::size_t count(cudaGraphNodeType type) const noexcept {
    return static_cast<std::size_t>(
        std::count_if(nodes.begin(), nodes.end(), [&](const node_info& n) { return n.type == type; }));
  }
  /// Node counts by type name ("kernel", "memcpy", ...), bodies included.
  [[nodiscard]] std::map<std::string, std::size_t> counts_by_type() const;
  [[nodiscard]] std::string to_json() const;
  [[nodiscard]] std::string to_dot() const;
};

/// The short name of a node type: "kernel", "memcpy", "memset", "host", "graph", "empty",
/// "wait_event", "event_record", "ext_semaphore_signal", "ext_semaphore_wait", "mem_alloc",
/// "mem_free", "conditional".
constexpr std::string_view node_type_name(cudaGraphNodeType t) noexcept {
  switch (t) {
    case cudaGraphNodeTypeKernel: return "kernel";
    case cudaGraphNodeTypeMemcpy: return "memcpy";
    case cudaGraphNodeTypeMemset: return "memset";
    case cudaGraphNodeTypeHost: return "host";
    case cudaGraphNodeTypeGraph: return "graph";
    case cudaGraphNodeTypeEmpty: return "empty";
    case cudaGraphNodeTypeWaitEvent: return "wait_event";
    case cudaGraphNodeTypeEventRecord: return "event_record";
    case cudaGraphNodeTypeExtSemaphoreSignal: return "ext_semaphore_signal";
    case cudaGraphNodeTypeExtSemaphoreWait: return "ext_semaphore_wait";
    case cudaGraphNodeTypeMemAlloc: return "mem_alloc";
    case cudaGraphNodeTypeMemFree: return "mem_free";
#if CUDART_VERSION >= 12040
    case cudaGraphNodeTypeConditional: return "conditional";
#endif
    default: return "other";
  }
}

namespace detail {
inline std::string dims(const std::array<unsigned, 3>& d) { return fmt::format("[{},{},{}]", d[0], d[1], d[2]); }
}  // namespace detail

inline std::map<std::string, std::size_t> graph_summary::counts_by_type() const {
  std::map<std::string, std::size_t> m;
  for (const node_info& n : nodes) ++m[std::string(node_type_name(n.type))];
  return m;
}

}  // namespace replay

#include <replay/graph_summary_dot.hpp>   // defines graph_summary::to_dot
#include <replay/graph_summary_json.hpp>  // defines graph_summary::to_json
