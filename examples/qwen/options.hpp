// examples/qwen/options.hpp: run-time sizes of the engine and the checks of a generation request.
//
// Host-only (no CUDA): everything a user can get wrong is checked here before any GPU work.
#pragma once

#include "config.hpp"
#include "paged_kv.hpp"


#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace qwen {

/// Comma-separated non-negative integers; `flag` names the option in errors.
inline std::vector<int> parse_ids(const std::string& s, const char* flag) {
  if (s.empty()) throw input_error(fmt::format("{}: empty list", flag));
  std::vector<int> out;
  std::size_t begin = 0;
  for (;;) {
    const std::size_t end = s.find(',', begin);
    const std::string item = s.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    const std::size_t index = out.size();
    if (item.empty()) throw input_error(fmt::format("{}: empty entry at position {}", flag, index));
    if (item.find_first_not_of("0123456789") != std::string::npos)
      throw input_error(fmt::format("{}: '{}' at position {} is not a non-negative integer", flag, item, index));
    if (item.size() > 10 || std::stoll(item) > (1ll << 31) - 1)
      throw input_error(fmt::format("{}: {} at position {} is out of range", flag, item, index));
    out.push_back(static_cast<int>(std::stoll(item)));
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  return out;
}

/// Throws input_error unless `c` splits over `tp` tensor-parallel ranks: every rank takes the same
/// number of kv heads (and so of query heads), of intermediate rows (a multiple of 8: 16-byte loads)
/// and of vocabulary rows.
inline void check_tp_split(const Config& c, int tp) {
  if (tp < 1) throw input_error(fmt::format("--tp {} must be at least 1", tp));
  auto divides = [&](const char* field, int v) {
    if (v % tp != 0)
      throw input_error(fmt::format("--tp {}: {} {} of config {} is not divisible by {}", tp, field, v, c.name, tp));
  };
  divides("num_key_value_heads", c.num_key_value_heads);
  divides("num_attention_heads", c.num_attention_heads);
  divides("intermediate_size", c.intermediate_size);
  divides("vocab_size", c.vocab_size);
  if ((c.intermediate_size / tp) % 8 != 0)
    throw input_error(fmt::format("--tp {}: intermediate_size / {} = {} must be a multiple of 8", tp, tp,
                                  c.intermediate_size / tp));
}

/// The --tp checks of the CLI, on the host before any GPU work: the split (check_tp_split), NCCL
/// built in (`nccl_built`) when tp > 1, and at most one rank per GPU present (`devices`).
inline void check_tp_request(const Config& c, int tp, int devices, bool nccl_built) {
  check_tp_split(c, tp);
  if (tp == 1) return;
  if (!nccl_built)
    throw input_error(fmt::format("--tp {}: tensor parallel needs NCCL, and this build has none (configure with "
                                  "NCCL installed and REPLAY_WITH_NCCL=ON)", tp));
  if (tp > devices)
    throw input_error(fmt::format("--tp {} needs {} GPUs (one rank per GPU); {} present", tp, tp, devices));
}

/// Tensor parallel: how a step sums the ranks' O and down products into the residual.
enum class TpSum {
  nccl,      ///< ncclAllReduce of the fp32 residual, in place (rank 0 adds its product first)
  one_shot,  ///< one kernel reads every rank's product over peer memory and adds the sum (allreduce.cu)
};

/// Run-time sizes of the engine (everything is allocated once from these).
struct EngineOptions {
  int max_batch = 64;                        ///< rows the activation buffers hold (largest batch)
  int max_bucket = 64;                       ///< largest graph bucket (buckets: powers of two up to it)
  bool eager_fallback = true;                ///< batches above max_bucket run eagerly instead of failing
  int block_size = 16;                       ///< tokens per KV block
  std::size_t kv_budget_bytes = 1ull << 30;  ///< device memory for the KV pool
  int max_context = 4096;                    ///< tokens per sequence (prompt + generation) at most
  int prefill_chunk = 2048;                  ///< prompt tokens per prefill pass (activation buffers hold this many rows)
  std::uint64_t seed = 1234;                 ///< random initialisation seed (no weights path)
  float init_std = 0.02f;                    ///< std of random weights (uniform with this std)
  int gemv_max_rows = 16;                    ///< largest bucket on the fused GEMV (0, 1, 2, 4, 8, 16); larger: cuBLAS
  int attn_min_chunk = 128;                  ///< split-KV attention: positions per block at least (multiple of 64)
  bool sampling = false;                     ///< the lm_head writes logits and a sampler picks the token; off: argmax
  int tp_size = 1;                           ///< tensor-parallel ranks (one engine per rank; tp.hpp)
  int tp_rank = 0;                           ///< this engine's rank in 0..tp_size-1
  TpSum tp_sum = TpSum::one_shot;            ///< tensor parallel: the sums' kernel (one_shot needs peer access)

  /// Device bytes of one KV block on one rank (a rank holds kv_heads / tp_size heads).
  [[nodiscard]] std::int64_t block_bytes(const Config& c) const { return kv_block_bytes(c, block_size) / tp_size; }
  /// KV blocks the budget (per rank) buys for this config.
  [[nodiscard]] std::int64_t kv_blocks(const Config& c) const {
    return static_cast<std::int64_t>(kv_budget_bytes) / block_bytes(c);
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
    if (gemv_max_rows < 0 || gemv_max_rows > 16 || (gemv_max_rows & (gemv_max_rows - 1)) != 0)
      throw input_error("largest fused-GEMV bucket must be 0, 1, 2, 4, 8 or 16");
    if (attn_min_chunk < 64 || attn_min_chunk % 64 != 0)
      throw input_error("attention's minimum chunk must be a positive multiple of 64");
    check_tp_split(c, tp_size);
    if (tp_rank < 0 || tp_rank >= tp_size)
      throw input_error(fmt::format("tensor-parallel rank {} is outside 0..{}", tp_rank, tp_size - 1));
    const std::int64_t nb = kv_blocks(c);
    if (nb < 2)
      throw input_error(fmt::format("KV memory budget of {} bytes holds {} blocks of {} bytes; at least 2 are needed",
                                    kv_budget_bytes, nb, block_bytes(c)));
    if (nb > (1ll << 30))
      throw input_error(fmt::format("KV memory budget of {:.0f} MiB buys {} blocks; at most 2^30 are supported",
                                    kv_budget_bytes / 1048576.0, nb));
  }
};

/// How the sampler picks each token (EngineOptions::sampling): from softmax(logits / temperature)
/// restricted to the top_k largest logits, then to the smallest set of those whose probability mass
/// is at least top_p; the draw is a pure function of (seed, position generated, token id).
struct SampleParams {
  float temperature = 0.f;  ///< 0: greedy (the largest logit, ties to the lowest token id)
  float top_p = 1.f;        ///< nucleus mass in (0, 1]; 1: no nucleus cut
  int top_k = 0;            ///< largest logits kept; 0: all
  std::uint32_t seed = 0;   ///< random stream of the draws

  bool operator==(const SampleParams&) const = default;

  /// Throws input_error unless the values are usable.
  void validate() const {
    if (!std::isfinite(temperature) || temperature < 0.f)
      throw input_error(fmt::format("sampling temperature must be finite and >= 0 (0: greedy), got {}", temperature));
    if (!(top_p > 0.f && top_p <= 1.f))
      throw input_error(fmt::format("sampling top_p must be in (0, 1], got {}", top_p));
    if (top_k < 0) throw input_error(fmt::format("sampling top_k must be >= 0 (0: no limit), got {}", top_k));
  }
};

/// One sequence of a generation request.
struct SequenceRequest {
  std::vector<int> prompt;  ///< prompt token ids
  int generate = 0;         ///< tokens to generate after the prompt (at most)
  std::vector<int> stop{};  ///< ids that end the sequence once generated (end of sequence); empty: none

  /// Whether generating `token` ends the sequence.
  [[nodiscard]] bool stops_at(int token) const { return std::find(stop.begin(), stop.end(), token) != stop.end(); }
  /// How many of `generated` the sequence keeps: up to and including the first stop id, else all.
  [[nodiscard]] std::size_t kept(std::span<const int> generated) const {
    for (std::size_t i = 0; i < generated.size(); ++i)
      if (stops_at(generated[i])) return i + 1;
    return generated.size();
  }
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
                                  blocks, blocks * o.block_bytes(c) / 1048576.0, avail,
                                  avail * o.block_bytes(c) / 1048576.0));
}

}  // namespace qwen
