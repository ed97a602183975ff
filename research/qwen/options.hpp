// research/qwen/options.hpp: run-time sizes of the engine and the checks of a generation request.
//
// Host-only (no CUDA): everything a user can get wrong is checked here before any GPU work.
#pragma once

#include "config.hpp"
#include "paged_kv.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <string>
#include <vector>

namespace qwen {

/// Kernels of the decode step for buckets of 1..4 rows (larger buckets always use cuBLAS GEMMs).
enum class decode_kernels {
  rowpipe,       ///< one fused GEMV kernel per matrix, one warp per row, next chunk loaded while computing (kernels.cu)
  rowpipe_u8,    ///< the same with 8 loads in flight per lane
  ring,          ///< one fused GEMV kernel per matrix, one block per SM, per-warp shared-memory rings (kernels.cu)
  legacy,        ///< one fused GEMV kernel per matrix, one warp per row, 4 weight loads in flight (kernels.cu)
  legacy_u8,     ///< the same with 8 loads in flight per row
  stream_phase,  ///< streaming kernel (stream.cuh), one launch per phase (embed, QKV, attention, ...)
  stream_layer,  ///< streaming kernel, one launch per layer (+ embed, + lm_head)
  stream_step,   ///< streaming kernel, the whole step in one launch
  mega,          ///< persistent kernel for bucket 1 (mega.cuh: per-warp weight streams, tagged activations); ring otherwise
};

inline const char* decode_kernels_name(decode_kernels k) {
  switch (k) {
    case decode_kernels::rowpipe: return "rowpipe";
    case decode_kernels::rowpipe_u8: return "rowpipe8";
    case decode_kernels::ring: return "ring";
    case decode_kernels::legacy: return "legacy";
    case decode_kernels::legacy_u8: return "legacy8";
    case decode_kernels::stream_phase: return "phase";
    case decode_kernels::stream_layer: return "layer";
    case decode_kernels::stream_step: return "step";
    case decode_kernels::mega: return "mega";
  }
  return "?";
}

/// Parses rowpipe, rowpipe8, ring, legacy, legacy8, phase, layer, step or mega; throws input_error otherwise.
inline decode_kernels parse_decode_kernels(const std::string& s) {
  for (auto k : {decode_kernels::rowpipe, decode_kernels::rowpipe_u8, decode_kernels::ring, decode_kernels::legacy, decode_kernels::legacy_u8, decode_kernels::stream_phase,
                 decode_kernels::stream_layer, decode_kernels::stream_step, decode_kernels::mega})
    if (s == decode_kernels_name(k)) return k;
  throw input_error("unknown decode kernels '" + s + "' (known: rowpipe, rowpipe8, ring, legacy, legacy8, phase, layer, step, mega)");
}

/// Run-time sizes of the engine (everything is allocated once from these).
struct EngineOptions {
  int max_batch = 64;                        ///< rows the activation buffers hold (largest batch)
  int max_bucket = 64;                       ///< largest graph bucket (buckets: powers of two up to it)
  bool eager_fallback = true;                ///< batches above max_bucket run eagerly instead of failing
  int block_size = 16;                       ///< tokens per KV block
  std::size_t kv_budget_bytes = 1ull << 30;  ///< device memory for the KV pool
  int max_context = 4096;                    ///< tokens per sequence (prompt + generation) at most
  int prefill_chunk = 128;                   ///< prompt tokens per prefill pass
  std::uint64_t seed = 1234;                 ///< random initialisation seed (no weights path)
  float init_std = 0.02f;                    ///< std of random weights (uniform with this std)
  decode_kernels kernels = decode_kernels::mega;     ///< decode kernels of buckets 1..4 (mega: bucket 1 only; ring for 2..4)
  int stream_tile_bytes = 40 << 10;          ///< streaming kernel: weight bytes per work item (about)
  int stream_max_slots = 8;                  ///< streaming kernel: ring slots at most (2..8)
  bool stream_trace = false;                 ///< streaming kernel: record phase completion times (diagnostics)
  int mega_attn_splits = 0;                  ///< persistent kernel: attention chunks per context at most for items of one query head (0: as many as blocks per query head; 1..32); items of two get twice as many
  int mega_attn_heads = 0;                   ///< persistent kernel: query heads per attention item (0: 1, or 2 where that splits a long context finer; 1; 2)
  int mega_attn_min_chunk = 128;             ///< persistent kernel: positions per attention chunk at least (multiple of 64)
  bool mega_mma = true;                      ///< persistent kernel: GEMV rows on the tensor cores (false: the per-matrix kernels' FMA order)
  bool mega_tiles = true;                    ///< persistent kernel, tensor cores: rows in tiles of 4 rows (false: one row at a time per warp)

