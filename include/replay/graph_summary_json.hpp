// replay/graph_summary_json.hpp: a graph_summary (graph_summary.hpp) as one JSON object: counts by
// node type, the nodes with their kernels, shapes, arguments and fields, and the edges. Written
// with fmt; no JSON library needed to produce it.
#pragma once

#include <replay/detail/pool_json.hpp>
#include <replay/graph_summary.hpp>

#include <fmt/format.h>

#include <string>

namespace replay {

inline std::string graph_summary::to_json() const {
  using detail::json_string;
  std::string s = "{\n  \"counts\": {";
  s += fmt::format("\"nodes\": {}, \"edges\": {}, \"programmatic_edges\": {}", nodes.size(), edges.size(),
                   programmatic_edges);
  for (const auto& [type, n] : counts_by_type()) s += fmt::format(", {}: {}", json_string(type), n);
  s += "},\n  \"nodes\": [";
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const node_info& n = nodes[i];
    s += fmt::format("{}\n    {{\"index\": {}, \"path\": {}, \"type\": {}", i == 0 ? "" : ",", n.index,
                     json_string(n.path), json_string(node_type_name(n.type)));
    if (n.type == cudaGraphNodeTypeKernel)
      s += fmt::format(", \"kernel\": {}, \"grid\": {}, \"block\": {}, \"shared_bytes\": {}, \"params\": {}",
                       json_string(n.kernel), detail::dims(n.grid), detail::dims(n.block), n.shared_bytes,
                       n.args_known ? fmt::format("{}", n.params.size()) : std::string("null"));
    for (const node_field& f : n.fields)
      s += f.address ? fmt::format(", {}: \"{:#x}\"", json_string(f.name), f.value)
                     : fmt::format(", {}: {}", json_string(f.name), f.value);
    if (n.bodies != 0 || !n.bodies_known)
      s += n.bodies_known ? fmt::format(", \"bodies\": {}", n.bodies) : std::string(", \"bodies\": null");
    s += "}";
  }
  s += "\n  ],\n  \"edges\": [";
  for (std::size_t i = 0; i < edges.size(); ++i)
    s += fmt::format("{}\n    {{\"from\": {}, \"to\": {}, \"programmatic\": {}}}", i == 0 ? "" : ",", edges[i].from,
                     edges[i].to, edges[i].programmatic);
  s += "\n  ]\n}\n";
  return s;
}

}  // namespace replay
