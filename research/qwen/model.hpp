// research/qwen/model.hpp: a Qwen3 decoder (Hugging Face Qwen3ForCausalLM) with a paged KV cache,
// eager and CUDA-graph batched decode. The library target `replay_example_qwen`.
//
// Pipeline of one decode step (see README.md for each kernel):
//   embed -> L x [ (norm+QKV GEMV) -> attention (q/k norm, RoPE, paged KV write + read)
//                  -> (O GEMV + residual) -> (norm + gate/up GEMV + SiLU*up) -> (down GEMV + residual) ]
//         -> (final norm + lm_head GEMV + argmax)
// Buckets of up to kGemvMaxRows rows use the fused GEMV kernels; larger buckets use cuBLAS GEMMs
// with separate norm / SiLU / argmax kernels (the same kernels prefill uses).
//
// Static: weights, activations, logits, the KV pool, the RoPE table (all allocated once).
// Paged: K/V, addressed through per-sequence block tables.
// Read through metadata at fixed addresses: each row's token, position and block-table slot, and
// the block tables themselves; so one captured graph per bucket serves every step.
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

/// Device-side weights; layer matrices fused as the kernels want them (QKV stacked, gate/up stacked).
struct LayerWeights {
  const bf16* wqkv;       ///< [q_dim + 2 kv_dim][hidden]: q_proj; k_proj; v_proj
  const bf16* wo;         ///< [hidden][q_dim]
  const bf16* wgu;        ///< [2 intermediate][hidden]: gate_proj; up_proj
  const bf16* wdown;      ///< [hidden][intermediate]
  const bf16* in_norm;    ///< [hidden] input_layernorm
  const bf16* post_norm;  ///< [hidden] post_attention_layernorm
  const bf16* q_norm;     ///< [head_dim]
  const bf16* k_norm;     ///< [head_dim]
};

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
  /// them), eagerly, in chunks. Returns the greedy next token after the last one; writes that row's
  /// logits (vocab floats) to `logits` when non-empty.
  int prefill(int slot, std::span<const int> tokens, int start, std::span<float> logits = {});

  /// One decode step for `rows` (1..max_batch rows, distinct slots), padded to its bucket. Eager
  /// launches, or the bucket's graph (captured on first use); above the largest bucket it runs
  /// eagerly when eager_fallback is on and throws input_error otherwise. Writes the next token of each row to
  /// `next`, and the rows' logits (rows x vocab) to `logits` when non-empty.
  void decode(std::span<const DecodeRow> rows, bool use_graph, std::span<int> next, std::span<float> logits = {});

  /// Captures (and uploads) the graph of every bucket up to `max_rows` now, largest first.
  void prewarm_graphs(int max_rows);

  [[nodiscard]] GraphStats graph_stats() const;
  /// The full statistics of the bucketed graph pool (per key: hits, captures, capture time, memory).
  [[nodiscard]] replay::pool_stats pool_stats() const;
  /// Which decode kernels buckets of 1..4 rows run (and the streaming kernel's geometry per bucket).
  [[nodiscard]] std::string describe_kernels() const;
  /// With EngineOptions::stream_trace: the streaming kernel's phase completion gaps of the bucket's last
  /// step, summarised per phase kind (empty otherwise).
  [[nodiscard]] std::string stream_trace_summary(int bucket) const;
  [[nodiscard]] std::size_t weight_bytes() const;   ///< device bytes of all weights
  [[nodiscard]] std::size_t kv_pool_bytes() const;  ///< device bytes of the KV pool
  [[nodiscard]] std::size_t buffer_bytes() const;   ///< activations, logits, metadata, workspace

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace qwen