  /// KV blocks the budget buys for this config.
  [[nodiscard]] std::int64_t kv_blocks(const Config& c) const {
    return static_cast<std::int64_t>(kv_budget_bytes) / kv_block_bytes(c, block_size);
  }

  /// Throws input_error unless the sizes are usable with `c`.
  void validate(const Config& c) const {
    if (max_batch < 1 || max_batch > 1024) throw input_error("batch must be in 1..1024");
    if (max_bucket < 1 || max_bucket > 1024) throw input_error("largest bucket must be in 1..1024");
    if (block_size < 1 || block_size > 256) throw input_error("KV block size must be in 1..256");
    if (max_context < 2) throw input_error("max context must be at least 2 tokens");
    if (max_context > c.max_position_embeddings)
      throw input_error(fmt::format("max context {} exceeds the model's max_position_embeddings {}", max_context,
                                    c.max_position_embeddings));
    if (prefill_chunk < 1) throw input_error("prefill chunk must be positive");
    if (stream_tile_bytes < 1024 || stream_tile_bytes > (160 << 10))
      throw input_error("streaming tile must be in 1..160 KiB");
    if (stream_max_slots < 2 || stream_max_slots > 8) throw input_error("streaming slots must be in 2..8");
    if (mega_attn_splits < 0 || mega_attn_splits > 32) throw input_error("attention splits must be in 0..32");
    if (mega_attn_heads < 0 || mega_attn_heads > 2) throw input_error("query heads per attention item must be 0, 1 or 2");
    if (mega_attn_min_chunk < 64 || mega_attn_min_chunk % 64 != 0)
      throw input_error("attention's minimum chunk must be a positive multiple of 64");
    const std::int64_t nb = kv_blocks(c);
    if (nb < 2)
      throw input_error(fmt::format("KV memory budget of {} bytes holds {} blocks of {} bytes; at least 2 are needed",
                                    kv_budget_bytes, nb, kv_block_bytes(c, block_size)));
    if (nb > (1ll << 30)) throw input_error("KV memory budget too large");
  }
};

/// One sequence of a generation request.
struct SequenceRequest {
  std::vector<int> prompt;  ///< prompt token ids
  int generate = 0;         ///< tokens to generate after the prompt
};

/// Checks a request against the config and the engine sizes: token ids in range, prompt +
/// generation within the context and the KV budget (all sequences resident at once), and the batch
/// within the largest bucket unless eager fallback is on. Throws input_error naming the problem.
inline void validate_request(const Config& c, const EngineOptions& o, const std::vector<SequenceRequest>& seqs) {
  o.validate(c);
  if (seqs.empty()) throw input_error("no sequences requested");
  const int batch = static_cast<int>(seqs.size());
  if (batch > o.max_batch) throw input_error(fmt::format("batch {} exceeds the engine's maximum {}", batch, o.max_batch));
  if (batch > o.max_bucket && !o.eager_fallback)
    throw input_error(fmt::format("batch {} is larger than the largest graph bucket {} and eager fallback is off",
                                  batch, o.max_bucket));
  std::int64_t blocks = 0;
  for (int s = 0; s < batch; ++s) {
    const auto& q = seqs[s];
    if (q.prompt.empty()) throw input_error(fmt::format("sequence {}: empty prompt", s));
    if (q.generate < 0) throw input_error(fmt::format("sequence {}: negative generation length", s));
    for (std::size_t i = 0; i < q.prompt.size(); ++i)
      if (q.prompt[i] < 0 || q.prompt[i] >= c.vocab_size)
        throw input_error(fmt::format("sequence {}: token id {} at prompt position {} is out of range (vocab size {})",
                                      s, q.prompt[i], i, c.vocab_size));
    const std::int64_t total = static_cast<std::int64_t>(q.prompt.size()) + q.generate;
    if (total > o.max_context)
      throw input_error(fmt::format("sequence {}: prompt ({}) + generation ({}) = {} tokens exceeds the context limit {}",
                                    s, q.prompt.size(), q.generate, total, o.max_context));
    blocks += (total + o.block_size - 1) / o.block_size;
  }
  const std::int64_t avail = o.kv_blocks(c) - 1;  // block 0 is scratch
  if (blocks > avail)
    throw input_error(fmt::format("the request needs {} KV blocks ({:.1f} MiB) but the KV budget holds {} ({:.1f} MiB); "
                                  "raise --kv-mem-mb or shorten the request",
                                  blocks, blocks * kv_block_bytes(c, o.block_size) / 1048576.0, avail,
                                  avail * kv_block_bytes(c, o.block_size) / 1048576.0));
}

}  // namespace qwen
