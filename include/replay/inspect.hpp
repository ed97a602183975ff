// replay/inspect.hpp: reads what a captured graph holds into a graph_summary (graph_summary.hpp),
// which prints as JSON and DOT.
//
// `inspect(graph)` walks a graph in topological order and describes every node: its type, and for
// a kernel node the demangled kernel name, grid, block, dynamic shared memory and the bytes of every
// argument (laid out by cudaFuncGetParamInfo); for a memcpy / memset node its addresses and sizes.
// Child graphs and the bodies of conditional nodes are walked too (the bodies of nodes replay made
// are recorded with the captured graph; others where the runtime can return them, CUDA 13.1+); their nodes carry a path such as "7/0/2" (node 7, body 0, node 2). It counts nodes
// by type and edges, including programmatic (PDL) edges. `to_json()` and `to_dot()` print a summary;
// `write_graph_summary(graph, path)` writes DOT when the path ends in ".dot" and JSON otherwise.
// The audit (audit.hpp) compares two such descriptions.
//
// Kernels another library launched through the driver API (cuBLAS's, for one) are described
// through the driver's entry points (cuGraphKernelNodeGetParams, cuFuncGetName, cuFuncGetParamInfo,
// resolved at run time with cudaGetDriverEntryPoint: nothing links libcuda).
//
// The runtime has no parameter-count query: cudaFuncGetParamInfo is asked for parameters until it
// answers cudaErrorInvalidValue, once per distinct kernel, so compute-sanitizer's
// --report-api-errors lists one expected error per kernel inspected (and one per driver-launched
// kernel node, which the runtime refuses before the driver describes it).
//
// Guarantees: inspecting does not modify or launch the graph. The description is plain data and
// stays valid after the graph is destroyed (argument bytes are copied). Addresses it holds are
// numbers, never dereferenced. Thread safety: as CUDA graphs, one thread per graph at a time.
//
// Example:
//   replay::graph g = replay::capture(s, [&](replay::stream_ref cs) { step(cs); });
//   const replay::graph_summary sum = replay::inspect(g);
//   fmt::print("{} kernels, {} PDL edges\n", sum.count(cudaGraphNodeTypeKernel), sum.programmatic_edges);
//   replay::write_graph_summary(g, "step.json");   // or "step.dot" for Graphviz
#pragma once

#include <replay/error.hpp>
#include <replay/graph_summary.hpp>
#include <replay/graph.hpp>
#include <replay/launch.hpp>

#include <cuda.h>  // driver types only (entry points are resolved at run time; nothing links libcuda)

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

