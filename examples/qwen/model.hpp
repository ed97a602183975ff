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
// Tensor parallel (EngineOptions::tp_size > 1, built with QWEN_WITH_NCCL): the engine is one rank's
// shard, given its communicators; tp.hpp runs one per GPU (README, "Tensor parallel").
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
#if QWEN_WITH_NCCL
#  include <replay/nccl.hpp>
#endif

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

/// What the CLI's runs (schedule.hpp), the benchmark and main.cu use of a decoder: one GPU's Engine,
/// or a tensor-parallel group of them (TpEngine, tp.hpp), which behaves as one. The comments here
/// describe Engine; TpEngine's differences are in tp.hpp.
class Decoder {
 public:
  virtual ~Decoder() = default;

  [[nodiscard]] virtual const Config& config() const = 0;
  [[nodiscard]] virtual const EngineOptions& options() const = 0;
  /// The KV bookkeeping: acquire slots and back positions with blocks here before prefill/decode.
  [[nodiscard]] virtual PagedKvBook& kv() = 0;
  /// The engine's stream (tensor parallel: rank 0's, on device 0).
  [[nodiscard]] virtual replay::stream_ref stream() const = 0;

  /// Graph buckets (powers of two up to max_bucket) and the rows a batch of n runs with: its bucket,
  /// or n itself above the largest bucket (eager fallback).
  [[nodiscard]] virtual const std::vector<int>& buckets() const = 0;
  [[nodiscard]] virtual int bucket_for(int rows) const = 0;

  /// Prefills `tokens` at positions [start, start + n) of `slot` (whose blocks must already back
  /// them), eagerly, in chunks. Returns the next token after the last one (greedy, or sampled with
  /// the sampling parameters); writes that row's logits (vocab floats) to `logits` when non-empty.
  virtual int prefill(int slot, std::span<const int> tokens, int start, std::span<float> logits = {}) = 0;

  /// One decode step for `rows` (1..max_batch rows, distinct slots), padded to its bucket. Eager
  /// launches, or the bucket's graph (captured on first use); above the largest bucket it runs
  /// eagerly when eager_fallback is on and throws input_error otherwise. Writes the next token of
  /// each row to `next`, and the rows' logits (rows x vocab) to `logits` when non-empty.
  virtual void decode(std::span<const DecodeRow> rows, bool use_graph, std::span<int> next,
                      std::span<float> logits = {}) = 0;

  /// Decodes up to `k` tokens of one sequence with one graph launch (Engine::decode_loop).
  virtual int decode_loop(int slot, int token, int pos, int k, int stop_token, std::span<int> out) = 0;

  /// Sets the sampling parameters used by prefill, decode and decode_loop from the next call on. They
  /// are copied to the device only when they change, and read there by the sampler, so no graph is
  /// recaptured. Throws input_error for invalid values (SampleParams::validate), and for a
  /// temperature above 0 on an engine built with EngineOptions::sampling off (which decodes greedily).
  virtual void set_sampling(const SampleParams& p) = 0;
  /// The sampling parameters in force (default: greedy).
  [[nodiscard]] virtual const SampleParams& sampling() const = 0;

  /// Captures (and uploads) the graph of every bucket now, largest first. Returns how many were
  /// captured.
  virtual std::size_t prewarm_graphs() = 0;

  [[nodiscard]] virtual GraphStats graph_stats() const = 0;
  /// The full statistics of the bucketed graph pool (per key: hits, captures, capture time, memory).
  [[nodiscard]] virtual replay::pool_stats pool_stats() const = 0;
  /// Which kernels each bucket runs (fused GEMV kernel per matrix, or cuBLAS; attention splits).
  [[nodiscard]] virtual std::string describe_kernels() const = 0;
  [[nodiscard]] virtual std::size_t weight_bytes() const = 0;   ///< device bytes of all weights (per rank)
  [[nodiscard]] virtual std::size_t kv_pool_bytes() const = 0;  ///< device bytes of the KV pool (per rank)
  [[nodiscard]] virtual std::size_t buffer_bytes() const = 0;   ///< the arena + metadata (per rank)

 protected:
  Decoder() = default;
  Decoder(const Decoder&) = default;
  Decoder& operator=(const Decoder&) = default;
};

