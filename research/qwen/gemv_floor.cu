// research/qwen/gemv_floor.cu: what each decode GEMV costs in a graph, against the kernel-per-matrix
// floor (a streaming read of the same bytes, launch_read_link).
//
// For each matrix of a preset's decode step (QKV with the fused RMSNorm, O with the residual add,
// gate/up with SiLU, down, lm_head with argmax) it captures a chain of one kernel per layer over
// distinct copies of the matrix (so nothing is served from L2), launched as the decode step launches
// them (PDL as set), and reports the median GPU time per kernel over 20 replays: the GEMV at each
// requested batch size, and the read link. The difference is what the GEMV adds to streaming its
// weights (staging of x, arithmetic, reductions, epilogue, imbalance). Timings do not depend on the
// values (constants here).
//
//   qwen_gemv_floor --preset qwen3-0.6b --preset qwen3-4b --rows 1,4
#include "config.hpp"
#include "kernels.cuh"

#include <common/device.hpp>
#include <common/report.hpp>
#include <common/timing.hpp>
#include <replay/buffer.hpp>
#include <replay/capture.hpp>
#include <replay/error.hpp>
#include <replay/stream.hpp>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

namespace {

using qwen::bf16;
using qwen::gemv_out;

struct Matrix {
  std::string name;
  int N, K;       // output rows (gate/up: per half), input width
  gemv_out mode;  // epilogue
  bool norm;      // RMSNorm of the fp32 residual fused into the prologue
  int copies;     // kernels in the chain
};

/// Median GPU time in µs per kernel of `chain` (which enqueues `count` kernels), captured once.
template <class F>
double us_per_kernel(replay::stream_ref s, int count, F&& chain) {
  const auto exec = replay::capture(s, chain).instantiate({.upload_stream = s.get()});
  return replay_examples::median_gpu_ms(s, 20, [&] { exec.launch(s); }) * 1e3 / count;
}

void run_preset(const qwen::Config& c, const std::vector<int>& rows_list, int sms, replay::stream_ref s) {
  const int H = c.hidden_size, I = c.intermediate_size, L = c.num_hidden_layers;
  // The layer's matrices with the decode step's epilogues (layer_matrices order), then lm_head.
  const struct {
    const char* what;
    gemv_out mode;
    bool norm;
  } roles[] = {{"norm", gemv_out::store_f32, true},
               {"+ residual", gemv_out::add_f32, false},
               {"norm, SiLU", gemv_out::silu_mul, true},
               {"+ residual", gemv_out::add_f32, false}};
  std::vector<Matrix> mats;
  std::size_t max_k = 0;
  const auto layer = c.layer_matrices();
  for (std::size_t i = 0; i < layer.size(); ++i) {
    const auto& m = layer[i];
    const int n = roles[i].mode == gemv_out::silu_mul ? m.rows / 2 : m.rows;
    mats.push_back({fmt::format("{} ({})", m.name, roles[i].what), n, m.cols, roles[i].mode, roles[i].norm, L});
    max_k = std::max<std::size_t>(max_k, m.cols);
  }
  mats.push_back({"lm_head (norm, argmax)", c.vocab_size, H, gemv_out::argmax, true, 4});
  const std::size_t max_out = std::max<std::size_t>(c.vocab_size, 2ull * I);
  replay::device_buffer<float> residual(qwen::kGemvMaxRows * max_k), y(qwen::kGemvMaxRows * max_out);
  replay::device_buffer<bf16> x(qwen::kGemvMaxRows * max_k), norm_w(max_k), act(qwen::kGemvMaxRows * max_out);
  replay::device_buffer<unsigned long long> keys(qwen::kGemvMaxRows);
  replay::device_buffer<unsigned> sink(1);
  qwen::launch_fill_const(norm_w.data(), norm_w.size(), 1.0f, s);
  qwen::launch_fill_const(x.data(), x.size(), 0.01f, s);
  REPLAY_CHECK(cudaMemsetAsync(residual.data(), 0, residual.size_bytes(), s.get()));

  std::vector<std::string> header{"matrix", "MB"};
  for (int r : rows_list) header.push_back(fmt::format("GEMV, {} row(s) (µs)", r));
  header.insert(header.end(), {"read link (µs)", "excess, 1st (µs)"});
  replay_examples::table t(header);
  for (const Matrix& m : mats) {
    const std::size_t w_rows = m.mode == gemv_out::silu_mul ? 2ull * m.N : std::size_t(m.N);
    const std::size_t elems = w_rows * m.K, bytes = elems * sizeof(bf16);
    replay::device_buffer<bf16> w(elems * m.copies);
    qwen::launch_fill_const(w.data(), w.size(), 0.001f, s);
    std::vector<std::string> row{m.name, fmt::format("{:.1f}", bytes / 1e6)};
    double first = 0;
    for (int r : rows_list) {
      const double us = us_per_kernel(s, m.copies, [&](replay::stream_ref cs) {
        for (int i = 0; i < m.copies; ++i)
          qwen::launch_gemv(w.data() + i * elems, m.N, m.K, r, {x.data(), residual.data(), m.norm ? norm_w.data() : nullptr},
                            m.mode, y.data(), act.data(), m.mode == gemv_out::silu_mul ? I : m.N, keys.data(), sms, cs);
      });
      if (first == 0) first = us;
      row.push_back(fmt::format("{:.2f}", us));
    }
    const double link = us_per_kernel(s, m.copies, [&](replay::stream_ref cs) {
      for (int i = 0; i < m.copies; ++i) qwen::launch_read_link(w.data() + i * elems, bytes, sink.data(), sms, cs);
    });
    row.push_back(fmt::format("{:.2f}", link));
    row.push_back(fmt::format("{:+.2f}", first - link));
    t.add_row(std::move(row));
  }
  s.synchronize();
  fmt::print("\n## {}: per-kernel GPU time in a graph ({} layers, PDL {})\n{}", c.name, L,
             qwen::pdl_enabled() ? "on" : "off", t.markdown());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Per-kernel cost of each Qwen3 decode GEMV against a streaming read of its bytes"};
  std::vector<std::string> presets;
  std::vector<int> rows{1, 4};
  bool no_pdl = false;
  app.add_option("--preset", presets, "model shapes (default: qwen3-0.6b and qwen3-4b)");
  app.add_option("--rows", rows, "batch rows of the GEMVs, 1..4 (default: 1,4)")
      ->delimiter(',')
      ->check(CLI::Range(1, qwen::kGemvMaxRows));
  app.add_flag("--no-pdl", no_pdl, "launch without programmatic dependent launch");
  CLI11_PARSE(app, argc, argv);
  if (presets.empty()) presets = {"qwen3-0.6b", "qwen3-4b"};
  try {
    std::vector<qwen::Config> cfgs;
    for (const auto& p : presets) cfgs.push_back(qwen::preset(p));  // bad names fail before GPU work
    const int sms = replay_examples::sm_count();
    fmt::print("device: {}\n", replay_examples::device_name());
    qwen::init_kernel_attributes();
    qwen::set_pdl(!no_pdl);
    replay::stream s;
    for (const auto& c : cfgs) run_preset(c, rows, sms, s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
