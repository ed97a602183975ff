// replay/graph_summary_dot.hpp: a graph_summary (graph_summary.hpp) as Graphviz DOT: one box per
// node, solid edges for dependencies, dashed for programmatic (PDL) ones, dotted from a
// conditional or child node to each of its bodies.
#pragma once

#include <replay/graph_summary.hpp>

#include <fmt/format.h>

#include <string>

namespace replay {

inline std::string graph_summary::to_dot() const {
  const auto escape = [](std::string_view v) {
    std::string o;
    for (char c : v) {
      if (c == '"' || c == '\\') o += '\\';
      o += c;
    }
    return o;
  };
  std::string s = "digraph replay_graph {\n  node [shape=box, fontname=\"monospace\", fontsize=10];\n";
  for (const node_info& n : nodes) {
    std::string label = fmt::format("{}: {}", n.path, node_type_name(n.type));
    if (n.type == cudaGraphNodeTypeKernel) {
      std::string name = n.kernel;
      if (name.size() > 60) name = name.substr(0, 57) + "...";
      label = fmt::format("{}: {}\\ngrid {} block {} smem {}", n.path, escape(name), detail::dims(n.grid),
                          detail::dims(n.block), n.shared_bytes);
    } else {
      for (const node_field& f : n.fields)
        if (f.name == "width" || f.name == "value") label += fmt::format("\\n{} {}", f.name, f.value);
    }
    s += fmt::format("  n{} [label=\"{}\"{}];\n", n.index, label,
                     n.type == cudaGraphNodeTypeKernel ? "" : ", style=rounded");
  }
  for (const edge_info& e : edges)
    s += fmt::format("  n{} -> n{}{};\n", e.from, e.to, e.programmatic ? " [style=dashed, label=\"PDL\"]" : "");
  // Bodies: a dotted edge from the owning node to the first node of each body.
  for (const node_info& n : nodes) {
    if (n.depth == 0) continue;
    const auto cut = n.path.rfind('/');
    const std::string body = n.path.substr(0, cut);
    const std::string owner = body.substr(0, body.rfind('/'));
    if (n.path.substr(cut + 1) != "0") continue;
    for (const node_info& o : nodes)
      if (o.path == owner)
        s += fmt::format("  n{} -> n{} [style=dotted, label=\"body {}\"];\n", o.index, n.index,
                         body.substr(body.rfind('/') + 1));
  }
  s += "}\n";
  return s;
}

}  // namespace replay