#if QWEN_WITH_NCCL
/// One tensor-parallel rank's communicators, borrowed (they outlive the engine): `step` carries the
/// step's collectives; `agree` (made with nccl_comm::split) only the lockstep runner's agreements;
/// `sum` (EngineOptions::tp_sum one_shot) the group's exchange buffers and flags, each rank's
/// buffers holding max(max_batch, prefill_chunk) rows of the hidden size per slot.
struct TpComms {
  replay::nccl_comm_ref step;
  replay::nccl_comm_ref agree;
  PeerSum sum;
};
#endif

/// The decoder: weights, buffers, paged KV pool, step metadata and the graphs, all owned.
/// Move-only (it owns device memory); not thread-safe.
class Engine final : public Decoder {
 public:
  /// Builds the engine. `weights == nullptr`: deterministic random initialisation on the GPU.
  /// Validates everything (config, weights, sizes) before the first GPU allocation.
  Engine(const Config& cfg, const EngineOptions& opt, const replay_examples::safetensors* weights);
#if QWEN_WITH_NCCL
  /// One rank (opt.tp_rank of opt.tp_size) of a tensor-parallel group, on the current device, which
  /// must be the communicators' (README, "Tensor parallel"). Every rank is built and then driven
  /// by its own host thread, with the same calls in the same order (tp.hpp does that).
  Engine(const Config& cfg, const EngineOptions& opt, const replay_examples::safetensors* weights, TpComms comms);
#endif
  ~Engine() override;
  Engine(Engine&&) noexcept;
  Engine& operator=(Engine&&) noexcept;

  [[nodiscard]] const Config& config() const override;
  [[nodiscard]] const EngineOptions& options() const override;
  [[nodiscard]] PagedKvBook& kv() override;
  [[nodiscard]] replay::stream_ref stream() const override;
  [[nodiscard]] const std::vector<int>& buckets() const override;
  [[nodiscard]] int bucket_for(int rows) const override;

  /// Decoder::prefill. Tensor parallel: writes this rank's vocabulary columns of `logits` only.
  int prefill(int slot, std::span<const int> tokens, int start, std::span<float> logits = {}) override;
  /// Decoder::decode. Tensor parallel: writes this rank's vocabulary columns of `logits` only.
  void decode(std::span<const DecodeRow> rows, bool use_graph, std::span<int> next,
              std::span<float> logits = {}) override;
  void set_sampling(const SampleParams& p) override;
  [[nodiscard]] const SampleParams& sampling() const override;
  /// Captures (and uploads) the graph of every bucket now, largest first
  /// (replay::step_runner::prewarm_buckets; tensor parallel: the lockstep runner's, collective).
  std::size_t prewarm_graphs() override;

  /// Diagnostics: issues the launches of one decode step for a bucket of `rows` rows on `s`, reading
  /// the metadata the last decode() staged (what the graph pool captures). Used by the frozen-value
  /// audit and by --dump-graph.
  void record_decode_step(int rows, replay::stream_ref s);

  [[nodiscard]] GraphStats graph_stats() const override;
  [[nodiscard]] replay::pool_stats pool_stats() const override;
  [[nodiscard]] std::string describe_kernels() const override;
  [[nodiscard]] std::size_t weight_bytes() const override;
  [[nodiscard]] std::size_t kv_pool_bytes() const override;
  [[nodiscard]] std::size_t buffer_bytes() const override;  ///< the arena (activations, logits, tables, workspace) + metadata

  /// Decodes up to `k` tokens (1..kMaxTokensPerLaunch) of one sequence with one graph launch: a
  /// device loop (replay::token_loop) whose body is the bucket-1 decode step followed by a kernel
  /// that appends the step's token and advances row 0's token and position on the device. `token`
  /// at `pos` is the first step's input (positions [0, pos) are in the cache). Before the launch the
  /// host reserves the KV blocks of positions [pos, pos + k) (PagedKvBook::ensure, capped at the
  /// context) and pushes the block table. The loop stops after k steps, after appending
  /// `stop_token` (-1: none), or when a token fills the context (max_context tokens). Writes the
  /// tokens to `out` (at least k long) and returns how many; they equal what k calls of decode()
  /// would give. The loop's graph is captured on first use. Throws input_error for a bad slot,
  /// token, position or k, and as PagedKvBook::ensure does when the blocks run out; tensor parallel
  /// (tp_size > 1), always input_error: the device loop is single-GPU.
  int decode_loop(int slot, int token, int pos, int k, int stop_token, std::span<int> out) override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace qwen
