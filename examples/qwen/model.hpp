// examples/qwen/model.hpp: a Qwen3 decoder (Hugging Face Qwen3ForCausalLM) with a paged KV cache,
// eager and CUDA-graph batched decode. The library target `replay_example_qwen`.
//
// One decode step (model.cu, Engine::Impl::step) is a list of launches:
//   embed -> L x [ QKV GEMV (input RMSNorm folded in) -> attention (q/k norm, RoPE, paged KV write
//                  and read) -> O GEMV + residual -> gate/up GEMV (RMSNorm folded in) + SiLU*up
//                  -> down GEMV + residual ] -> lm_head GEMV (final RMSNorm folded in) + argmax
// With EngineOptions::sampling on, the lm_head writes the logits and a sampler (sample.cu) picks each
// row's token instead of the argmax: greedy at temperature 0, else a draw from softmax(logits / T)
// restricted to top-k then top-p. Its parameters (set_sampling) are step metadata, and its random
// numbers a function of (seed, position, token), so graphs, buckets and the device loop all give
// the tokens eager decode gives, and changing the parameters captures nothing.
// Buckets of up to EngineOptions::gemv_max_rows rows run the fused GEMV (batch 1 on the CUDA cores;
// 2 to 16 rows on the tensor cores where x leaves room for its ring); the other projections of
// those buckets, larger buckets and prefill run cuBLAS GEMMs with separate RMSNorm / SiLU*up /
// argmax kernels.
//
// Static: weights, the KV pool, and every buffer (one replay::static_arena), allocated once.
// Paged: K/V, addressed through per-sequence block tables.
// Read through metadata at fixed addresses: each row's token, position and block-table slot, and
// the block tables; so one captured graph per bucket serves every step.
// At batch 1, decode_loop() decodes up to K tokens per graph launch: a device loop (WHILE node)
// whose body is the bucket-1 step plus a kernel that advances row 0's token and position.
#pragma once

#include "config.hpp"
#include "kernels.cuh"
#include "options.hpp"
#include "paged_kv.hpp"
#include "weights.hpp"

#include <common/safetensors.hpp>
#include <replay/buffer.hpp>
#include <replay/graph_exec.hpp>
#include <replay/graph_pool.hpp>
#include <replay/step_meta.hpp>
#include <replay/stream.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace qwen {

/// Most tokens one decode_loop() launch produces (the device loop's buffer).
inline constexpr int kMaxTokensPerLaunch = 1024;

/// One row of a batched decode step: which sequence, its input token and that token's position.
struct DecodeRow {
  int slot;   ///< block-table row of the sequence (PagedKvBook slot)
  int token;  ///< input token id
  int pos;    ///< position of `token`; the KV for positions [0, pos] must be backed by blocks
};

/// Counters of the graph path (a summary of the replay::step_runner's pool statistics).
struct GraphStats {
  int captures = 0;                 ///< graphs captured (one per bucket used)
  long long replays = 0;            ///< graph launches (hits + first replays after capture)
  long long eager_steps = 0;        ///< steps run eagerly because eager mode was asked for
  long long fallback_steps = 0;     ///< graph-mode steps run eagerly (oversize batch or graph failure)
  long long real_rows = 0;          ///< rows of real sequences decoded on the graph path
  long long padded_rows = 0;        ///< rows run on the graph path including padding
  std::size_t graph_bytes = 0;      ///< device memory taken by resident graphs (measured at capture)
  std::map<int, std::size_t> nodes_per_bucket;  ///< nodes of each resident graph
};

/// The decoder: weights, buffers, paged KV pool, step metadata and the graphs, all owned.
/// Move-only (it owns device memory); not thread-safe.
class Engine {
 public:
  /// Builds the engine. `weights == nullptr`: deterministic random initialisation on the GPU.
  /// Validates everything (config, weights, sizes) before the first GPU allocation.
  Engine(const Config& cfg, const EngineOptions& opt, const replay_examples::safetensors* weights);
  ~Engine();
  Engine(Engine&&) noexcept;
  Engine& operator=(Engine&&) noexcept;

