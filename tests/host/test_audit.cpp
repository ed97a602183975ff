// Host tests of the frozen-value audit's comparison (no GPU): argument diffs by layout, address
// classification, launch shapes, nodes and edges present in one capture only, the report's formats.
#include <doctest/doctest.h>
#include <replay/audit.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

using replay::graph_summary;
using replay::node_info;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// A kernel node with parameters of the given sizes (naturally aligned) holding `values`.
node_info kernel(std::uintptr_t func, std::string name, std::vector<std::size_t> sizes,
                 std::vector<std::uint64_t> values) {
  node_info n;
  n.type = cudaGraphNodeTypeKernel;
  n.func = func;
  n.kernel = std::move(name);
  n.grid = {1, 1, 1};
  n.block = {128, 1, 1};
  n.args_known = true;
  std::size_t off = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const std::size_t align = sizes[i] >= 8 ? 8 : sizes[i];
    off = (off + align - 1) / align * align;
    n.params.push_back({off, sizes[i]});
    n.args.resize(off + sizes[i], 0);
    std::memcpy(n.args.data() + off, &values[i], std::min<std::size_t>(sizes[i], 8));
    off += sizes[i];
  }
  return n;
}

graph_summary chain(std::vector<node_info> nodes) {
  graph_summary g;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    nodes[i].index = i;
    nodes[i].path = std::to_string(i);
    if (i > 0) g.edges.push_back({i - 1, i, false});
  }
  g.nodes = std::move(nodes);
  return g;
}

// Addresses in this test live at 0x7f00'0000'0000 and above.
bool fake_address(std::uint64_t v) { return v >= 0x7f0000000000ull; }

constexpr std::uint64_t buf_a = 0x7f0000001000ull, buf_b = 0x7f0000002000ull;

}  // namespace

TEST_CASE("identical captures are clean") {
  const auto g = chain({kernel(1, "embed(int const*, float*)", {8, 8}, {buf_a, buf_b}),
                        kernel(2, "head(float const*)", {8}, {buf_b})});
  const auto r = replay::detail::compare_summaries(g, g, fake_address);
  CHECK(r.clean());
  CHECK(r.nodes_compared == 2);
  CHECK(contains(fmt::format("{}", r), ": clean"));
  CHECK(contains(r.to_json(), "\"clean\": true"));
}

TEST_CASE("a by-value position is a frozen value with kernel, index, offset and both values") {
  const auto a = chain({kernel(1, "rope(float*, int)", {8, 4}, {buf_a, 7})});
  const auto b = chain({kernel(1, "rope(float*, int)", {8, 4}, {buf_a, 8})});
  const auto r = replay::detail::compare_summaries(a, b, fake_address);
  REQUIRE(r.frozen_values.size() == 1);
  CHECK(r.unstable_addresses.empty());
  const auto& d = r.frozen_values[0];
  CHECK(d.kernel == "rope(float*, int)");
  CHECK(d.arg_index == 1);
  CHECK(d.offset == 8);
  CHECK(d.size == 4);
  CHECK(d.a == 7);
  CHECK(d.b == 8);
  const std::string text = fmt::format("{}", r);
  CHECK(contains(text, "frozen value: node 0 rope(float*, int): argument 1 (offset 8, 4 bytes): 0x00000007 (7) vs "
                       "0x00000008 (8)"));
  CHECK(contains(r.to_json(), "\"arg_index\": 1"));
  CHECK(contains(r.to_json(), "\"a_int\": 7"));
}

TEST_CASE("negative values print signed") {
  const auto a = chain({kernel(1, "k(int)", {4}, {static_cast<std::uint32_t>(-1)})});
  const auto b = chain({kernel(1, "k(int)", {4}, {static_cast<std::uint32_t>(-2)})});
  const auto r = replay::detail::compare_summaries(a, b, fake_address);
  CHECK(contains(fmt::format("{}", r), "0xffffffff (-1) vs 0xfffffffe (-2)"));
}

TEST_CASE("a pointer that differs is an unstable address, not a frozen value") {
  const auto a = chain({kernel(1, "gemv(float const*, float*)", {8, 8}, {buf_a, buf_b})});
  const auto b = chain({kernel(1, "gemv(float const*, float*)", {8, 8}, {buf_a, buf_b + 0x1000})});
  const auto r = replay::detail::compare_summaries(a, b, fake_address);
  CHECK(r.frozen_values.empty());
  REQUIRE(r.unstable_addresses.size() == 1);
  CHECK(r.unstable_addresses[0].arg_index == 1);
  CHECK(contains(fmt::format("{}", r), "unstable address: node 0 gemv(float const*, float*): argument 1"));
}

