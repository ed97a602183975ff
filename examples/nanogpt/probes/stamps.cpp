// nanogpt_stamps: where a decode step's time goes, kernel by kernel (a build configured with
// -DNANOGPT_STAMPS=ON). Per mode (graph, eager) it runs generations of 48 steps back to back
// (prompt of 8 tokens, temperature 1, each step waiting for its token as `--bench` does), reads the
// kernels' stamps after each generation (read_stamps) and prints, per kernel, the medians of:
//   start   entry, relative to the step's first kernel's entry (globaltimer, ns)
//   wait    the wait returned (same origin)
//   done    its output stored (same origin)
//   gap     wait returned - previous kernel's output stored (the handoff)
//   work    done - wait (globaltimer ns and clock64 cycles): the kernel's own critical path
// then, per kernel, the SM cycles from the wait to each of its stamps 2..7 (model.cu says what
// each marks), and per step: first entry -> last store, last store -> the next step's first entry
// (token to the host, the next launch), and the host's time per step.
// Usage: nanogpt_stamps [steps] [weights.safetensors]
#include "common/report.hpp"
#include "common/timing.hpp"
#include "nanogpt/model.hpp"
#include "nanogpt/weights.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <memory>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  using namespace nanogpt;
  using replay_examples::median;
  const int steps = argc > 1 ? std::stoi(argv[1]) : 2000;
  const Weights weights = argc > 2 ? load_weights(argv[2]) : random_weights(7);
  constexpr int K = Model::kernels_per_decode_step;
  constexpr int kGen = 48;  // decode steps per generation (prompt 8: positions 8..55)
  static_assert(kGen < StepStamps::steps);
  const char* names[K] = {"embed", "attn 0", "ffn 0", "attn 1", "ffn 1", "attn 2", "ffn 2", "attn 3", "ffn 3", "lm_head+sample"};
  fmt::print("device: {}\n", require_device());
  for (Mode mode : {Mode::graph, Mode::eager}) {
    Model model(weights);
    std::array<std::array<std::vector<double>, 8>, K> at, cyc;
    std::array<std::vector<double>, K> gap, work_ns, work_cycles;
    std::vector<double> span, between, host_us;
    const std::vector<std::int32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8};
    const Sampling sampling{.temperature = 1.0f, .seed = 11, .greedy = false};
    int done = 0;
    while (done < steps) {
      std::int32_t token = model.prefill(prompt, sampling);
      if (mode == Mode::graph && !model.has_graph()) model.capture_decode_graph();
      const int n = std::min(kGen, steps - done);
      for (int i = 0; i < n; ++i) {
        const replay_examples::stopwatch sw;
        token = model.decode_step(token, 8 + i, sampling, mode);
        host_us.push_back(sw.elapsed_us());
      }
      done += n;
      const auto s = std::make_unique<StepStamps>(read_stamps());
      if (s->ticket % K != 0) {
        fmt::print(stderr, "stamp ticket {} is not a multiple of {}\n", s->ticket, K);
        return 1;
      }
      const int S = StepStamps::steps;
      for (int i = 0; i < n; ++i) {
        const int idx = (s->first() - n + i + 2 * S) % S;
        const auto& t = s->time[idx];
        const auto& c = s->clock[idx];
        const double t0 = static_cast<double>(t[0][0]);
        for (int k = 0; k < K; ++k) {
          for (int j = 0; j < 8; ++j) {
            at[k][j].push_back(static_cast<double>(t[k][j]) - t0);
            if (c[k][j] != 0) cyc[k][j].push_back(static_cast<double>(c[k][j] - c[k][1]));
          }
          if (k > 0) gap[k].push_back(static_cast<double>(t[k][1]) - static_cast<double>(t[k - 1][7]));
          work_ns[k].push_back(static_cast<double>(t[k][7]) - static_cast<double>(t[k][1]));
          work_cycles[k].push_back(static_cast<double>(c[k][7] - c[k][1]));
        }
        span.push_back(static_cast<double>(t[K - 1][7]) - t0);
        if (i > 0) {
          const int prev = (idx - 1 + S) % S;
          between.push_back(t0 - static_cast<double>(s->time[prev][K - 1][7]));
        }
      }
    }
    fmt::print("\n{} mode, {} steps: medians (ns from the first kernel's entry; work also in SM cycles)\n",
               to_string(mode), done);
    fmt::print("{:<16}{:>8}{:>8}{:>8}{:>8}{:>8}{:>8}\n", "kernel", "start", "wait", "done", "gap", "work",
               "cycles");
    for (int k = 0; k < K; ++k)
      fmt::print("{:<16}{:>8.0f}{:>8.0f}{:>8.0f}{:>8.0f}{:>8.0f}{:>8.0f}\n", names[k], median(at[k][0]),
                 median(at[k][1]), median(at[k][7]), k > 0 ? median(gap[k]) : 0.0, median(work_ns[k]),
                 median(work_cycles[k]));
    fmt::print("per step: first entry -> last store {:.0f} ns; last store -> next step's first entry {:.0f} ns; "
               "host time per step {:.2f} us\n",
               median(span), median(between), median(host_us));
    fmt::print("SM cycles after the wait returned, at stamps 2..7 (- where a kernel has none):\n");
    for (int k = 0; k < K; ++k) {
      fmt::print("{:<16}", names[k]);
      for (int j = 2; j < 8; ++j) {
        if (cyc[k][j].empty()) fmt::print("{:>8}", "-");
        else fmt::print("{:>8.0f}", median(cyc[k][j]));
      }
      fmt::print("\n");
    }
  }
  return 0;
}
