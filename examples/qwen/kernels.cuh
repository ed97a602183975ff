// examples/qwen/kernels.cuh: the decoder's kernels, as launchers (gemv.cu, attention.cu,
// prefill_attention.cu, allreduce.cu, ops.cu).
//
// Every per-step value (each row's token id, position and block-table slot) is read by the kernels
// through the fixed device pointers of RowMeta, never passed by value, so a captured graph replays
// correctly with new metadata. Every launcher goes through replay::launch with PDL on: each kernel
// does what does not depend on its predecessor (load weights, read step metadata), then calls
// replay::pdl::wait(). Launchers check their arguments and throw replay::usage_error on misuse;
// launch failures throw replay::cuda_error naming the kernel.
#pragma once

#include <replay/device_loop.hpp>
#include <replay/stream.hpp>

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace qwen {

using bf16 = __nv_bfloat16;

/// Device pointers (fixed for the engine's lifetime) to the per-row step metadata.
/// One row of a step: the token it feeds, its position and its sequence's block-table row.
struct RowStep {
  std::int32_t token = 0;  ///< input token id
  std::int32_t pos = 0;    ///< position of that token (attends to 0..pos)
  std::int32_t slot = 0;   ///< block-table row of the row's sequence
};

struct RowMeta {
  const RowStep* rows = nullptr;              ///< [rows] the step's rows
  const std::int32_t* block_table = nullptr;  ///< [(max_seqs+1) * table_width] physical block ids
  int table_width = 0;                        ///< blocks per block-table row
};

/// The paged KV pool: layout [layer][K|V][block][kv_head][block_size][head_dim], bf16.
struct KvPool {
  bf16* base = nullptr;
  int num_blocks = 0;
  int block_size = 16;
  int kv_heads = 0;
  int head_dim = 0;
  [[nodiscard]] __host__ __device__ std::size_t kv_stride() const {
    return std::size_t(num_blocks) * kv_heads * block_size * head_dim;
  }
  [[nodiscard]] __host__ __device__ std::size_t layer_stride() const { return 2 * kv_stride(); }
};

// ---- GEMV (gemv.cu) --------------------------------------------------------------------------------

/// Rows (batch rows of one step) of the CUDA-core GEMV: batch 1. From 2 rows its per-row arithmetic
/// (unpacking x for every weight chunk) costs more than the tensor-core GEMV (the batch as the M
/// side of mma.sync), which serves buckets of 2 to kMmaMaxRows rows where x leaves room for its
/// ring; other matrices and larger buckets use cuBLAS (model.cu).
inline constexpr int kGemvMaxRows = 1;
inline constexpr int kMmaMaxRows = 16;

/// What the fused GEMV does with y = W·x (per batch row b, output row n). Every output element
/// has one writer (a warp's lane 0, or one thread of the tensor-core epilogue).
enum class gemv_out {
  store_f32,  ///< y_f32[b][n] = acc (x: the normalised residual, or a bf16 activation)
  add_f32,    ///< y_f32[b][n] += acc (residual add)
  silu_mul,   ///< W holds [gate; up] (2N rows): y_bf16[b][n] = silu(gate_n) * up_n
  argmax,     ///< y_f32[b][n] = acc (logits) and keys[b] = max over n of (value, lowest index + index0)
};

/// Input of the fused GEMV: x (bf16, [rows][K]) as is, or the fp32 residual RMS-normalised with
/// norm_w on the fly (the layer's RMSNorm folded into the projection).
struct GemvIn {
  const bf16* x_bf16 = nullptr;  ///< used when norm_w == nullptr
  const float* x_f32 = nullptr;  ///< residual, used with norm_w
  const bf16* norm_w = nullptr;  ///< RMSNorm weight [K]
  float eps = 1e-6f;
};

/// One projection y = W·x: the matrix, its input and its epilogue. Every pointer is static.
struct Linear {
  const bf16* W = nullptr;  ///< [N][K] row-major ([2N][K] for silu_mul: gate rows, then up rows)
  int N = 0, K = 0;
  GemvIn in;
  gemv_out mode = gemv_out::store_f32;
  float* y_f32 = nullptr;              ///< store_f32, add_f32, argmax (logits)
  bf16* y_bf16 = nullptr;              ///< silu_mul
  int ldy = 0;                         ///< elements between batch rows of y
  unsigned long long* keys = nullptr;  ///< argmax: one packed key per batch row
  int index0 = 0;                      ///< argmax: the index of W's row 0 in the keys (a vocabulary shard's start)
  /// W's tensor maps for the tensor-core GEMV (make_weight_maps): boxes of 8 rows by 1024, 512 and
  /// 256 weights (at most K). Host copies of 128-byte descriptors, passed to the kernel by value.
  CUtensorMap wmap[3] = {};
};

/// How the fused GEMV runs one (Linear, rows): chosen once per shape when the engine is built.
struct GemvPlan {
  enum class kernel { ring, pipelined, pipelined_deep, mma } kind = kernel::pipelined;
  int grid = 0;                   ///< blocks
  std::size_t shared_bytes = 0;   ///< dynamic shared memory per block
  int slots = 0;                  ///< ring: slots per warp
  int piece = 0;                  ///< mma: weights per row per slot
  int wmap = 0;                   ///< mma: which of Linear::wmap (the one whose box is `piece` wide)
};

/// Whether the fused GEMV serves `op` at `rows` rows: rows a power of two up to kMmaMaxRows and x
/// ([rows][K] bf16) within its shared-memory stage (from 2 rows: K a multiple of 64 and x leaving
/// room for the tensor-core GEMV's ring).
bool gemv_fits(const Linear& op, int rows);
/// Picks the kernel and grid for `op` at `rows` batch rows on a GPU of `num_sms` SMs (queries the
/// kernels' occupancy; host only, call at setup).
GemvPlan plan_gemv(const Linear& op, int rows, int num_sms);
/// y = W·x for `rows` (a power of two up to kMmaMaxRows) batch rows with the epilogue of op.mode.
void launch_gemv(const Linear& op, int rows, const GemvPlan& plan, replay::stream_ref s);
/// Encodes op.wmap from op.W, op.N, op.K and op.mode (host, once W is final; none where K is not a
/// multiple of 64, which the tensor-core GEMV does not serve).
void make_weight_maps(Linear& op);
/// Sets the GEMV kernels' shared-memory attributes (once per process, before the first launch).
void init_gemv_attributes();

// ---- attention (attention.cu) ---------------------------------------------------------------------

/// How decode attention runs a bucket: block size and split-KV (flash-decoding), chosen once per
/// bucket when the engine is built (plan_attention). A row's context is cut into chunks of at least
/// `min_chunk` positions (a multiple of 64), one block per chunk, up to `splits` per (row, kv head):
/// each block keeps its chunk's softmax state (max, sum, unnormalised output) in `partial`, and the
/// last block to finish (counted in `arrived`) combines them. The grid (`splits`) is fixed at launch,
/// so a captured graph serves every length; a context of at most `min_chunk` positions runs in one
/// block. `splits` = 1 needs no scratch.
struct AttnPlan {
  int splits = 1;               ///< blocks per (row, kv head): grid z
  int warps = 8;                ///< warps per block: 8, or 4 where 8-warp blocks would need a second wave
  int min_chunk = 128;          ///< fewest positions per block
  float* partial = nullptr;     ///< [rows][kv_heads][splits][attn_partial_floats(G, head_dim)] fp32
  unsigned* arrived = nullptr;  ///< [rows][kv_heads], zero before the first launch (kept zero after each)
};
inline constexpr int kMaxAttnSplits = 32;
/// Floats of one chunk's split-KV state: the unnormalised outputs acc[G][head_dim], then the maxima
/// m[G] and sums l[G], padded to whole 16-byte pieces (the merge copies them by cp.async).
constexpr int attn_partial_floats(int G, int head_dim) { return G * head_dim + (2 * G + 3) / 4 * 4; }
/// Query heads per kv head the attention kernel is compiled for: 1..kMaxGroup.
inline constexpr int kMaxGroup = 8;

/// Attention for `rows` rows: per-head RMSNorm + RoPE of Q and (write_kv, decode) of the row's new
/// K, with V, written to the pool first; then softmax(q·K^T / sqrt(d)) V over positions 0..pos[r]
/// of the row's sequence through its block table. out is [rows][q_heads * head_dim] bf16.
void launch_attention(const float* qkv, int q_heads, const bf16* q_norm, const bf16* k_norm, float eps,
                      const float2* rope, RowMeta meta, int rows, KvPool kv, int layer, bool write_kv, AttnPlan sp,
                      bf16* out, replay::stream_ref s);
/// Splits and warps per block for a bucket of `rows` rows (the scratch pointers and min_chunk are
/// left to the caller): a grid of rows × kv_heads blocks that leaves SMs idle is split into as many
/// blocks as fit on the GPU at once, at most kMaxAttnSplits per (row, kv head); one that needs more
/// than one wave of 8-warp blocks gets blocks of 4 warps (twice as many resident). Host, at setup.
AttnPlan plan_attention(int rows, int q_heads, int kv_heads, int head_dim, int num_sms);
/// Prefill: per-head RMSNorm + RoPE of K and a copy of V for every row, into the paged pool.
void launch_kv_write(const float* qkv, int q_heads, const bf16* k_norm, float eps, const float2* rope, RowMeta meta,
                     int rows, KvPool kv, int layer, replay::stream_ref s);
/// Sets the attention kernels' shared-memory carveout (once per process).
void init_attention_attributes();

// ---- prefill attention (prefill_attention.cu) -------------------------------------------------------

/// Causal attention of a prefill chunk on the tensor cores: `rows` rows of one sequence (block-table
/// row meta.rows[0].slot) at increasing positions meta.rows[r].pos, each attending to positions
/// 0..pos of the pool, which must hold them all (earlier chunks' and, through launch_kv_write, this
/// chunk's). Q is normalised (q_norm) and rotated as in launch_attention, then rounded to bf16; out is
/// [rows][q_heads * head_dim] bf16.
void launch_prefill_attention(const float* qkv, int q_heads, const bf16* q_norm, float eps, const float2* rope,
                              RowMeta meta, int rows, KvPool kv, int layer, bf16* out, replay::stream_ref s);
/// Sets the prefill attention kernels' dynamic shared-memory limit (once per process, before launching).
void init_prefill_attention_attributes();

// ---- the tensor-parallel sum over peer memory (allreduce.cu) ---------------------------------------

inline constexpr int kMaxPeers = 8;          ///< ranks a PeerSum can join
inline constexpr int kPeerSumBlocks = 128;   ///< blocks of every launch_peer_sum (each has its own flags)

/// One rank's view of a tensor-parallel group's exchange buffers (EngineOptions::tp_sum one_shot):
/// every pointer is valid on this rank's device (peer access on between all pairs) and fixed for
/// the group's lifetime, so a captured step keeps them. size 0: none (the sums go through NCCL).
struct PeerSum {
  float* in[kMaxPeers][2] = {};        ///< rank r's two exchange buffers (0: after O, 1: after down), [rows][H] fp32
  unsigned* flags[kMaxPeers] = {};     ///< rank r's arrival flags, [kMaxPeers][kPeerSumBlocks], written by the others
  unsigned* calls = nullptr;           ///< this rank's launches so far, per block [kPeerSumBlocks] (its own memory)
  int rank = 0;                        ///< this rank
  int size = 0;                        ///< ranks (0: no PeerSum)
  unsigned long long timeout_ns = 60'000'000'000ull;  ///< a peer that does not arrive in this long traps the kernel
};

/// residual[0..n) += the sum over ranks 0..size-1, in rank order, of rank r's exchange buffer `slot`
/// (every rank computes the same values), one launch on every rank per sum and in the same order:
/// each block announces its arrival to the other ranks, waits for theirs (so every rank's product is
/// complete), then reads its share of every rank's buffer over NVLink. The two slots alternate (O,
/// down), so a rank cannot overwrite a buffer a peer still reads: before its next write there, it
/// has passed the other slot's sum, which the peer only enters after finishing this one. A peer
/// that never arrives (a rank that failed) makes the kernel trap after p.timeout_ns, which ends the
/// context with an error instead of a hang. n: a multiple of 4, at most an exchange buffer's size.
void launch_peer_sum(const PeerSum& p, int slot, std::size_t n, float* residual, replay::stream_ref s);

// ---- small ops (ops.cu) ----------------------------------------------------------------------------

/// Deterministic uniform(-scale, scale) fill from (seed, index): the random initialisation.
void launch_fill_random(bf16* p, std::size_t n, std::uint64_t seed, float scale, replay::stream_ref s);
/// The [rows][cols] block at (row0, col0) of the [.][ld] tensor that launch_fill_random(seed, scale)
/// fills, written densely to p: the same values, so a tensor-parallel shard is a slice of the tensor
/// one GPU would hold.
void launch_fill_random_slice(bf16* p, std::size_t rows, std::size_t cols, std::size_t ld, std::size_t row0,
                              std::size_t col0, std::uint64_t seed, float scale, replay::stream_ref s);
void launch_fill_const(bf16* p, std::size_t n, float value, replay::stream_ref s);
/// RoPE table: rope[pos][i] = (cos, sin)(pos * theta^(-2i/head_dim)), i < head_dim/2, fp32 as HF computes it.
void launch_rope_table(float2* rope, int max_pos, int head_dim, double theta, replay::stream_ref s);
/// residual[r][:] = embed[token[r]][:] (fp32); also resets keys[0..rows) for this step's argmax.
void launch_embed(const bf16* embed, int vocab, int hidden, RowMeta meta, int rows, float* residual,
                  unsigned long long* keys, replay::stream_ref s);
/// out[r][:] = bf16(rmsnorm(residual[r][:]) * w)  (HF order: normalise in fp32, then weight).
void launch_rmsnorm(const float* residual, const bf16* w, int hidden, float eps, int rows, bf16* out,
                    replay::stream_ref s);
/// act[r][n] = bf16(silu(gu[r][n]) * gu[r][N + n]).
void launch_silu_mul(const float* gu, int N, int rows, bf16* act, replay::stream_ref s);
/// keys[r] = argmax of logits[r][0..V) packed as (orderable value << 32 | ~(index + index0)).
void launch_argmax(const float* logits, int V, int rows, unsigned long long* keys, replay::stream_ref s,
                   int index0 = 0);
/// Tensor parallel, sampling: logits[r][k * shard + j] = gathered[k][r][j] for k < tp, r < rows,
/// j < shard (the all-gathered vocabulary shards of `tp` ranks, each [rows][shard], into rows of
/// tp * shard logits).
void launch_unshard_logits(const float* gathered, int tp, int rows, int shard, float* logits, replay::stream_ref s);

/// Decodes a packed argmax key into the token id (host and device).
__host__ __device__ inline int key_to_token(unsigned long long key) {
  return static_cast<int>(0xFFFFFFFFu - (key & 0xFFFFFFFFu));
}

// ---- the device loop (ops.cu) ------------------------------------------------------------------------

/// The end of a step in the device loop (Engine::decode_loop): appends row 0's token (from its
/// argmax key) to `loop`, which stops after its step limit, on its stop token, or once the token
/// fills the context (`max_context` tokens); and writes the next step's row 0 metadata: that token,
/// at position pos[0] + 1. One thread; launched with PDL after the lm_head GEMV.
void launch_loop_advance(const unsigned long long* keys, std::int32_t* token, std::int32_t* pos, int max_context,
                         replay::token_loop_ref loop, replay::stream_ref s);

}  // namespace qwen
