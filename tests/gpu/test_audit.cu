// GPU tests of the frozen-value audit (audit.hpp) and graph inspection (inspect.hpp): a position
// passed by value is caught with its kernel and argument index, the same step reading step_meta is
// clean, scratch picked per call is an unstable address, a step whose kernels depend on the
// position is a topology difference; inspection names kernels, shapes, PDL edges, child graphs and
// conditional nodes. The reports are printed so that a run shows what a user would see.
#include <doctest/doctest.h>
#include <gpu_test.hpp>
#include <replay/audit.hpp>
#include <replay/inspect.hpp>
#include <replay/launch.hpp>
#include <replay/replay.hpp>

#include <cstdio>
#include <string>
#include <vector>

namespace {

struct meta_t {
  int token;
  int pos;
};

// The bug the audit exists for: the position is an argument, so a graph freezes it.
__global__ void rope_by_value(float* x, int pos) {
  if (threadIdx.x == 0) x[0] = static_cast<float>(pos);
}
// The fix: the position is read through a fixed address.
__global__ void rope_from_meta(float* x, const meta_t* meta) {
  if (threadIdx.x == 0) x[0] = static_cast<float>(meta->pos);
}
__global__ void scale(float* x, float a) {
  if (threadIdx.x == 0) x[0] *= a;
}
__global__ void pdl_consumer(float* x) {
  replay::pdl::wait();
  if (threadIdx.x == 0) x[0] += 1.0f;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

void show(const char* what, const replay::audit_report& r) {
  std::printf("--- %s\n%s\n", what, fmt::format("{}", r).c_str());
  std::fflush(stdout);
}

}  // namespace

// Inspection asks cudaFuncGetParamInfo for parameters until it answers cudaErrorInvalidValue (the
// runtime has no count query): an expected API error per kernel, hence the suite.
TEST_SUITE("expected_cuda_errors") {

TEST_CASE("audit: a position passed by value is a frozen value naming the kernel and argument") {
  replay::stream s;
  replay::device_buffer<float> x(4);
  int pos = 0;
  const auto step = [&](replay::stream_ref cs) {
    replay::launch(rope_by_value, {.grid = 1, .block = 32, .stream = cs}, x.data(), pos);
    replay::launch(scale, {.grid = 1, .block = 32, .stream = cs}, x.data(), 0.5f);
  };
  const replay::audit_report r = replay::audit_step(s, step, [&] { pos = 41; }, [&] { pos = 42; });
  show("position by value", r);
  CHECK_FALSE(r.clean());
  REQUIRE(r.frozen_values.size() == 1);
  const auto& d = r.frozen_values[0];
  CHECK(contains(d.kernel, "rope_by_value"));
  CHECK(d.arg_index == 1);
  CHECK(d.offset == 8);
  CHECK(d.size == 4);
  CHECK(d.a == 41);
  CHECK(d.b == 42);
  CHECK(r.unstable_addresses.empty());
  CHECK(r.topology.empty());
  CHECK(contains(r.to_json(), "\"arg_index\": 1"));
}

TEST_CASE("audit: the same step reading step_meta is clean") {
  replay::stream s;
  replay::device_buffer<float> x(4);
  replay::step_meta<meta_t> meta;
  const auto step = [&](replay::stream_ref cs) {
    replay::launch(rope_from_meta, {.grid = 1, .block = 32, .stream = cs}, x.data(), meta.device());
    replay::launch(pdl_consumer, {.grid = 1, .block = 32, .stream = cs, .pdl = true}, x.data());
  };
  const replay::audit_report r = replay::audit_step(s, step, [&](int variant) {
    meta.push(s, meta_t{.token = 7 + variant, .pos = 41 + variant});
  });
  show("position through step_meta", r);
  CHECK(r.clean());
  CHECK(r.nodes_a == 2);
  CHECK(r.nodes_compared == 2);
  CHECK(r.notes.empty());
  CHECK(contains(r.to_json(), "\"clean\": true"));
  s.synchronize();
}

TEST_CASE("audit: scratch allocated per call is caught as unstable addresses") {
  replay::stream s;
  std::vector<replay::device_buffer<float>> scratch;  // every buffer stays alive until the audit ends
  const auto step = [&](replay::stream_ref cs) {
    replay::launch(scale, {.grid = 1, .block = 32, .stream = cs}, scratch.back().data(), 2.0f);
    REPLAY_CHECK(cudaMemsetAsync(scratch.back().data(), 0, 16, cs.get()));
  };
  const replay::audit_report r = replay::audit_step(s, step, [&](int) { scratch.emplace_back(256); });
  show("scratch per call", r);
  CHECK(r.frozen_values.empty());
  REQUIRE(r.unstable_addresses.size() == 2);
  CHECK(contains(r.unstable_addresses[0].kernel, "scale"));
  CHECK(r.unstable_addresses[0].arg_index == 0);
  CHECK(r.unstable_addresses[1].kernel == "memset");
  CHECK(r.unstable_addresses[1].field == "dst");
}

TEST_CASE("audit: kernels that depend on the position are topology differences; copy sizes are compared") {
  replay::stream s;
  replay::device_buffer<float> x(64);
  replay::pinned_buffer<float> host(64);
  int pos = 0;
  const auto step = [&](replay::stream_ref cs) {
    if (pos > 8) replay::launch(scale, {.grid = 1, .block = 32, .stream = cs}, x.data(), 2.0f);
    REPLAY_CHECK(cudaMemcpyAsync(x.data(), host.data(), sizeof(float) * (pos + 1), cudaMemcpyHostToDevice, cs.get()));
  };
  const replay::audit_report r = replay::audit_step(s, step, [&] { pos = 3; }, [&] { pos = 9; });
  show("topology and copy size", r);
  REQUIRE(r.topology.size() >= 1);
  CHECK(r.topology[0].capture == 2);
  CHECK(contains(r.topology[0].description, "scale"));
  REQUIRE(r.frozen_values.size() == 1);
  CHECK(r.frozen_values[0].field == "width");
  CHECK(r.frozen_values[0].a == 16);
  CHECK(r.frozen_values[0].b == 40);
}

TEST_CASE("audit: a step that throws leaves the stream usable and the exception propagates") {
  replay::stream s;
  const auto step = [&](replay::stream_ref) { throw std::runtime_error("step failed"); };
  CHECK_THROWS_WITH((void)replay::audit_step(s, step, [] {}, [] {}), "step failed");
  CHECK_FALSE(s.is_capturing());
}

TEST_CASE("inspect: kernels, shapes, PDL edges, JSON and DOT") {
  replay::stream s;
  replay::device_buffer<float> x(4);
  replay::step_meta<meta_t> meta;
  replay::graph g = replay::capture(s, [&](replay::stream_ref cs) {
    meta.capture_copy(cs);
    replay::launch(rope_from_meta, {.grid = 2, .block = 64, .shared_bytes = 128, .stream = cs}, x.data(),
                   meta.device());
    replay::launch(pdl_consumer, {.grid = 1, .block = 32, .stream = cs, .pdl = true}, x.data());
  });
  const replay::graph_summary sum = replay::inspect(g);
  // The in-graph copy (a memcpy node, then the event-record node that guards its staging), then
  // the two kernels.
  REQUIRE(sum.nodes.size() >= 3);
  CHECK(sum.nodes[0].type == cudaGraphNodeTypeMemcpy);
  const std::size_t k = sum.nodes.size() - 2;
  CHECK(contains(sum.nodes[k].kernel, "rope_from_meta(float*, (anonymous namespace)::meta_t const*)"));
  CHECK(sum.nodes[k].grid == std::array<unsigned, 3>{2, 1, 1});
  CHECK(sum.nodes[k].block == std::array<unsigned, 3>{64, 1, 1});
  CHECK(sum.nodes[k].shared_bytes == 128);
  CHECK(sum.nodes[k].params.size() == 2);
  CHECK(sum.nodes[k].args_known);
  CHECK(contains(sum.nodes[k + 1].kernel, "pdl_consumer"));
  CHECK(sum.edges.size() >= 2);
  CHECK(sum.programmatic_edges == g.programmatic_edge_count());
  CHECK(sum.programmatic_edges == 1);
  CHECK(sum.count(cudaGraphNodeTypeKernel) == 2);
  const std::string json = sum.to_json();
  std::printf("--- inspect JSON\n%s", json.c_str());
  CHECK(contains(json, "\"programmatic_edges\": 1"));
  CHECK(contains(json, "\"memcpy\": 1"));
  CHECK(contains(json, "\"shared_bytes\": 128"));
  CHECK(contains(sum.to_dot(), "[style=dashed, label=\"PDL\"]"));
  const std::string path = "replay_test_inspect.dot";
  replay::write_graph_summary(g, path);
  std::FILE* f = std::fopen(path.c_str(), "r");
  REQUIRE(f != nullptr);
  char head[16] = {};
  CHECK(std::fread(head, 1, 7, f) == 7);
  std::fclose(f);
  std::remove(path.c_str());
  CHECK(std::string(head) == "digraph");
}

TEST_CASE("inspect: child graphs are walked; conditional nodes are counted") {
  replay::stream s;
  replay::device_buffer<float> x(4);
  replay::graph inner = replay::capture(s, [&](replay::stream_ref cs) {
    replay::launch(scale, {.grid = 1, .block = 32, .stream = cs}, x.data(), 3.0f);
  });
  replay::graph outer = replay::graph::create();
  cudaGraphNode_t child = nullptr;
  REPLAY_CHECK(cudaGraphAddChildGraphNode(&child, outer.get(), nullptr, 0, inner.get()));
#if CUDART_VERSION >= 12040
  cudaGraphConditionalHandle handle{};
  REPLAY_CHECK(cudaGraphConditionalHandleCreate(&handle, outer.get(), 0, 0));
  cudaGraphNodeParams cp{};
  cp.type = cudaGraphNodeTypeConditional;
  cp.conditional.handle = handle;
  cp.conditional.type = cudaGraphCondTypeIf;
  cp.conditional.size = 1;
  cudaGraphNode_t cond = nullptr;
#if CUDART_VERSION >= 13000
  REPLAY_CHECK(cudaGraphAddNode(&cond, outer.get(), &child, nullptr, 1, &cp));
#else
  REPLAY_CHECK(cudaGraphAddNode(&cond, outer.get(), &child, 1, &cp));
#endif
  cudaGraphNode_t body_node = nullptr;
  REPLAY_CHECK(cudaGraphAddEmptyNode(&body_node, cp.conditional.phGraph_out[0], nullptr, 0));
#endif
  const replay::graph_summary sum = replay::inspect(outer);
  std::printf("--- child + conditional\n%s", sum.to_json().c_str());
  REQUIRE(sum.nodes.size() >= 2);
  CHECK(sum.nodes[0].type == cudaGraphNodeTypeGraph);
  CHECK(sum.count(cudaGraphNodeTypeKernel) == 1);
  bool inner_kernel = false;
  for (const auto& n : sum.nodes) inner_kernel |= n.path == "0/0/0" && contains(n.kernel, "scale");
  CHECK(inner_kernel);
#if CUDART_VERSION >= 12040
  CHECK(sum.count(cudaGraphNodeTypeConditional) == 1);
  CHECK(sum.counts_by_type().at("conditional") == 1);
  CHECK(contains(sum.to_json(), "\"conditional\": 1"));
#endif
}

}  // TEST_SUITE
