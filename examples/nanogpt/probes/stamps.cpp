// nanogpt_stamps: where a decode step's time goes, kernel by kernel (a build configured with
// -DNANOGPT_STAMPS=ON). Runs `steps` decode steps per mode at temperature 1 (prompt of 8 tokens,
// 48 new tokens per generation, regenerating as needed), reads each step's kernel stamps
// (read_stamps) and prints, per kernel, the medians of:
//   start   entry, relative to the step's first kernel's entry (globaltimer, ns)
//   wait    the wait returned (same origin)
//   ready   its residual row loaded and normalised (same origin)
//   done    its output stored (same origin)
//   gap     wait returned - previous kernel's output stored (the handoff)
//   work    done - wait (globaltimer ns and clock64 cycles): the kernel's own critical path
// and then, per kernel, the SM cycles from the wait to each of its stamps 2..7 (model.cu says what
// each marks).
// Usage: nanogpt_stamps [steps] [weights.safetensors]
#include "nanogpt/model.hpp"
#include "nanogpt/weights.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <string>
#include <vector>

namespace {
double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
}  // namespace

int main(int argc, char** argv) {
  using namespace nanogpt;
  const int steps = argc > 1 ? std::stoi(argv[1]) : 2000;
  const Weights weights = argc > 2 ? load_weights(argv[2]) : random_weights(7);
  constexpr int K = Model::kernels_per_decode_step;
  const char* names[K] = {"embed", "attn 0", "ffn 0", "attn 1", "ffn 1", "attn 2", "ffn 2", "attn 3", "ffn 3", "lm_head+sample"};
  fmt::print("device: {}\n", require_device());
  for (Mode mode : {Mode::graph, Mode::eager}) {
    Model model(weights);
    std::array<std::array<std::vector<double>, 8>, K> at, cyc;
    std::array<std::vector<double>, K> gap, work_ns, work_cycles;
    std::vector<double> span;
    const std::vector<std::int32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8};
    const Sampling sampling{.temperature = 1.0f, .seed = 11, .greedy = false};
    int done = 0;
    for (int gen = 0; done < steps; ++gen) {
      std::int32_t token = model.prefill(prompt, sampling);
      if (mode == Mode::graph && !model.has_graph()) model.capture_decode_graph();
      for (int pos = 8; pos < 56 && done < steps; ++pos, ++done) {
        token = model.decode_step(token, pos, sampling, mode);
        const StepStamps s = read_stamps();
        if (s.ticket % K != 0) {
          fmt::print(stderr, "stamp ticket {} is not a multiple of {}\n", s.ticket, K);
          return 1;
        }
        const double t0 = static_cast<double>(s.time[0][0]);
        for (int k = 0; k < K; ++k) {
          for (int i = 0; i < 8; ++i) {
            at[k][i].push_back(static_cast<double>(s.time[k][i]) - t0);
            if (s.clock[k][i] != 0) cyc[k][i].push_back(static_cast<double>(s.clock[k][i] - s.clock[k][1]));
          }
          if (k > 0) gap[k].push_back(static_cast<double>(s.time[k][1]) - static_cast<double>(s.time[k - 1][7]));
          work_ns[k].push_back(static_cast<double>(s.time[k][7]) - static_cast<double>(s.time[k][1]));
          work_cycles[k].push_back(static_cast<double>(s.clock[k][7] - s.clock[k][1]));
        }
        span.push_back(static_cast<double>(s.time[K - 1][7]) - t0);
      }
    }
    fmt::print("\n{} mode, {} steps: medians (ns from the first kernel's entry; work also in SM cycles)\n",
               to_string(mode), done);
    fmt::print("{:<16}{:>8}{:>8}{:>8}{:>8}{:>8}{:>8}{:>8}\n", "kernel", "start", "wait", "ready", "done", "gap",
               "work", "cycles");
    for (int k = 0; k < K; ++k)
      fmt::print("{:<16}{:>8.0f}{:>8.0f}{:>8.0f}{:>8.0f}{:>8.0f}{:>8.0f}{:>8.0f}\n", names[k], median(at[k][0]),
                 median(at[k][1]), median(at[k][2]), median(at[k][7]), k > 0 ? median(gap[k]) : 0.0,
                 median(work_ns[k]), median(work_cycles[k]));
    fmt::print("first entry -> last store: median {:.0f} ns\n", median(span));
    fmt::print("SM cycles after the wait returned, at stamps 2..7 (- where a kernel has none):\n");
    for (int k = 0; k < K; ++k) {
      fmt::print("{:<16}", names[k]);
      for (int i = 2; i < 8; ++i) {
        if (cyc[k][i].empty()) fmt::print("{:>8}", "-");
        else fmt::print("{:>8.0f}", median(cyc[k][i]));
      }
      fmt::print("\n");
    }
  }
  return 0;
}
