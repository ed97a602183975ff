// replay/audit.hpp: the frozen-value audit. Capture a step twice with different step metadata and
// diff the two graphs, so that a per-step value baked into the graph is found before it decodes
// garbage.
//
// A graph freezes every kernel argument, grid and copy size it captured. `audit_step(stream, step,
// stage_a, stage_b)` runs `stage_a()`, captures `step(stream)`, runs `stage_b()`, captures again and
// compares the two graphs node by node in topological order (see inspect.hpp):
// - a kernel argument whose bytes differ is a frozen value: the step passed something per-step
//   (position, token, length) by value, and every replay would reuse the first capture's value;
// - a differing argument that is a CUDA address (device, managed or registered host memory, asked
//   of cudaPointerGetAttributes) is an unstable address: a buffer the step allocates or picks per
//   call, which a replay would keep using after it moved;
// - a different grid, block or dynamic shared memory is a frozen launch shape;
// - nodes present in one capture only (or edges that differ) mean the step's topology depends on
//   per-step values: a replay runs the first capture's kernels whatever the step would do now.
// Memcpy and memset nodes are compared field by field (addresses, sizes, values) in the same way.
// The bodies of conditional nodes (WHILE, IF; a token_loop's step) are compared like the rest; the
// condition handle each capture makes for its own node is not a difference. A body that cannot be
// read is reported as "not compared", and the report is then not clean.
// Stage callables run outside the captures: write step metadata there (step_meta::staging() and
// push(), or a model's own setter), or do eager work. A clean report means the step's graph is the
// same for both sets of values; it cannot see values that are equal in both stagings, so stage
// values that differ in every field (position p and p + 1, another token, another length).
//
// Keep every buffer of both captures alive until the audit returns: an address that was freed and
// reused by the second capture looks stable, and a freed one cannot be recognised as an address.
//
// Guarantees: the report is plain data (printable with fmt, `to_json()` with no JSON dependency).
// Captures are made with capture_scope (exception-safe; a step that throws leaves the stream
// usable and the exception propagates). Nothing is launched: captures do not run the step.
// Thread safety: as capture: one thread per stream.
//
// Example:
//   const replay::audit_report r = replay::audit_step(
//       s, [&](replay::stream_ref cs) { model.record_step(cs); },
//       [&] { meta.push(s, {.token = 7, .pos = 10}); }, [&] { meta.push(s, {.token = 9, .pos = 11}); });
//   if (!r.clean()) fmt::print(stderr, "{}\n", r);   // names kernel, argument index, both values
#pragma once

#include <replay/capture.hpp>
#include <replay/detail/pool_json.hpp>
#include <replay/error.hpp>
#include <replay/graph.hpp>
#include <replay/inspect.hpp>
#include <replay/stream.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

namespace replay {

/// One argument (or a word of one) or copy field whose bytes differ between the two captures.
struct arg_difference {
  std::size_t node = 0;        ///< index in the first capture's node list
  std::string path;            ///< node path (inspect.hpp), e.g. "4" or "7/0/2"
  std::string kernel;          ///< demangled kernel name, or the node type ("memcpy", "memset")
  std::string field;           ///< copy / memset field name; empty for kernel arguments
  std::size_t arg_index = 0;   ///< kernel parameter index
  std::size_t offset = 0;      ///< byte offset of the parameter in the argument buffer
  std::size_t within = 0;      ///< byte offset of the differing word inside the parameter
  std::size_t size = 0;        ///< bytes compared (the parameter, or an 8-byte word of a larger one)
  std::uint64_t a = 0;         ///< value in the first capture (little-endian, zero-extended)
  std::uint64_t b = 0;         ///< value in the second capture

