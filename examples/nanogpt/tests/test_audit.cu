// The frozen-value audit on the NanoGPT decode step: captured twice, after eager steps with another
// token, position, length and sampling setting, the two graphs are identical for every launch
// setting (metadata path, PDL on and off). Also the shape of the step's graph as inspect() sees it.
#include "gpu_test.hpp"
#include "nanogpt/model.hpp"
#include "nanogpt/weights.hpp"

#include <doctest/doctest.h>
#include <replay/audit.hpp>
#include <replay/inspect.hpp>

#include <cstdio>
#include <vector>

using namespace nanogpt;

namespace {

const std::vector<ModelOptions>& variants() {
  static const std::vector<ModelOptions> v = {
      {.pdl = true, .meta = MetaPath::device},  {.pdl = false, .meta = MetaPath::device},
      {.pdl = true, .meta = MetaPath::push},    {.pdl = true, .meta = MetaPath::graph_copy},
  };
  return v;
}

}  // namespace

// Inspection asks cudaFuncGetParamInfo for parameters until it answers cudaErrorInvalidValue (the
// runtime has no count query): an expected API error per kernel, hence the suite.
TEST_SUITE("expected_cuda_errors") {

TEST_CASE("audit: the decode step's graph does not depend on the step's values") {
  const Weights w = random_weights(3);
  for (const ModelOptions& opt : variants()) {
    CAPTURE(to_string(opt.meta));
    CAPTURE(opt.pdl);
    Model model(w, opt);
    const std::vector<std::int32_t> prompt = {20, 43, 1, 40, 43};
    std::int32_t tok = model.prefill(prompt, {});
    const int p = static_cast<int>(prompt.size());
    const replay::audit_report r = replay::audit_step(
        replay::stream_ref(model.stream()), [&](replay::stream_ref s) { model.record_decode_step(s.get()); },
        [&] { tok = model.decode_step(tok, p, {.temperature = 0.8f, .seed = 1}, Mode::eager); },
        [&] { (void)model.decode_step((tok + 7) % Config::vocab_size, p + 1, {.greedy = true}, Mode::eager); });
    std::printf("nanogpt %s pdl=%d: %s\n", std::string(to_string(opt.meta)).c_str(), opt.pdl ? 1 : 0,
                fmt::format("{}", r).c_str());
    CHECK(r.clean());
    CHECK(r.notes.empty());
    CHECK(r.nodes_a == r.nodes_b);
    CHECK(r.nodes_compared == r.nodes_a);
    CHECK(r.nodes_a >= static_cast<std::size_t>(Model::kernels_per_decode_step));
  }
}

TEST_CASE("inspect: the decode step's graph has its kernels and, with PDL, programmatic edges") {
  const Weights w = random_weights(3);
  for (const bool pdl : {true, false}) {
    Model model(w, {.pdl = pdl, .meta = MetaPath::push});
    const replay::graph g = replay::capture(replay::stream_ref(model.stream()),
                                            [&](replay::stream_ref s) { model.record_decode_step(s.get()); });
    const replay::graph_summary sum = replay::inspect(g);
    CHECK(sum.count(cudaGraphNodeTypeKernel) == static_cast<std::size_t>(Model::kernels_per_decode_step));
    CHECK(sum.programmatic_edges == g.programmatic_edge_count());
    if (pdl) CHECK(sum.programmatic_edges == static_cast<std::size_t>(Model::kernels_per_decode_step - 1));
    else CHECK(sum.programmatic_edges == 0);
    CHECK(sum.nodes.front().kernel.find("decode_step_kernel") != std::string::npos);
    CHECK(sum.nodes.back().kernel.find("decode_step_kernel") != std::string::npos);
    for (const auto& n : sum.nodes) CHECK(n.args_known);
    if (pdl) std::printf("%s", sum.to_json().c_str());
  }
}

}  // TEST_SUITE
