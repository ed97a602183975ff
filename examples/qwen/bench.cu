// examples/qwen/bench.cu: the `qwen --bench` benchmark (bench.hpp): its floors (the D2D copy rate,
// a read-only streaming kernel, the kernel-per-matrix chain of streaming reads, cuBLAS's bf16 GEMM
// rate for prefill), its tables, and with --tp the step's collectives alone.
#include "bench.hpp"

#include "device.cuh"
#include "schedule.hpp"
#if QWEN_WITH_NCCL
#  include "tp.hpp"
#endif

#include <common/device.hpp>
#include <common/report.hpp>
#include <common/timing.hpp>
#include <replay/buffer.hpp>
#include <replay/capture.hpp>
#include <replay/error.hpp>
#include <replay/launch.hpp>

#include "cublas.hpp"
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstddef>
#include <map>
#include <numeric>
#include <string>
#include <vector>

namespace qwen {
namespace {

using json = nlohmann::json;
using dev::ld_stream;

// ---- the floors' streaming-read kernels ----------------------------------------------------------

/// launch_read_link: the read probe's loop, with its first loads issued before the PDL wait.
__global__ void __launch_bounds__(256) read_link_kernel(const uint4* __restrict__ p, std::size_t n, unsigned* sink) {
  replay::pdl::launch_dependents();
  unsigned acc = 0;
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
  uint4 v[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) v[u] = i + u * stride < n ? ld_stream(p + i + u * stride) : make_uint4(0, 0, 0, 0);
  replay::pdl::wait();
  for (;;) {
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    i += 4 * stride;
    if (i >= n) break;
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = i + u * stride < n ? ld_stream(p + i + u * stride) : make_uint4(0, 0, 0, 0);
  }
  if (acc == 0x9E3779B9u) *sink = acc;  // practically never; keeps the loads alive
}

/// Read-bandwidth probe: every thread streams 16-byte loads, 4 in flight, over `n` uint4 (grid-stride)
/// and folds them into one word so that the loads cannot be dropped.
__global__ void __launch_bounds__(256) read_probe_kernel(const uint4* __restrict__ p, std::size_t n, unsigned* sink) {
  unsigned acc = 0;
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = ld_stream(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = ld_stream(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u) *sink = acc;  // practically never; keeps the loads alive
}

/// Read-bandwidth probe: a kernel that only streams `bytes` from p (16-byte loads, 8 blocks of 256
/// threads per SM, 4 loads in flight per thread).
void launch_read_probe(const void* p, std::size_t bytes, unsigned* sink, int num_sms, replay::stream_ref s) {
  replay::launch(read_probe_kernel, {.grid = dim3(num_sms * 8), .block = dim3(256), .stream = s},
                 static_cast<const uint4*>(p), bytes / 16, sink);
}

/// One link of the kernel-per-matrix chain floor: the read probe's loop with its first loads issued
/// before pdl::wait(), as the GEMVs do. bytes = 0: one block that only waits (a kernel without
/// weights, such as attention).
void launch_read_link(const void* p, std::size_t bytes, unsigned* sink, int num_sms, replay::stream_ref s) {
  if (bytes % 16 != 0) throw replay::usage_error("launch_read_link: bytes must be a multiple of 16");
  replay::launch(read_link_kernel, {.grid = dim3(bytes == 0 ? 1 : num_sms * 8), .block = dim3(256), .stream = s, .pdl = true},
                 static_cast<const uint4*>(p), bytes / 16, sink);
}

// ---- the floors ---------------------------------------------------------------------------------

/// Device-to-device copy bandwidth (bytes read + written per second), measured now.
double d2d_bandwidth(replay::stream_ref s) {
  const std::size_t bytes = 1ull << 30;
  replay::device_buffer<std::byte> a(bytes), b(bytes);
  REPLAY_CHECK(cudaMemsetAsync(a.data(), 1, bytes, s.get()));
  const double ms = replay_examples::median_gpu_ms(s, 10, [&] {
    REPLAY_CHECK(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, s.get()));
  });
  return 2.0 * bytes / (ms * 1e-3);
}

/// Read-only streaming bandwidth (bytes read per second) of launch_read_probe over 1 GiB, measured now.
double read_bandwidth(replay::stream_ref s) {
  const std::size_t bytes = 1ull << 30;
  replay::device_buffer<std::byte> a(bytes);
  replay::device_buffer<unsigned> sink(1);
  REPLAY_CHECK(cudaMemsetAsync(a.data(), 1, bytes, s.get()));
  const int sms = replay_examples::sm_count();
  const double ms = replay_examples::median_gpu_ms(s, 10, [&] { launch_read_probe(a.data(), bytes, sink.data(), sms, s); });
  return bytes / (ms * 1e-3);
}

/// The kernel-per-matrix floor of a batch-1 decode step, in ms of GPU time: one streaming-read kernel
/// (launch_read_link) per matrix, in the step's order and sizes (per layer QKV, a weightless link
/// where attention runs, O, gate/up, down; then lm_head), captured once as a graph and replayed;
/// median of 20 replays. What the step would cost if every kernel only streamed its weights, with
/// the same launches and PDL handoffs. 0 when the device has no room for a copy of the weights.
double chain_floor_ms(const Config& c, replay::stream_ref s) {
  const auto mats = c.layer_matrices();
  std::vector<std::size_t> sizes;
  for (int l = 0; l < c.num_hidden_layers; ++l)
    for (std::size_t i = 0; i < mats.size(); ++i) {
      sizes.push_back(mats[i].params() * sizeof(bf16));
      if (i == 0) sizes.push_back(0);  // attention runs after the QKV projection
    }
  sizes.push_back(std::size_t(c.vocab_size) * c.hidden_size * sizeof(bf16));
  std::size_t total = 0;
  for (std::size_t b : sizes) total += b;
  std::size_t free_bytes = 0, device_bytes = 0;
  REPLAY_CHECK(cudaMemGetInfo(&free_bytes, &device_bytes));
  if (total + (512ull << 20) > free_bytes) return 0.0;
  replay::device_buffer<std::byte> w(total);
  replay::device_buffer<unsigned> sink(1);
  REPLAY_CHECK(cudaMemsetAsync(w.data(), 1, total, s.get()));
  const int sms = replay_examples::sm_count();
  const auto exec = replay::capture(s, [&](replay::stream_ref cs) {
                      std::size_t off = 0;
                      for (std::size_t b : sizes) {
                        launch_read_link(w.data() + off, b, sink.data(), sms, cs);
                        off += b;
                      }
                    }).instantiate({.upload_stream = s.get()});
  return replay_examples::median_gpu_ms(s, 20, [&] { exec.launch(s); });
}

/// cuBLAS's bf16 GEMM rate (FLOP/s): an 8192^3 GEMM, bf16 inputs, fp32 accumulate and output (as the
/// prefill's projections), median of 10 runs after 2 warm-ups.
double gemm_rate(replay::stream_ref s) {
  constexpr int n = 8192;
  replay::device_buffer<bf16> a(std::size_t(n) * n), b(std::size_t(n) * n);
  replay::device_buffer<float> c(std::size_t(n) * n);
  REPLAY_CHECK(cudaMemsetAsync(a.data(), 0, a.size_bytes(), s.get()));  // zeros: the rate does not depend on values
  REPLAY_CHECK(cudaMemsetAsync(b.data(), 0, b.size_bytes(), s.get()));
  const CublasHandle h;
  const float alpha = 1.f, beta = 0.f;
  QWEN_CUBLAS(cublasSetStream(h.get(), s.get()));
  const double ms = replay_examples::median_gpu_ms(s, 10, [&] {
    QWEN_CUBLAS(cublasGemmEx(h.get(), CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, a.data(), CUDA_R_16BF, n, b.data(),
                             CUDA_R_16BF, n, &beta, c.data(), CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  });
  return 2.0 * n * n * n / (ms * 1e-3);
}

/// FLOPs of prefilling n tokens: every layer matrix on n rows (2 per weight and row), causal
/// attention (q K^T and P V: 4 head_dim per query head and (query, key) pair, n (n + 1) / 2 pairs),
/// and the lm_head on the last row.
double prefill_flops(const Config& c, int n) {
  double params = 0;
  for (const auto& m : c.layer_matrices()) params += static_cast<double>(m.params());
  const double pairs = 0.5 * n * (n + 1.0);
  return c.num_hidden_layers * (2.0 * params * n + 4.0 * c.head_dim * c.num_attention_heads * pairs) +
         2.0 * c.vocab_size * c.hidden_size;
}

/// Host wall time (ms) of Engine::prefill of n random tokens into a fresh sequence, through the
/// returned token: median of `reps` runs after one warm-up run (one-time costs such as loading
/// cuBLAS's kernels are paid there, as llama-bench does).
replay_examples::stats prefill_ms(Decoder& eng, int n, std::uint64_t seed, int reps) {
  const std::vector<int> p = random_prompt(n, eng.config().vocab_size, seed);
  auto& book = eng.kv();
  const int slot = book.acquire_slot();
  book.ensure(slot, n);
  (void)eng.prefill(slot, p, 0);
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    replay_examples::stopwatch sw;
    (void)eng.prefill(slot, p, 0);
    ms.push_back(sw.elapsed_ms());
  }
  book.release(slot);
  return replay_examples::summarize(ms);
}

#if QWEN_WITH_NCCL
/// Tensor parallel: the GPU time of one decode step's collectives alone at `rows` rows, in ms: a graph
/// of the greedy step's collectives, in its order and sizes (2 x layers sums of rows x hidden floats,
/// through NCCL in place or, `one_shot`, launch_peer_sum into the residual, then the max of rows
/// argmax keys), captured on every rank and replayed on all at once; rank 0's median of 20 replays.
double step_collectives_ms(TpEngine& tp, int rows, bool one_shot) {
  const Config& c = tp.config();
  std::vector<double> ms(static_cast<std::size_t>(tp.tp()));
  tp.for_each_rank([&](int r, Engine& e) {
    const replay::nccl_comm_ref comm = tp.comm(r);
    const PeerSum& peers = tp.peer_sum(r);
    const replay::stream_ref s = e.stream();
    replay::device_buffer<float> x(std::size_t(rows) * c.hidden_size);
    replay::device_buffer<std::uint64_t> keys(static_cast<std::size_t>(rows));
    REPLAY_CHECK(cudaMemsetAsync(x.data(), 0, x.size_bytes(), s.get()));
    REPLAY_CHECK(cudaMemsetAsync(keys.data(), 0, keys.size_bytes(), s.get()));
    const auto exec = replay::capture(s, [&](replay::stream_ref cs) {
                        for (int l = 0; l < 2 * c.num_hidden_layers; ++l) {
                          if (one_shot) launch_peer_sum(peers, l % 2, x.size(), x.data(), cs);
                          else replay::all_reduce(comm, x.data(), x.data(), x.size(), ncclSum, cs);
                        }
                        replay::all_reduce(comm, keys.data(), keys.data(), keys.size(), ncclMax, cs);
                      }).instantiate({.upload_stream = s.get()});
    ms[static_cast<std::size_t>(r)] = replay_examples::median_gpu_ms(s, 20, [&] { exec.launch(s); });
  });
  return ms[0];
}
#endif

/// The D2D copy rate of every GPU the engine uses (one at --tp 1), measured now.
std::vector<double> d2d_per_device(Decoder& eng) {
#if QWEN_WITH_NCCL
  if (auto* tp = dynamic_cast<TpEngine*>(&eng)) {
    std::vector<double> bw(static_cast<std::size_t>(tp->tp()));
    tp->for_each_rank([&](int r, Engine& e) { bw[static_cast<std::size_t>(r)] = d2d_bandwidth(e.stream()); });
    return bw;
  }
#endif
  return {d2d_bandwidth(eng.stream())};
}

/// Padding waste of the bucket policy if batch sizes 1..max are equally likely.
double uniform_padding_waste(const Decoder& e, int max) {
  double real = 0, run = 0;
  for (int n = 1; n <= max; ++n) real += n, run += e.bucket_for(n);
  return 1.0 - real / run;
}

}  // namespace

void size_for_bench(const Config& cfg, const BenchOptions& o, bool size_kv, EngineOptions& opt) {
  for (int b : o.batches) opt.max_batch = std::max(opt.max_batch, b);
  if (size_kv) {
    // The bench's largest request (a full batch of short prompts, or the long prompt) sizes the KV budget.
    const std::int64_t per_seq = (std::int64_t(o.prompt.size()) + o.steps + 1 + opt.block_size - 1) / opt.block_size;
    std::int64_t blocks = 0;
    for (int b : o.batches) blocks = std::max(blocks, b * per_seq);
    blocks = std::max(blocks, (std::int64_t(o.long_prompt) + o.steps + 1 + opt.block_size - 1) / opt.block_size);
    for (int n : o.prefill) blocks = std::max(blocks, (std::int64_t(n) + opt.block_size - 1) / opt.block_size);
    opt.kv_budget_bytes = std::max(opt.kv_budget_bytes, std::size_t(blocks + 2) * opt.block_bytes(cfg));
  }
}

void validate_bench(const Config& cfg, const EngineOptions& opt, const BenchOptions& o) {
  std::vector<SequenceRequest> bseqs;
  for (int b : o.batches) {
    if (b < 1 || b > 1024) throw input_error("--bench-batches: batch sizes must be in 1..1024");
    bseqs.assign(b, SequenceRequest{o.prompt, o.steps + 1});
    validate_request(cfg, opt, bseqs);
  }
  if (o.long_prompt > 0)
    validate_request(cfg, opt, {SequenceRequest{std::vector<int>(o.long_prompt, 0), o.steps + 1}});
  for (int n : o.prefill) {
    if (n < 1) throw input_error("--bench-prefill: prompt lengths must be positive");
    validate_request(cfg, opt, {SequenceRequest{std::vector<int>(n, 0), 0}});
  }
}

/// The benchmark: batch-1 TPOT per mode and of the device loop against the bytes floor and the
/// kernel-per-matrix chain floor (both measured now), batch 1 after a long prompt, batched throughput.
void run_bench(Decoder& eng, const BenchOptions& o, const std::string& dev, json& out) {
  const Config& cfg = eng.config();
  const auto& prompt = o.prompt;
  const int steps = o.steps;
  const bool graph = std::find(o.modes.begin(), o.modes.end(), "graph") != o.modes.end();
  if (graph) {
    replay_examples::stopwatch sw;
    const std::size_t n = eng.prewarm_graphs();  // every bucket captured up front, largest first
    fmt::print("prewarm: {} graphs captured in {:.1f} ms\n", n, sw.elapsed_ms());
  }
  // Tensor parallel (--tp N): each GPU reads its share of the weights per step (wbytes) at its own
  // D2D rate, so wbytes / TPOT against the mean per-GPU rate is the share of the aggregate D2D
  // bandwidth; the single-GPU floors (read-only kernel, chain) are skipped.
  const int tp = eng.options().tp_size;
  const std::vector<double> bws = d2d_per_device(eng);
  const double bw = std::accumulate(bws.begin(), bws.end(), 0.0) / static_cast<double>(bws.size());
  const double wbytes = static_cast<double>(cfg.decode_weight_bytes(tp));
  const char* pct = tp > 1 ? "% of aggregate D2D" : "% of D2D";
  // The K/V bytes one sequence's step reads per token of context (every layer, K and V; a rank's
  // share of the kv heads under tensor parallel).
  const double kv_per_token = 2.0 * cfg.num_hidden_layers * cfg.kv_dim() * sizeof(bf16) / tp;
  out["bench"]["tp_size"] = tp;
  fmt::print("\n## Batch-1 decode, {} ({}{}), {} prompt tokens, {} steps\n", cfg.name, dev,
             tp > 1 ? fmt::format(" x {}, tensor parallel", tp) : std::string(), prompt.size(), steps);
  std::vector<long> gbps;
  for (double b : bws) gbps.push_back(static_cast<long>(b / 1e9 + 0.5));
  if (tp > 1)
    fmt::print("weights read per step per GPU: {:.1f} MiB; D2D copy bandwidth per GPU: {:.0f} GB/s (mean of {} GB/s; "
               "read + write); bytes floor {:.3f} ms\n",
               mib(wbytes), bw / 1e9, fmt::join(gbps, ", "), wbytes / bw * 1e3);
  else
    fmt::print("weights read per step: {:.1f} MiB; D2D copy bandwidth: {:.0f} GB/s (read + write); bytes floor {:.3f} ms\n",
               mib(wbytes), bw / 1e9, wbytes / bw * 1e3);
  const double rbw = tp == 1 ? read_bandwidth(eng.stream()) : 0.0;
  if (rbw > 0)
    fmt::print("read-only streaming kernel: {:.0f} GB/s ({:.1f}% of D2D); at that rate the weights take {:.3f} ms\n",
               rbw / 1e9, 100.0 * rbw / bw, wbytes / rbw * 1e3);
  const double chain_ms = tp == 1 ? chain_floor_ms(cfg, eng.stream()) : 0.0;
  if (chain_ms > 0)
    fmt::print("kernel-per-matrix chain floor (a graph of {} streaming-read kernels with this step's matrix sizes, "
               "PDL): {:.3f} ms\n",
               5 * cfg.num_hidden_layers + 1, chain_ms);
  else if (tp == 1)
    fmt::print("kernel-per-matrix chain floor: skipped (no device memory for a copy of the weights)\n");
  replay_examples::table t({"mode", "TPOT median (ms)", "p10 (ms)", "p90 (ms)", "tokens/s", pct,
                            "x bytes floor", "x chain floor"});
  double tpot_graph_ms = 0;
  std::map<std::string, double> tpot_ms;  // per mode
  auto add_tpot_row = [&](const std::string& name, const replay_examples::stats& st) {
    const double tpot = st.median * 1e-6;
    t.add_row({name, fmt::format("{:.3f}", st.median / 1e3), fmt::format("{:.3f}", st.p10 / 1e3),
               fmt::format("{:.3f}", st.p90 / 1e3), fmt::format("{:.1f}", 1.0 / tpot),
               fmt::format("{:.1f}", 100.0 * wbytes / tpot / bw), fmt::format("{:.2f}", tpot / (wbytes / bw)),
               chain_ms > 0 ? fmt::format("{:.2f}", st.median / 1e3 / chain_ms) : std::string("-")});
    out["bench"]["batch1"][name] = {{"tpot_ms", st.median / 1e3}, {"p10_ms", st.p10 / 1e3}, {"p90_ms", st.p90 / 1e3},
                                    {"tokens_per_s", 1.0 / tpot}, {"eff_bw_GBps", wbytes / tpot / 1e9},
                                    {"pct_d2d", 100.0 * wbytes / tpot / bw}};
  };
  for (const auto& m : o.modes) {
    std::vector<SequenceRequest> one{{prompt, steps + 1}};
    (void)run_schedule(eng, std::vector<SequenceRequest>{{prompt, 4}}, {0}, m == "graph", false);  // warm-up
    const auto r = run_schedule(eng, one, {0}, m == "graph", false);
    const auto st = replay_examples::summarize(r.step_us);
    if (m == "graph") tpot_graph_ms = st.median / 1e3;
    tpot_ms[m] = st.median / 1e3;
    add_tpot_row(m, st);
  }
  if (tpot_graph_ms > 0 && tp == 1) {  // the device loop runs on one GPU
    // The device loop at K = 1 and K = 16 tokens per launch: per token, the host wall time of a
    // launch (push, launch, read back) over the tokens it produced; `steps` samples each (the same
    // sequence rerun as often as needed), median.
    double loop_us[2] = {0, 0};
    const int ks[2] = {1, 16};
    for (int i = 0; i < 2; ++i) {
      (void)run_looped(eng, SequenceRequest{prompt, 4}, ks[i]);  // warm-up (the first captures the loop)
      std::vector<double> per_token;
      for (int rep = 0; rep < 64 && per_token.size() < static_cast<std::size_t>(steps); ++rep) {
        const auto r = run_looped(eng, SequenceRequest{prompt, steps + 1}, ks[i]);
        per_token.insert(per_token.end(), r.step_us.begin(), r.step_us.end());
      }
      const auto st = replay_examples::summarize(per_token);
      loop_us[i] = st.median;
      add_tpot_row(fmt::format("loop K={}", ks[i]), st);
    }
    // Per token, a launch of K tokens costs about d + h / K: d on the device, h on the host once
    // per launch (the metadata push, the launch, the wait for the read-back).
    const double h = (loop_us[0] - loop_us[1]) * 16.0 / 15.0, d = loop_us[0] - h;
    fmt::print("device loop per token: K=1 {:.1f} us, K=16 {:.1f} us, per-step graph {:.1f} us; as d + h/K: "
               "device d = {:.1f} us, host share per launch h = {:.1f} us (K=16 pays {:.1f} us of it per token)\n",
               loop_us[0], loop_us[1], tpot_graph_ms * 1e3, d, h, h / 16.0);
    out["bench"]["loop_fit"] = {{"device_us_per_token", d}, {"host_us_per_launch", h}};
  }
  out["bench"]["d2d_GBps"] = bw / 1e9;
  if (rbw > 0) out["bench"]["read_GBps"] = rbw / 1e9;
  out["bench"]["bytes_floor_ms"] = wbytes / bw * 1e3;
  if (chain_ms > 0) out["bench"]["chain_floor_ms"] = chain_ms;
  out["bench"]["weight_bytes_per_step"] = wbytes;
  fmt::print("{}", t.markdown());
  if (tpot_ms.size() == 2)
    fmt::print("eager vs graph TPOT: {:.3f} ms vs {:.3f} ms (graph {:.2f}x faster)\n", tpot_ms["eager"],
               tpot_ms["graph"], tpot_ms["eager"] / tpot_ms["graph"]);

  if (o.long_prompt > 0) {
    // Batch 1 after a long prompt: each step also reads the sequence's K/V (every layer, K and V).
    const std::vector<int> lp = random_prompt(o.long_prompt, cfg.vocab_size, o.seed + 99);
    const auto r = run_schedule(eng, {SequenceRequest{lp, steps + 1}}, {0}, true, false);
    const auto st = replay_examples::summarize(r.step_us);
    const double kv_bytes = kv_per_token * (o.long_prompt + steps / 2.0);  // mean context over the steps
    const double floor_ms = (wbytes + kv_bytes) / bw * 1e3;
    fmt::print("\n## Long context: batch 1 (graph) after a {}-token prompt, {} steps\n"
               "TPOT median {:.3f} ms; bytes floor (weights + {:.1f} MiB of K/V per step) {:.3f} ms: {:.2f}x\n",
               o.long_prompt, steps, st.median / 1e3, mib(kv_bytes), floor_ms, st.median / 1e3 / floor_ms);
    out["bench"]["long_context"] = {{"prompt", o.long_prompt}, {"tpot_ms", st.median / 1e3},
                                    {"kv_bytes_per_step", kv_bytes}, {"bytes_floor_ms", floor_ms}};
  }

  if (!o.prefill.empty()) {
    // Prefill against its compute floor: the prompt's FLOPs at cuBLAS's bf16 GEMM rate, measured now.
    const double rate = gemm_rate(eng.stream());
    fmt::print("\n## Prefill, {} ({}), chunks of up to {} tokens; warm, median of 5 runs\n"
               "cuBLAS bf16 GEMM (8192^3, fp32 accumulate): {:.0f} TFLOP/s\n",
               cfg.name, dev, eng.options().prefill_chunk, rate / 1e12);
    out["bench"]["gemm_bf16_tflops"] = rate / 1e12;
    for (int n : o.prefill) {
      const auto st = prefill_ms(eng, n, o.seed + 5, 5);
      const double flops = prefill_flops(cfg, n), floor_ms = flops / rate * 1e3;
      fmt::print("prefill {} tokens: {:.2f} ms ({:.0f} tok/s), compute floor {:.2f} ms (x{:.2f}); {:.2f} TFLOP, "
                 "{:.0f} TFLOP/s; p10 {:.2f} ms, p90 {:.2f} ms\n",
                 n, st.median, n / (st.median * 1e-3), floor_ms, st.median / floor_ms, flops / 1e12,
                 flops / (st.median * 1e-3) / 1e12, st.p10, st.p90);
      out["bench"]["prefill"][std::to_string(n)] = {{"ms", st.median}, {"p10_ms", st.p10}, {"p90_ms", st.p90},
                                                   {"tokens_per_s", n / (st.median * 1e-3)}, {"flops", flops},
                                                   {"compute_floor_ms", floor_ms}, {"x_floor", st.median / floor_ms}};
    }
  }

  // A batched step's bytes floor: the weights once, plus the K/V of every sequence at its mean
  // context over the steps (the prompt plus half the steps).
  replay_examples::table tb({"batch", "bucket", "mode", "step median (ms)", "tokens/s", "x batch-1 graph TPOT",
                             "bytes floor (ms)", "x bytes floor"});
  for (int b : o.batches) {
    for (const auto& m : o.modes) {
      std::vector<SequenceRequest> bs;
      for (int i = 0; i < b; ++i)
        bs.push_back({random_prompt(static_cast<int>(prompt.size()), cfg.vocab_size, o.seed + 7 * i), steps + 1});
      std::vector<int> j(b, 0);
      (void)run_schedule(eng, bs, j, m == "graph", false);
      const auto r = run_schedule(eng, bs, j, m == "graph", false);
      const auto st = replay_examples::summarize(r.step_us);
      const double kv_bytes = kv_per_token * b * (static_cast<double>(prompt.size()) + steps / 2.0);
      const double floor_ms = (wbytes + kv_bytes) / bw * 1e3;
      tb.add_row({std::to_string(b), std::to_string(eng.bucket_for(b)), m, fmt::format("{:.3f}", st.median / 1e3),
                  fmt::format("{:.0f}", b / (st.median * 1e-6)),
                  tpot_graph_ms > 0 ? fmt::format("{:.2f}", st.median / 1e3 / tpot_graph_ms) : std::string("-"),
                  fmt::format("{:.3f}", floor_ms), fmt::format("{:.2f}", st.median / 1e3 / floor_ms)});
      out["bench"]["batched"][m][std::to_string(b)] = {{"step_ms", st.median / 1e3},
                                                      {"tokens_per_s", b / (st.median * 1e-6)},
                                                      {"bucket", eng.bucket_for(b)},
                                                      {"kv_bytes_per_step", kv_bytes},
                                                      {"bytes_floor_ms", floor_ms}};
    }
  }
  fmt::print("\n## Batched decode ({} steps, prompt {} tokens)\n{}", steps, prompt.size(), tb.markdown());
#if QWEN_WITH_NCCL
  if (auto* tpe = dynamic_cast<TpEngine*>(&eng)) {
    // The step's collectives alone, per bucket the bench ran, against that bucket's graph step:
    // through NCCL, and over peer memory where the engine set it up (its default).
    const bool one_shot = tpe->options().tp_sum == TpSum::one_shot;
    replay_examples::table tc({"bucket", "NCCL sums (ms)", "one-shot sums (ms)", "graph step (ms)",
                               fmt::format("share ({})", one_shot ? "one-shot" : "NCCL")});
    std::vector<int> bs{1};
    for (int b : o.batches) bs.push_back(eng.bucket_for(b));
    std::sort(bs.begin(), bs.end());
    bs.erase(std::unique(bs.begin(), bs.end()), bs.end());
    json& jt = out["bench"]["tp"];
    jt["tp"] = tp;
    jt["sum"] = one_shot ? "one-shot" : "nccl";
    for (double b : bws) jt["d2d_GBps_per_device"].push_back(b / 1e9);
    jt["weight_bytes_per_rank"] = wbytes;
    for (int b : bs) {
      const double nccl_ms = step_collectives_ms(*tpe, b, false);
      const double peer_ms = one_shot ? step_collectives_ms(*tpe, b, true) : 0.0;
      const double cms = one_shot ? peer_ms : nccl_ms;
      double step_ms = b == 1 ? tpot_graph_ms : 0.0;
      for (int n : o.batches)
        if (eng.bucket_for(n) == b && out["bench"]["batched"].contains("graph"))
          step_ms = out["bench"]["batched"]["graph"][std::to_string(n)]["step_ms"].get<double>();
      tc.add_row({std::to_string(b), fmt::format("{:.3f}", nccl_ms), one_shot ? fmt::format("{:.3f}", peer_ms) : "-",
                  step_ms > 0 ? fmt::format("{:.3f}", step_ms) : "-",
                  step_ms > 0 ? fmt::format("{:.1f}%", 100.0 * cms / step_ms) : "-"});
      jt["collectives_ms"][std::to_string(b)] = cms;
      jt["collectives_nccl_ms"][std::to_string(b)] = nccl_ms;
      if (one_shot) jt["collectives_one_shot_ms"][std::to_string(b)] = peer_ms;
      if (step_ms > 0) jt["collectives_share"][std::to_string(b)] = cms / step_ms;
    }
    fmt::print("\n## Tensor parallel over {} GPUs: one step's collectives alone ({} sums of rows x {} fp32 and one "
               "max of rows argmax keys through NCCL, a graph, median)\n{}",
               tp, 2 * cfg.num_hidden_layers, cfg.hidden_size, tc.markdown());
  }
#endif
  const int largest = eng.buckets().back();
  const double waste = uniform_padding_waste(eng, largest);
  fmt::print("bucket policy: powers of two up to {}; padding waste for batch sizes 1..{} equally likely: {:.1f}%\n",
             largest, largest, 100.0 * waste);
  out["bench"]["uniform_padding_waste"] = waste;
}

/// The memory report: weights, KV pool, buffers and the captured graphs, and the graph counters.
void report_memory(const Decoder& eng, bool quiet, json& out) {
  const auto gs = eng.graph_stats();
  out["memory"] = {{"weights_bytes", eng.weight_bytes()}, {"kv_pool_bytes", eng.kv_pool_bytes()},
                   {"buffers_bytes", eng.buffer_bytes()}, {"graphs_bytes", gs.graph_bytes}};
  json kpb = json::object();
  for (const auto& [b, k] : gs.nodes_per_bucket) kpb[std::to_string(b)] = k;
  out["pool"] = json::parse(eng.pool_stats().to_json());
  out["graphs"] = {{"captures", gs.captures}, {"replays", gs.replays}, {"eager_steps", gs.eager_steps},
                   {"fallback_steps", gs.fallback_steps}, {"nodes_per_bucket", kpb},
                   {"padded_rows", gs.padded_rows}, {"real_rows", gs.real_rows}};
  if (quiet) return;
  std::string kp;
  for (const auto& [b, k] : gs.nodes_per_bucket) kp += fmt::format(" {}:{}", b, k);
  fmt::print("memory: weights {:.1f} MiB, KV pool {:.1f} MiB, buffers {:.1f} MiB, graphs {:.2f} MiB ({} captured; "
             "nodes per bucket{})\n",
             mib(eng.weight_bytes()), mib(eng.kv_pool_bytes()), mib(eng.buffer_bytes()), mib(gs.graph_bytes),
             gs.captures, kp);
}

}  // namespace qwen