  /// The value as a signed integer of `size` bytes (sizes 1, 2, 4, 8).
  [[nodiscard]] static std::int64_t as_signed(std::uint64_t v, std::size_t size) noexcept {
    switch (size) {
      case 1: return static_cast<std::int8_t>(v);
      case 2: return static_cast<std::int16_t>(v);
      case 4: return static_cast<std::int32_t>(v);
      default: return static_cast<std::int64_t>(v);
    }
  }
};

/// A kernel whose grid, block or dynamic shared memory differs between the captures.
struct launch_difference {
  std::size_t node = 0;
  std::string path;
  std::string kernel;
  std::string what;  ///< "grid", "block" or "shared_bytes"
  std::string a, b;  ///< the two values as text
};

/// A node (or an edge) present in one capture only.
struct topology_difference {
  int capture = 0;          ///< 1 or 2: the capture that has it
  std::size_t node = 0;     ///< index in that capture's node list
  std::string path;
  std::string description;  ///< node type and kernel name, or the edge
};

/// What audit_step / audit_graphs found. Plain data.
struct audit_report {
  std::size_t nodes_a = 0, nodes_b = 0;  ///< nodes of each capture (bodies included)
  std::size_t nodes_compared = 0;        ///< node pairs compared
  std::vector<arg_difference> frozen_values;
  std::vector<arg_difference> unstable_addresses;
  std::vector<launch_difference> launch_changes;
  std::vector<topology_difference> topology;
  /// Work that could not be compared at all: a conditional node whose bodies could not be read.
  /// A report with any is not clean (what it did not see may freeze anything).
  std::vector<std::string> not_compared;
  std::vector<std::string> notes;  ///< what could not be compared (e.g. a kernel without a layout)