namespace replay {

namespace detail {

/// Nodes of `g` in a topological order (Kahn; ties in cudaGraphGetNodes order, which for a capture
/// is issue order) and its edges as index pairs into that order.
struct ordered_graph {
  std::vector<cudaGraphNode_t> nodes;
  std::vector<edge_info> edges;  // indices into `nodes`
};

inline ordered_graph order_graph(cudaGraph_t h) {
  graph borrowed(h);  // borrow the handle for graph::nodes()/edges(); never destroy it
  struct release_guard {
    graph& g;
    ~release_guard() { (void)g.release(); }
  } guard{borrowed};
  const std::vector<cudaGraphNode_t> raw = borrowed.nodes();
  const std::vector<graph::edge> raw_edges = borrowed.edges();
  std::map<cudaGraphNode_t, std::size_t> pos;
  for (std::size_t i = 0; i < raw.size(); ++i) pos.emplace(raw[i], i);
  std::vector<std::vector<std::size_t>> out(raw.size());
  std::vector<std::size_t> indegree(raw.size(), 0);
  for (const graph::edge& e : raw_edges) {
    const auto f = pos.find(e.from), t = pos.find(e.to);
    if (f == pos.end() || t == pos.end()) continue;
    out[f->second].push_back(t->second);
    ++indegree[t->second];
  }
  // Kahn's algorithm, always taking the ready node that comes first in cudaGraphGetNodes order.
  std::vector<std::size_t> order;
  std::vector<bool> done(raw.size(), false);
  order.reserve(raw.size());
  std::vector<std::size_t> ready;
  for (std::size_t i = 0; i < raw.size(); ++i)
    if (indegree[i] == 0) ready.push_back(i);
  while (!ready.empty()) {
    const auto it = std::min_element(ready.begin(), ready.end());
    const std::size_t n = *it;
    ready.erase(it);
    order.push_back(n);
    done[n] = true;
    for (std::size_t m : out[n])
      if (--indegree[m] == 0) ready.push_back(m);
  }
  for (std::size_t i = 0; i < raw.size(); ++i)  // cycles cannot occur in CUDA graphs; be safe anyway
    if (!done[i]) order.push_back(i);
  std::vector<std::size_t> rank(raw.size());
  ordered_graph og;
  og.nodes.reserve(raw.size());
  for (std::size_t r = 0; r < order.size(); ++r) {
    rank[order[r]] = r;
    og.nodes.push_back(raw[order[r]]);
  }
  for (const graph::edge& e : raw_edges) {
    const auto f = pos.find(e.from), t = pos.find(e.to);
    if (f == pos.end() || t == pos.end()) continue;
    og.edges.push_back({rank[f->second], rank[t->second], e.programmatic});
  }
  std::sort(og.edges.begin(), og.edges.end(), [](const edge_info& a, const edge_info& b) {
    return std::tie(a.from, a.to, a.programmatic) < std::tie(b.from, b.to, b.programmatic);
  });
  return og;
}

/// A kernel's parameter layout; `known` is false when the runtime has none for the function.
struct kernel_layout {
  std::vector<param_layout> params;
  bool known = false;
};

/// Driver entry points for kernel nodes the runtime cannot describe (kernels another library
/// launched through the driver API, such as cuBLAS's): resolved once per inspect() through
/// cudaGetDriverEntryPoint, so nothing links libcuda.
struct driver_kernel_api {
  bool loaded = false;
  CUresult (*node_params)(CUgraphNode, CUDA_KERNEL_NODE_PARAMS*) = nullptr;
  CUresult (*func_name)(const char**, CUfunction) = nullptr;
  CUresult (*func_param_info)(CUfunction, std::size_t, std::size_t*, std::size_t*) = nullptr;
  CUresult (*kernel_name)(const char**, CUkernel) = nullptr;
  CUresult (*kernel_param_info)(CUkernel, std::size_t, std::size_t*, std::size_t*) = nullptr;