TEST_CASE("a struct argument is compared word by word") {
  // One 24-byte struct {float* x; int pos; int pad; float* y;} at offset 0.
  auto a = kernel(1, "step(Buffers)", {24}, {0});
  auto b = a;
  const std::uint64_t xa = buf_a, ya = buf_b, yb = buf_b + 64, pos_a = 3, pos_b = 4;
  std::memcpy(a.args.data(), &xa, 8), std::memcpy(b.args.data(), &xa, 8);
  std::memcpy(a.args.data() + 8, &pos_a, 8), std::memcpy(b.args.data() + 8, &pos_b, 8);
  std::memcpy(a.args.data() + 16, &ya, 8), std::memcpy(b.args.data() + 16, &yb, 8);
  const auto r = replay::detail::compare_summaries(chain({a}), chain({b}), fake_address);
  REQUIRE(r.frozen_values.size() == 1);
  CHECK(r.frozen_values[0].within == 8);
  REQUIRE(r.unstable_addresses.size() == 1);
  CHECK(r.unstable_addresses[0].within == 16);
  CHECK(contains(fmt::format("{}", r), "word at +8"));
}

TEST_CASE("grid, block and shared memory changes are launch shape changes") {
  auto a = kernel(1, "attn(float*)", {8}, {buf_a});
  auto b = a;
  b.grid = {4, 1, 1};
  b.shared_bytes = 1024;
  const auto r = replay::detail::compare_summaries(chain({a}), chain({b}), fake_address);
  REQUIRE(r.launch_changes.size() == 2);
  CHECK(r.launch_changes[0].what == "grid");
  CHECK(r.launch_changes[0].a == "[1,1,1]");
  CHECK(r.launch_changes[0].b == "[4,1,1]");
  CHECK(r.launch_changes[1].what == "shared_bytes");
  CHECK_FALSE(r.clean());
}

TEST_CASE("a node in one capture only is a topology difference; the rest is still compared") {
  const auto k1 = kernel(1, "embed(int)", {4}, {0});
  const auto k2 = kernel(2, "split_kv(int)", {4}, {0});
  const auto k3 = kernel(3, "head(int)", {4}, {0});
  auto k3b = k3;
  k3b.args[0] = 9;
  const auto r = replay::detail::compare_summaries(chain({k1, k3}), chain({k1, k2, k3b}), fake_address);
  CHECK(r.nodes_a == 2);
  CHECK(r.nodes_b == 3);
  CHECK(r.nodes_compared == 2);
  bool node_found = false;
  for (const auto& t : r.topology) node_found |= t.capture == 2 && contains(t.description, "split_kv(int)");
  CHECK(node_found);
  REQUIRE(r.frozen_values.size() == 1);  // head's argument, paired across the inserted node
  CHECK(r.frozen_values[0].kernel == "head(int)");
  CHECK(contains(fmt::format("{}", r), "topology: only in capture 2: kernel node split_kv(int)"));
}

TEST_CASE("edges that differ between paired nodes are reported") {
  auto a = chain({kernel(1, "a(int)", {4}, {0}), kernel(2, "b(int)", {4}, {0})});
  auto b = a;
  b.edges[0].programmatic = true;
  const auto r = replay::detail::compare_summaries(a, b, fake_address);
  REQUIRE(r.topology.size() == 2);
  CHECK(contains(r.topology[1].description, "programmatic edge 0 -> 1"));
}

TEST_CASE("memcpy fields: a moved address is unstable, a changed size is frozen") {
  node_info a;
  a.type = cudaGraphNodeTypeMemcpy;
  a.fields = {{"src", buf_a, true}, {"dst", buf_b, true}, {"width", 16, false}};
  node_info b = a;
  b.fields[0].value = buf_a + 256;
  b.fields[2].value = 32;
  const auto r = replay::detail::compare_summaries(chain({a}), chain({b}), fake_address);
  REQUIRE(r.unstable_addresses.size() == 1);
  CHECK(r.unstable_addresses[0].field == "src");
  REQUIRE(r.frozen_values.size() == 1);
  CHECK(r.frozen_values[0].field == "width");
  CHECK(contains(fmt::format("{}", r), "memcpy: field width: "));
}

TEST_CASE("a kernel without an argument layout is noted, not reported as clean-by-accident") {
  auto a = kernel(1, "<unknown kernel>", {}, {});
  a.args_known = false;
  const auto r = replay::detail::compare_summaries(chain({a}), chain({a}), fake_address);
  CHECK(r.clean());
  REQUIRE(r.notes.size() == 1);
  CHECK(contains(r.notes[0], "argument layout unavailable"));
}

TEST_CASE("graph_summary prints JSON and DOT") {
  auto g = chain({kernel(1, "embed(int)", {4}, {0}), kernel(2, "head(int)", {4}, {0})});
  g.edges[0].programmatic = true;
  g.programmatic_edges = 1;
  const std::string json = g.to_json();
  CHECK(contains(json, "\"programmatic_edges\": 1"));
  CHECK(contains(json, "\"kernel\": 2"));
  CHECK(contains(json, "\"kernel\": \"head(int)\", \"grid\": [1,1,1], \"block\": [128,1,1], \"shared_bytes\": 0"));
  const std::string dot = g.to_dot();
  CHECK(contains(dot, "digraph"));
  CHECK(contains(dot, "n0 -> n1 [style=dashed, label=\"PDL\"]"));
  CHECK(g.counts_by_type().at("kernel") == 2);
}