  /// True when the two captures are identical in everything compared and nothing was left
  /// uncompared.
  [[nodiscard]] bool clean() const noexcept {
    return frozen_values.empty() && unstable_addresses.empty() && launch_changes.empty() && topology.empty() &&
           not_compared.empty();
  }
  /// The report as one JSON object.
  [[nodiscard]] std::string to_json() const;
};

namespace detail {

/// The signature two nodes must share to be paired: type, kernel, nesting depth.
inline bool same_node(const node_info& a, const node_info& b) noexcept {
  return a.type == b.type && a.func == b.func && a.depth == b.depth && a.kernel == b.kernel;
}

inline std::uint64_t load_le(const std::uint8_t* p, std::size_t n) noexcept {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < n && i < 8; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}

inline std::string node_label(const node_info& n) {
  return n.type == cudaGraphNodeTypeKernel ? n.kernel : std::string(node_type_name(n.type));
}

/// Pairs of indices (i in a, j in b) of a longest common subsequence of node signatures.
inline std::vector<std::pair<std::size_t, std::size_t>> align_nodes(const std::vector<node_info>& a,
                                                                     const std::vector<node_info>& b) {
  const std::size_t n = a.size(), m = b.size();
  std::vector<std::pair<std::size_t, std::size_t>> pairs;
  if (n == m && std::equal(a.begin(), a.end(), b.begin(), same_node)) {
    for (std::size_t i = 0; i < n; ++i) pairs.emplace_back(i, i);
    return pairs;
  }
  std::vector<std::uint32_t> len((n + 1) * (m + 1), 0);
  const auto at = [&](std::size_t i, std::size_t j) -> std::uint32_t& { return len[i * (m + 1) + j]; };
  for (std::size_t i = n; i-- > 0;)
    for (std::size_t j = m; j-- > 0;)
      at(i, j) = same_node(a[i], b[j]) ? at(i + 1, j + 1) + 1 : std::max(at(i + 1, j), at(i, j + 1));
  for (std::size_t i = 0, j = 0; i < n && j < m;) {
    if (same_node(a[i], b[j])) {
      pairs.emplace_back(i, j);
      ++i, ++j;
    } else if (at(i + 1, j) >= at(i, j + 1)) {
      ++i;
    } else {
      ++j;
    }
  }
  return pairs;
}

/// Compares two descriptions. `is_address(v)` says whether a value is a CUDA address (for 8-byte
/// words only). `same` lists 8-byte values that stand for the same thing in both captures (the
/// condition handles each capture made, in creation order): a word that holds the first of a pair
/// in one capture and the second in the other is no difference. Pure function of its arguments:
/// host-testable.
inline audit_report compare_summaries(const graph_summary& ga, const graph_summary& gb,
                                      const std::function<bool(std::uint64_t)>& is_address,
                                      const std::vector<std::pair<std::uint64_t, std::uint64_t>>& same = {}) {
  audit_report r;
  r.nodes_a = ga.nodes.size();
  r.nodes_b = gb.nodes.size();
  const auto pairs = align_nodes(ga.nodes, gb.nodes);
  r.nodes_compared = pairs.size();

  // Nodes in one capture only.
  std::vector<bool> in_a(ga.nodes.size(), false), in_b(gb.nodes.size(), false);
  std::vector<std::size_t> b_of_a(ga.nodes.size(), static_cast<std::size_t>(-1));
  for (const auto& [i, j] : pairs) in_a[i] = in_b[j] = true, b_of_a[i] = j;
  for (std::size_t i = 0; i < ga.nodes.size(); ++i)
    if (!in_a[i])
      r.topology.push_back({1, i, ga.nodes[i].path,
                            fmt::format("{} node {}", node_type_name(ga.nodes[i].type), node_label(ga.nodes[i]))});
  for (std::size_t j = 0; j < gb.nodes.size(); ++j)
    if (!in_b[j])
      r.topology.push_back({2, j, gb.nodes[j].path,
                            fmt::format("{} node {}", node_type_name(gb.nodes[j].type), node_label(gb.nodes[j]))});
  // Edges between paired nodes that only one capture has, compared in the second capture's
  // numbering and reported in the numbering of the capture that has them.
  {
    std::vector<std::size_t> a_of_b(gb.nodes.size(), static_cast<std::size_t>(-1));
    for (const auto& [i, j] : pairs) a_of_b[j] = i;
    using edge_key = std::tuple<std::size_t, std::size_t, bool>;
    std::vector<edge_key> ea, eb;
    for (const edge_info& e : ga.edges)
      if (in_a[e.from] && in_a[e.to]) ea.emplace_back(b_of_a[e.from], b_of_a[e.to], e.programmatic);
    for (const edge_info& e : gb.edges)
      if (in_b[e.from] && in_b[e.to]) eb.emplace_back(e.from, e.to, e.programmatic);
    std::sort(ea.begin(), ea.end());
    std::sort(eb.begin(), eb.end());
    std::vector<edge_key> only_a, only_b;
    std::set_difference(ea.begin(), ea.end(), eb.begin(), eb.end(), std::back_inserter(only_a));
    std::set_difference(eb.begin(), eb.end(), ea.begin(), ea.end(), std::back_inserter(only_b));
    const auto describe = [&](const graph_summary& g, std::size_t f, std::size_t t, bool prog, int which) {
      r.topology.push_back({which, f, g.nodes[f].path,
                            fmt::format("{}edge {} -> {} ({} -> {})", prog ? "programmatic " : "", g.nodes[f].path,
                                        g.nodes[t].path, node_label(g.nodes[f]), node_label(g.nodes[t]))});
    };
    for (const auto& [f, t, prog] : only_a) describe(ga, a_of_b[f], a_of_b[t], prog, 1);
    for (const auto& [f, t, prog] : only_b) describe(gb, f, t, prog, 2);
  }

  const auto classify = [&](arg_difference&& d) {
    const bool addr = d.field.empty() ? (d.size == 8 && (is_address(d.a) || is_address(d.b))) : false;
    (addr ? r.unstable_addresses : r.frozen_values).push_back(std::move(d));
  };

  for (const auto& [i, j] : pairs) {
    const node_info& x = ga.nodes[i];
    const node_info& y = gb.nodes[j];
    if (!x.bodies_known || !y.bodies_known) {
      r.not_compared.push_back(fmt::format("node {} ({}): its bodies could not be read; the work inside them was "
                                           "not compared",
                                           x.path, node_type_name(x.type)));
      continue;
    }
    if (x.type == cudaGraphNodeTypeKernel) {
      const auto shape = [&](const char* what, std::string va, std::string vb) {
        if (va != vb) r.launch_changes.push_back({i, x.path, x.kernel, what, std::move(va), std::move(vb)});
      };
      shape("grid", dims(x.grid), dims(y.grid));
      shape("block", dims(x.block), dims(y.block));
      shape("shared_bytes", std::to_string(x.shared_bytes), std::to_string(y.shared_bytes));
      if (!x.args_known || !y.args_known) {
        r.notes.push_back(fmt::format("node {} ({}): argument layout unavailable; arguments not compared", x.path,
                                      x.kernel));
        continue;
      }
      if (x.params.size() != y.params.size() || x.args.size() != y.args.size()) {
        r.notes.push_back(fmt::format("node {} ({}): argument layouts differ; arguments not compared", x.path,
                                      x.kernel));
        continue;
      }
      for (std::size_t p = 0; p < x.params.size(); ++p) {
        const param_layout& l = x.params[p];
        if (l.offset + l.size > x.args.size()) continue;
        const std::uint8_t* pa = x.args.data() + l.offset;
        const std::uint8_t* pb = y.args.data() + l.offset;
        if (std::memcmp(pa, pb, l.size) == 0) continue;
        // Scalars whole; larger parameters (structs, spans) in 8-byte words.
        const std::size_t word = l.size <= 8 ? l.size : 8;
        for (std::size_t w = 0; w < l.size; w += word) {
          const std::size_t n = std::min(word, l.size - w);
          if (std::memcmp(pa + w, pb + w, n) == 0) continue;
          if (n == 8 && std::find(same.begin(), same.end(), std::pair(load_le(pa + w, 8), load_le(pb + w, 8))) !=
                            same.end())
            continue;
          classify({i, x.path, x.kernel, {}, p, l.offset, w, n, load_le(pa + w, n), load_le(pb + w, n)});
        }
      }
    } else {
      for (std::size_t f = 0; f < x.fields.size() && f < y.fields.size(); ++f) {
        const node_field& fa = x.fields[f];
        const node_field& fb = y.fields[f];
        if (fa.value == fb.value) continue;
        arg_difference d{i, x.path, std::string(node_type_name(x.type)), fa.name, f, 0, 0, 8, fa.value, fb.value};
        (fa.address ? r.unstable_addresses : r.frozen_values).push_back(std::move(d));
      }
    }
  }
  return r;
}

/// True when `v` is an address CUDA knows (device, managed or registered / pinned host memory).
inline bool is_cuda_address(std::uint64_t v) noexcept {
  if (v == 0) return false;
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, reinterpret_cast<const void*>(static_cast<std::uintptr_t>(v)));
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.type != cudaMemoryTypeUnregistered;
}

inline std::string describe_value(std::uint64_t v, std::size_t size) {
  return fmt::format("{:#0{}x} ({})", v, static_cast<int>(2 + 2 * std::min<std::size_t>(size, 8)),
                     arg_difference::as_signed(v, size));
}

inline std::string describe_difference(const arg_difference& d) {
  const std::string where =
      d.field.empty()
          ? fmt::format("argument {} (offset {}{}, {} bytes)", d.arg_index, d.offset,
                        d.within != 0 ? fmt::format(", word at +{}", d.within) : std::string(), d.size)
          : fmt::format("field {}", d.field);
  return fmt::format("node {} {}: {}: {} vs {}", d.path, d.kernel, where, describe_value(d.a, d.size),
                     describe_value(d.b, d.size));
}

}  // namespace detail