  [[nodiscard]] const Config& config() const;
  [[nodiscard]] const EngineOptions& options() const;
  [[nodiscard]] PagedKvBook& kv();
  [[nodiscard]] replay::stream_ref stream() const;

  /// Graph buckets (powers of two up to max_bucket) and the rows a batch of n runs with: its bucket,
  /// or n itself above the largest bucket (eager fallback).
  [[nodiscard]] const std::vector<int>& buckets() const;
  [[nodiscard]] int bucket_for(int rows) const;

  /// Prefills `tokens` at positions [start, start + n) of `slot` (whose blocks must already back
  /// them), eagerly, in chunks. Returns the next token after the last one (greedy, or sampled with
  /// the sampling parameters); writes that row's
  /// logits (vocab floats) to `logits` when non-empty.
  int prefill(int slot, std::span<const int> tokens, int start, std::span<float> logits = {});

  /// One decode step for `rows` (1..max_batch rows, distinct slots), padded to its bucket. Eager
  /// launches, or the bucket's graph (captured on first use); above the largest bucket it runs
  /// eagerly when eager_fallback is on and throws input_error otherwise. Writes the next token of each row to
  /// `next`, and the rows' logits (rows x vocab) to `logits` when non-empty.
  void decode(std::span<const DecodeRow> rows, bool use_graph, std::span<int> next, std::span<float> logits = {});

  /// Sets the sampling parameters used by prefill, decode and decode_loop from the next call on. They
  /// are copied to the device only when they change, and read there by the sampler, so no graph is
  /// recaptured. Throws input_error for invalid values (SampleParams::validate), and for a
  /// temperature above 0 on an engine built with EngineOptions::sampling off (which decodes greedily).
  void set_sampling(const SampleParams& p);
  /// The sampling parameters in force (default: greedy).
  [[nodiscard]] const SampleParams& sampling() const;

  /// Captures (and uploads) the graph of every bucket now, largest first
  /// (replay::step_runner::prewarm_buckets). Returns how many were captured.
  std::size_t prewarm_graphs();

  /// Diagnostics: issues the launches of one decode step for a bucket of `rows` rows on `s`, reading
  /// the metadata the last decode() staged (what the graph pool captures). Used by the frozen-value
  /// audit and by --dump-graph.
  void record_decode_step(int rows, replay::stream_ref s);

  [[nodiscard]] GraphStats graph_stats() const;
  /// The full statistics of the bucketed graph pool (per key: hits, captures, capture time, memory).
  [[nodiscard]] replay::pool_stats pool_stats() const;
  /// Which kernels each bucket runs (fused GEMV kernel per matrix, or cuBLAS; attention splits).
  [[nodiscard]] std::string describe_kernels() const;
  [[nodiscard]] std::size_t weight_bytes() const;   ///< device bytes of all weights
  [[nodiscard]] std::size_t kv_pool_bytes() const;  ///< device bytes of the KV pool
  [[nodiscard]] std::size_t buffer_bytes() const;   ///< the arena (activations, logits, tables, workspace) + metadata

  /// Decodes up to `k` tokens (1..kMaxTokensPerLaunch) of one sequence with one graph launch: a
  /// device loop (replay::token_loop) whose body is the bucket-1 decode step followed by a kernel
  /// that appends the step's token and advances row 0's token and position on the device. `token`
  /// at `pos` is the first step's input (positions [0, pos) are in the cache). Before the launch the
  /// host reserves the KV blocks of positions [pos, pos + k) (PagedKvBook::ensure, capped at the
  /// context) and pushes the block table. The loop stops after k steps, after appending
  /// `stop_token` (-1: none), or when a token fills the context (max_context tokens). Writes the
  /// tokens to `out` (at least k long) and returns how many; they equal what k calls of decode()
  /// would give. The loop's graph is captured on first use. Throws input_error for a bad slot,
  /// token, position or k, and as PagedKvBook::ensure does when the blocks run out.
  int decode_loop(int slot, int token, int pos, int k, int stop_token, std::span<int> out);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace qwen