  template <class F>
  static void resolve(const char* symbol, [[maybe_unused]] unsigned version, F& fn) noexcept {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, &p, version, cudaEnableDefault, &q);
#else
    const cudaError_t e = cudaGetDriverEntryPoint(symbol, &p, cudaEnableDefault, &q);
#endif
    if (e == cudaSuccess && q == cudaDriverEntryPointSuccess && p != nullptr) fn = reinterpret_cast<F>(p);
    else (void)cudaGetLastError();
  }
  void load() noexcept {
    if (loaded) return;
    loaded = true;
    resolve("cuGraphKernelNodeGetParams", 12000, node_params);
    resolve("cuFuncGetName", 12030, func_name);
    resolve("cuFuncGetParamInfo", 12040, func_param_info);
    resolve("cuKernelGetName", 12030, kernel_name);
    resolve("cuKernelGetParamInfo", 12040, kernel_param_info);
  }
};

/// What inspect() keeps while it walks one graph: layouts per kernel, driver entry points.
struct inspect_context {
  std::map<std::uintptr_t, kernel_layout> layouts;
  driver_kernel_api driver;
  const conditional_table* conditionals = nullptr;  // bodies recorded at capture (graph::conditionals())
};

/// A parameter layout read with `info(i, &offset, &size)` until it fails. The runtime has no
/// parameter-count query, so the last call is expected to fail (one API error per distinct kernel,
/// which compute-sanitizer's --report-api-errors lists). `no_more` is the code that means "index
/// out of range" (no such parameter): any other failure at index 0 means no layout is known.
template <class Info>
kernel_layout read_layout(Info&& info, int no_more) {
  kernel_layout l;
  int stop = 0;
  for (std::size_t i = 0;; ++i) {
    std::size_t offset = 0, size = 0;
    stop = info(i, &offset, &size);
    if (stop != 0) break;
    l.params.push_back({offset, size});
  }
  l.known = !l.params.empty() || stop == no_more;
  return l;
}

/// A kernel node's argument buffer: kernelParams (one pointer per parameter, laid out by `layout`)
/// or the packed `extra` buffer.
inline void read_kernel_args(void** kernel_params, void** extra, const kernel_layout& layout, node_info& n) {
  n.params.clear();
  n.args.clear();
  n.args_known = false;
  if (kernel_params != nullptr) {
    n.params = layout.params;
    std::size_t total = 0;
    for (const param_layout& l : n.params) total = std::max(total, l.offset + l.size);
    n.args.assign(total, 0);
    for (std::size_t i = 0; i < n.params.size(); ++i)
      if (kernel_params[i] != nullptr && n.params[i].size != 0)
        std::memcpy(n.args.data() + n.params[i].offset, kernel_params[i], n.params[i].size);
    n.args_known = layout.known;
    return;
  }
  if (extra != nullptr) {  // {CU_LAUNCH_PARAM_BUFFER_POINTER, buf, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, END}
    const void* buf = nullptr;
    std::size_t size = 0;
    for (void* const* e = extra; *e != nullptr; e += 2) {
      const auto key = reinterpret_cast<std::uintptr_t>(e[0]);
      if (key == 0x01) buf = e[1];
      else if (key == 0x02 && e[1] != nullptr) std::memcpy(&size, e[1], sizeof size);
    }
    if (buf != nullptr) {
      n.args.assign(static_cast<const std::uint8_t*>(buf), static_cast<const std::uint8_t*>(buf) + size);
      n.params.push_back({0, size});  // one opaque block: compared word by word
      n.args_known = true;
    }
  }
}

/// Reads the bodies of a conditional node where the runtime has cudaGraphNodeGetParams (CUDA 13.1+);
/// found by argument-dependent lookup at instantiation, so older runtimes simply report "unknown".
template <class Node>
auto conditional_bodies(Node node, int) -> decltype(cudaGraphNodeGetParams(node, static_cast<cudaGraphNodeParams*>(nullptr)),
                                                    std::vector<cudaGraph_t>()) {
  cudaGraphNodeParams p{};
  if (cudaGraphNodeGetParams(node, &p) != cudaSuccess) {
    (void)cudaGetLastError();
    return {};
  }
  return std::vector<cudaGraph_t>(p.conditional.phGraph_out, p.conditional.phGraph_out + p.conditional.size);
}
template <class Node>
std::vector<cudaGraph_t> conditional_bodies(Node, long) {
  return {};
}
template <class Node>
constexpr auto has_conditional_bodies(int) -> decltype(cudaGraphNodeGetParams(std::declval<Node>(),
                                                                              static_cast<cudaGraphNodeParams*>(nullptr)),
                                                       true) {
  return true;
}
template <class Node>
constexpr bool has_conditional_bodies(long) {
  return false;
}

/// `raw` demangled where the C++ ABI library can (or as it is).
inline std::string demangle(const char* raw) {
  if (raw == nullptr) return "<unknown kernel>";
#if defined(__GNUC__) || defined(__clang__)
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> d(abi::__cxa_demangle(raw, nullptr, nullptr, &status), &std::free);
  if (status == 0 && d) return std::string(d.get());
#endif
  return std::string(raw);
}

/// Describes a kernel node through the driver API; false when the driver cannot either.
inline bool describe_driver_kernel(cudaGraphNode_t node, node_info& n, inspect_context& ctx) {
  ctx.driver.load();
  const driver_kernel_api& d = ctx.driver;
  CUDA_KERNEL_NODE_PARAMS p{};
  if (d.node_params == nullptr || d.node_params(reinterpret_cast<CUgraphNode>(node), &p) != CUDA_SUCCESS) return false;
  const char* raw = nullptr;
  if (p.func != nullptr) {
    n.func = reinterpret_cast<std::uintptr_t>(p.func);
    if (d.func_name != nullptr && d.func_name(&raw, p.func) != CUDA_SUCCESS) raw = nullptr;
  } else {
    n.func = reinterpret_cast<std::uintptr_t>(p.kern);
    if (d.kernel_name != nullptr && d.kernel_name(&raw, p.kern) != CUDA_SUCCESS) raw = nullptr;
  }
  n.kernel = demangle(raw);
  n.grid = {p.gridDimX, p.gridDimY, p.gridDimZ};
  n.block = {p.blockDimX, p.blockDimY, p.blockDimZ};
  n.shared_bytes = p.sharedMemBytes;
  auto it = ctx.layouts.find(n.func);
  if (it == ctx.layouts.end()) {
    kernel_layout l;
    if (p.func != nullptr && d.func_param_info != nullptr)
      l = read_layout([&](std::size_t i, std::size_t* o, std::size_t* sz) { return static_cast<int>(d.func_param_info(p.func, i, o, sz)); },
                      CUDA_ERROR_INVALID_VALUE);
    else if (p.func == nullptr && d.kernel_param_info != nullptr)
      l = read_layout([&](std::size_t i, std::size_t* o, std::size_t* sz) { return static_cast<int>(d.kernel_param_info(p.kern, i, o, sz)); },
                      CUDA_ERROR_INVALID_VALUE);
    it = ctx.layouts.emplace(n.func, std::move(l)).first;
  }
  read_kernel_args(p.kernelParams, p.extra, it->second, n);
  return true;
}

inline void inspect_into(cudaGraph_t h, const std::string& prefix, int depth, graph_summary& out,
                         inspect_context& ctx) {
  const ordered_graph og = order_graph(h);
  const std::size_t base = out.nodes.size();
  // First the nodes of this level (so edge indices are base + rank), then each node's bodies.
  std::vector<std::vector<cudaGraph_t>> bodies(og.nodes.size());
  for (std::size_t r = 0; r < og.nodes.size(); ++r) {
    cudaGraphNode_t node = og.nodes[r];
    node_info n;
    n.path = prefix + std::to_string(r);
    n.depth = depth;
    REPLAY_CHECK(cudaGraphNodeGetType(node, &n.type));
    switch (n.type) {
      case cudaGraphNodeTypeKernel: {
        cudaKernelNodeParams p{};
        const cudaError_t e = cudaGraphKernelNodeGetParams(node, &p);
        if (e != cudaSuccess) {
          // A kernel another library launched through the driver API: the runtime does not know
          // its function; the driver does.
          (void)cudaGetLastError();
          if (e == cudaErrorInvalidDeviceFunction && describe_driver_kernel(node, n, ctx)) break;
          REPLAY_CHECK(e);
        }
        n.func = reinterpret_cast<std::uintptr_t>(p.func);
        n.kernel = kernel_name(p.func);
        n.grid = {p.gridDim.x, p.gridDim.y, p.gridDim.z};
        n.block = {p.blockDim.x, p.blockDim.y, p.blockDim.z};
        n.shared_bytes = p.sharedMemBytes;
        auto it = ctx.layouts.find(n.func);
        if (it == ctx.layouts.end() && p.func != nullptr)
          it = ctx.layouts
                   .emplace(n.func, read_layout(
                                        [&](std::size_t i, std::size_t* o, std::size_t* sz) {
                                          const cudaError_t r = cudaFuncGetParamInfo(p.func, i, o, sz);
                                          if (r != cudaSuccess) (void)cudaGetLastError();
                                          return static_cast<int>(r);
                                        },
                                        cudaErrorInvalidValue))
                   .first;
        if (it != ctx.layouts.end()) read_kernel_args(p.kernelParams, p.extra, it->second, n);
        break;
      }
      case cudaGraphNodeTypeMemcpy: {
        cudaMemcpy3DParms p{};
        REPLAY_CHECK(cudaGraphMemcpyNodeGetParams(node, &p));
        const auto u = [](const void* v) { return static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(v)); };
        n.fields = {{"src", u(p.srcPtr.ptr) + p.srcPos.x, true},
                    {"dst", u(p.dstPtr.ptr) + p.dstPos.x, true},
                    {"width", p.extent.width, false},
                    {"height", p.extent.height, false},
                    {"depth", p.extent.depth, false},
                    {"src_pitch", p.srcPtr.pitch, false},
                    {"dst_pitch", p.dstPtr.pitch, false},
                    {"kind", static_cast<std::uint64_t>(p.kind), false}};
        if (p.srcArray != nullptr || p.dstArray != nullptr)
          n.fields.push_back({"array", u(p.srcArray != nullptr ? static_cast<const void*>(p.srcArray)
                                                               : static_cast<const void*>(p.dstArray)),
                              true});
        break;
      }
      case cudaGraphNodeTypeMemset: {
        cudaMemsetParams p{};
        REPLAY_CHECK(cudaGraphMemsetNodeGetParams(node, &p));
        n.fields = {{"dst", static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p.dst)), true},
                    {"value", p.value, false},
                    {"element_size", p.elementSize, false},
                    {"width", p.width, false},
                    {"height", p.height, false},
                    {"pitch", p.pitch, false}};
        break;
      }
      case cudaGraphNodeTypeGraph: {
        cudaGraph_t child = nullptr;
        REPLAY_CHECK(cudaGraphChildGraphNodeGetGraph(node, &child));
        bodies[r].push_back(child);
        n.bodies = 1;
        break;
      }
#if CUDART_VERSION >= 12040
      case cudaGraphNodeTypeConditional: {
        // The bodies replay recorded when it made the node, else what the runtime can return.
        const std::vector<cudaGraph_t>* recorded =
            ctx.conditionals != nullptr ? ctx.conditionals->bodies_of(node) : nullptr;
        n.bodies_known = recorded != nullptr || has_conditional_bodies<cudaGraphNode_t>(0);
        bodies[r] = recorded != nullptr ? *recorded : conditional_bodies(node, 0);
        n.bodies = bodies[r].size();
        break;
      }
#endif
      default: break;
    }
    n.index = out.nodes.size();
    out.nodes.push_back(std::move(n));
  }
  for (const edge_info& e : og.edges) {
    out.edges.push_back({base + e.from, base + e.to, e.programmatic});
    out.programmatic_edges += e.programmatic ? 1 : 0;
  }
  for (std::size_t r = 0; r < og.nodes.size(); ++r)
    for (std::size_t b = 0; b < bodies[r].size(); ++b)
      if (bodies[r][b] != nullptr)
        inspect_into(bodies[r][b], prefix + std::to_string(r) + "/" + std::to_string(b) + "/", depth + 1, out,
                     ctx);
}


}  // namespace detail

/// Describes every node and edge of `g` (bodies of child and conditional nodes included).
/// Throws cuda_error if CUDA cannot describe a node, usage_error on an empty graph.
[[nodiscard]] inline graph_summary inspect(const graph& g) {
  graph_summary s;
  detail::inspect_context ctx;
  ctx.conditionals = g.conditionals();
  detail::inspect_into(g.checked(), "", 0, s, ctx);
  return s;
}

/// Writes `inspect(g)` to `path`: DOT when the path ends in ".dot", JSON otherwise. Throws
/// std::runtime_error when the file cannot be written.
inline void write_graph_summary(const graph& g, const std::string& path) {
  const graph_summary s = inspect(g);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) throw std::runtime_error(fmt::format("replay::write_graph_summary: cannot open {}", path));
  f << (path.ends_with(".dot") ? s.to_dot() : s.to_json());
  if (!f) throw std::runtime_error(fmt::format("replay::write_graph_summary: cannot write {}", path));
}

}  // namespace replay