/// Compares two captures of the same step (see the header comment). Call it while every buffer
/// either capture references is still allocated.
[[nodiscard]] inline audit_report audit_graphs(const graph& a, const graph& b) {
  // Each capture makes its own condition handles: the i-th of one is the i-th of the other.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> same;
  const detail::conditional_table* ca = a.conditionals();
  const detail::conditional_table* cb = b.conditionals();
  if (ca != nullptr && cb != nullptr && ca->handles.size() == cb->handles.size())
    for (std::size_t i = 0; i < ca->handles.size(); ++i)
      same.emplace_back(ca->handles[i].first, cb->handles[i].first);
  return detail::compare_summaries(inspect(a), inspect(b), &detail::is_cuda_address, same);
}

/// Options of audit_step.
struct audit_options {
  /// Capture mode of both captures (thread-local: capture-unsafe calls of this thread fail).
  capture_mode mode = capture_mode::thread_local_mode;
};

/// Runs `stage_a()`, captures `step(s)`, runs `stage_b()`, captures `step(s)` again and compares
/// the two graphs. Nothing is launched.
template <class Step, class StageA, class StageB>
  requires std::invocable<Step&, stream_ref> && std::invocable<StageA&> && std::invocable<StageB&>
[[nodiscard]] audit_report audit_step(stream_ref s, Step&& step, StageA&& stage_a, StageB&& stage_b,
                                      const audit_options& options = {}) {
  stage_a();
  const graph a = capture(s, step, options.mode);
  stage_b();
  const graph b = capture(s, step, options.mode);
  return audit_graphs(a, b);
}

/// The same with one stage callable taking the variant (0, then 1).
template <class Step, class Stage>
  requires std::invocable<Step&, stream_ref> && std::invocable<Stage&, int>
[[nodiscard]] audit_report audit_step(stream_ref s, Step&& step, Stage&& stage, const audit_options& options = {}) {
  return audit_step(s, step, [&] { stage(0); }, [&] { stage(1); }, options);
}

