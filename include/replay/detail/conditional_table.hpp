// replay/detail/conditional_table.hpp: what replay knows about the conditional nodes of a graph it
// captured: each node's body graphs and each condition handle created for the graph.
//
// A CUDA 13.0 runtime cannot return the bodies of a conditional node (cudaGraphNodeGetParams reads
// them from 13.1 on), so the inspector and the audit could not look inside a WHILE or IF body. The
// library creates those nodes itself (conditional.hpp), so it records them while the capture runs
// and capture_scope::finish() hands the records to the graph it returns. Recording happens on the
// capturing thread only (a thread-local list, touched at capture time, never on a launch path) and
// only while a capture_scope is open on that thread; a capture that is discarded drops its records.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace replay::detail {

/// One conditional node and the body graphs CUDA made for it (owned by the node).
struct conditional_entry {
  cudaGraphNode_t node = nullptr;
  std::vector<cudaGraph_t> bodies;
};

/// The conditional nodes and condition handles of one captured graph (its bodies included).
struct conditional_table {
  std::vector<conditional_entry> nodes;
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12040
  /// Handles created for the graph, and whether a conditional node uses each.
  std::vector<std::pair<cudaGraphConditionalHandle, bool>> handles;
#endif

  /// The bodies recorded for `node`, or nullptr when the node was not recorded.
  [[nodiscard]] const std::vector<cudaGraph_t>* bodies_of(cudaGraphNode_t node) const noexcept {
    for (const conditional_entry& e : nodes)
      if (e.node == node) return &e.bodies;
    return nullptr;
  }
  /// How many handles were created for the graph but drive no node (instantiation then fails).
  [[nodiscard]] std::size_t unused_handles() const noexcept {
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12040
    return static_cast<std::size_t>(std::count_if(handles.begin(), handles.end(), [](const auto& h) { return !h.second; }));
#else
    return 0;
#endif
  }
};

/// The records of the captures open on this thread. `open` counts open capture_scopes: nothing is
/// recorded without one.
struct conditional_recorder {
  conditional_table table;
  int open = 0;
};
inline conditional_recorder& conditional_records() noexcept {
  thread_local conditional_recorder r;
  return r;
}

/// Where a capture_scope's records start (restored when it discards, cut when it finishes).
struct conditional_mark {
  std::size_t nodes = 0;
  std::size_t handles = 0;
};
inline conditional_mark conditional_begin() noexcept {
  conditional_recorder& r = conditional_records();
  ++r.open;
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12040
  return {r.table.nodes.size(), r.table.handles.size()};
#else
  return {r.table.nodes.size(), 0};
#endif
}
/// Ends a capture_scope's recording: returns its records (finished) or drops them (discarded).
inline conditional_table conditional_end(conditional_mark m, bool keep) {
  conditional_recorder& r = conditional_records();
  conditional_table out;
  if (r.open > 0) --r.open;
  if (m.nodes > r.table.nodes.size()) m.nodes = r.table.nodes.size();
  const auto first = r.table.nodes.begin() + static_cast<std::ptrdiff_t>(m.nodes);
  if (keep) out.nodes.assign(std::make_move_iterator(first), std::make_move_iterator(r.table.nodes.end()));
  r.table.nodes.erase(first, r.table.nodes.end());
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12040
  if (m.handles > r.table.handles.size()) m.handles = r.table.handles.size();
  const auto hfirst = r.table.handles.begin() + static_cast<std::ptrdiff_t>(m.handles);
  if (keep) out.handles.assign(hfirst, r.table.handles.end());
  r.table.handles.erase(hfirst, r.table.handles.end());
#endif
  return out;
}

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12040
/// Records a handle created for the graph being captured.
inline void record_condition(cudaGraphConditionalHandle h) {
  conditional_recorder& r = conditional_records();
  if (r.open > 0) r.table.handles.emplace_back(h, false);
}
/// Records a conditional node, its bodies, and that its handle is used.
inline void record_conditional_node(cudaGraphNode_t node, cudaGraphConditionalHandle h, std::vector<cudaGraph_t> bodies) {
  conditional_recorder& r = conditional_records();
  if (r.open == 0) return;
  for (auto& [handle, used] : r.table.handles)
    if (handle == h) used = true;
  r.table.nodes.push_back({node, std::move(bodies)});
}
#endif

}  // namespace replay::detail