inline std::string audit_report::to_json() const {
  using detail::json_string;
  const auto diffs = [](const std::vector<arg_difference>& v) {
    std::string s = "[";
    for (std::size_t i = 0; i < v.size(); ++i) {
      const arg_difference& d = v[i];
      s += fmt::format(
          "{}{{\"node\": {}, \"path\": {}, \"kernel\": {}, \"field\": {}, \"arg_index\": {}, \"offset\": {}, "
          "\"within\": {}, \"size\": {}, \"a\": \"{:#x}\", \"b\": \"{:#x}\", \"a_int\": {}, \"b_int\": {}}}",
          i == 0 ? "" : ", ", d.node, json_string(d.path), json_string(d.kernel),
          d.field.empty() ? std::string("null") : json_string(d.field), d.arg_index, d.offset, d.within, d.size, d.a,
          d.b, arg_difference::as_signed(d.a, d.size), arg_difference::as_signed(d.b, d.size));
    }
    return s + "]";
  };
  std::string s = fmt::format("{{\"clean\": {}, \"nodes_a\": {}, \"nodes_b\": {}, \"nodes_compared\": {}", clean(),
                              nodes_a, nodes_b, nodes_compared);
  s += ", \"frozen_values\": " + diffs(frozen_values);
  s += ", \"unstable_addresses\": " + diffs(unstable_addresses);
  s += ", \"launch_changes\": [";
  for (std::size_t i = 0; i < launch_changes.size(); ++i) {
    const launch_difference& d = launch_changes[i];
    s += fmt::format("{}{{\"node\": {}, \"path\": {}, \"kernel\": {}, \"what\": {}, \"a\": {}, \"b\": {}}}",
                     i == 0 ? "" : ", ", d.node, json_string(d.path), json_string(d.kernel), json_string(d.what),
                     json_string(d.a), json_string(d.b));
  }
  s += "], \"topology\": [";
  for (std::size_t i = 0; i < topology.size(); ++i) {
    const topology_difference& d = topology[i];
    s += fmt::format("{}{{\"capture\": {}, \"node\": {}, \"path\": {}, \"description\": {}}}", i == 0 ? "" : ", ",
                     d.capture, d.node, json_string(d.path), json_string(d.description));
  }
  s += "], \"not_compared\": [";
  for (std::size_t i = 0; i < not_compared.size(); ++i) s += (i == 0 ? "" : ", ") + json_string(not_compared[i]);
  s += "], \"notes\": [";
  for (std::size_t i = 0; i < notes.size(); ++i) s += (i == 0 ? "" : ", ") + json_string(notes[i]);
  s += "]}";
  return s;
}

}  // namespace replay

/// Prints an audit report as readable lines: a summary, then one line per finding.
template <>
struct fmt::formatter<replay::audit_report> {
  constexpr auto parse(fmt::format_parse_context& ctx) { return ctx.begin(); }
  template <class Ctx>
  auto format(const replay::audit_report& r, Ctx& ctx) const {
    auto out = ctx.out();
    out = fmt::format_to(out,
                         "replay audit: {} of {}/{} nodes paired; {} frozen value(s), {} unstable address(es), {} "
                         "launch shape change(s), {} topology difference(s), {} not compared{}",
                         r.nodes_compared, r.nodes_a, r.nodes_b, r.frozen_values.size(), r.unstable_addresses.size(),
                         r.launch_changes.size(), r.topology.size(), r.not_compared.size(),
                         r.clean() ? ": clean" : "");
    for (const auto& d : r.frozen_values)
      out = fmt::format_to(out, "\n  frozen value: {}", replay::detail::describe_difference(d));
    for (const auto& d : r.unstable_addresses)
      out = fmt::format_to(out, "\n  unstable address: {}", replay::detail::describe_difference(d));
    for (const auto& d : r.launch_changes)
      out = fmt::format_to(out, "\n  launch shape: node {} {}: {} {} vs {}", d.path, d.kernel, d.what, d.a, d.b);
    for (const auto& d : r.topology)
      out = fmt::format_to(out, "\n  topology: only in capture {}: {} (node {})", d.capture, d.description, d.path);
    for (const auto& n : r.not_compared) out = fmt::format_to(out, "\n  not compared: {}", n);
    for (const auto& n : r.notes) out = fmt::format_to(out, "\n  note: {}", n);
    return out;
  }
};
