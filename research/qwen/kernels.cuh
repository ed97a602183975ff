// research/qwen/kernels.cuh: the decode/prefill kernels' launchers.
//
// Every per-step value (token ids, positions, block-table slot of each row) is read by the kernels
// through the fixed device pointers in RowMeta, never passed by value, so a captured graph replays
// correctly with new metadata. Each launcher takes a stream, checks its preconditions and its launch.
#pragma once

#include <replay/stream.hpp>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace qwen {

using bf16 = __nv_bfloat16;

/// Device pointers (fixed for the engine's lifetime) to the per-row step metadata.
struct RowMeta {
  const std::int32_t* token = nullptr;        ///< [rows] input token id of each row
  const std::int32_t* pos = nullptr;          ///< [rows] position of that token (attends to 0..pos)
  const std::int32_t* slot = nullptr;         ///< [rows] block-table row of the row's sequence
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
  [[nodiscard]] __host__ __device__ std::size_t layer_stride() const {
    return 2ull * num_blocks * kv_heads * block_size * head_dim;
  }
  [[nodiscard]] __host__ __device__ std::size_t kv_stride() const { return std::size_t(num_blocks) * kv_heads * block_size * head_dim; }
};

/// Split-KV (flash-decoding) for decode attention. A row's context is cut into chunks of at least
/// `min_chunk` positions (a multiple of 64), one block per chunk, up to `splits` per (row, kv head):
/// each block keeps its chunk's softmax state (max, sum, unnormalised output) in `partial`, and the
/// last block to finish (counted in `arrived`) combines them. The grid (`splits`) is fixed at launch,
/// so a captured graph serves every length; a context of at most `min_chunk` positions runs in one
/// block, as without splits. `splits` = 1 needs no scratch.
struct AttnSplit {
  int splits = 1;                 ///< blocks per (row, kv head): grid z
  int min_chunk = 128;            ///< fewest positions per block
  float* partial = nullptr;       ///< [rows][kv_heads][splits][G * (head_dim + 2)] fp32
  unsigned* arrived = nullptr;    ///< [rows][kv_heads], zero before the first launch (kept zero after each)
};
/// Most blocks per (row, kv head); default min_chunk.
inline constexpr int kMaxAttnSplits = 32;
inline constexpr int kAttnMinChunk = 128;

/// What the fused GEMV does with y = W·x (per batch row b, output row n).
enum class gemv_out {
  store_f32,  ///< y_f32[b][n] = acc
  add_f32,    ///< y_f32[b][n] += acc (residual add)
  silu_mul,   ///< W holds [gate; up] (2N rows): y_bf16[b][n] = silu(gate_n) * up_n
  argmax,     ///< y_f32[b][n] = acc (logits) and keys[b] = max over n of (value, lowest index)
};

/// Input of the fused GEMV: x (bf16, [rows][K]) copied as is, or the fp32 residual RMS-normalised
/// with `norm_w` on the fly (fusing the layer's RMSNorm into the projection).
struct GemvIn {
  const bf16* x_bf16 = nullptr;   ///< used when norm_w == nullptr
  const float* x_f32 = nullptr;   ///< residual, used with norm_w
  const bf16* norm_w = nullptr;   ///< RMSNorm weight [K]
  float eps = 1e-6f;
};

/// Largest batch the fused GEMV handles (larger buckets use cuBLAS GEMM).
inline constexpr int kGemvMaxRows = 4;

void init_kernel_attributes();

/// Programmatic dependent launch for every kernel of the decode/prefill path (default on): a kernel
/// may launch while its predecessor finishes and prefetch its weights; data dependencies are kept
/// by griddepcontrol.wait in every kernel. Process-wide; set before capturing graphs.
void set_pdl(bool on);
bool pdl_enabled();
/// 16-byte weight loads in flight per row and lane in the per-matrix GEMV kernels (4, the default,
/// or 8). Process-wide; set before capturing graphs.
void set_gemv_loads(int u);
int gemv_loads();
/// Software-pipelined per-row GEMV (default on): each warp loads its next chunk of weights before it
/// computes the current one, so its loads are always in flight; the first chunk is loaded before
/// waiting for the previous kernel. Off: the plain per-row GEMV. Both: one warp per output row,
/// set_gemv_loads 16-byte loads per lane and chunk. Process-wide; set before capturing graphs.
void set_gemv_rowpipe(bool on);
bool gemv_rowpipe();
/// Per-warp shared-memory ring GEMV (default off): one block per SM owning a contiguous share of the
/// rows, each warp streaming its rows through its own ring of bulk-copied slots, the ring filled
/// before waiting for the previous kernel; a block takes under half an SM's shared memory, so the
/// next kernel's block fits beside it and loads while this one runs. Shapes it does not fit (x too
/// large for 2 slots per warp) use the kernels chosen above. Process-wide; set before capturing.
void set_gemv_ring(bool on);
/// Diagnostics (QWEN_RING_TRACE=1): the ring GEMV records global-timer stamps per block; a decode
/// step starts numbering its launches afresh (call before its first launch), and the summary gives,
/// per matrix shape, the mean handoff, x staging and compute times of the last step run.
void ring_trace_begin_step();
std::string ring_trace_summary(replay::stream_ref s);

/// Deterministic uniform(-scale, scale) fill from (seed, index): the random initialisation.
void launch_fill_random(bf16* p, std::size_t n, std::uint64_t seed, float scale, replay::stream_ref s);
void launch_fill_const(bf16* p, std::size_t n, float value, replay::stream_ref s);
/// RoPE table: rope[pos][i] = (cos, sin)(pos * theta^(-2i/head_dim)), i < head_dim/2, fp32 as HF computes it.
void launch_rope_table(float2* rope, int max_pos, int head_dim, double theta, replay::stream_ref s);

/// residual[r][:] = embed[token[r]][:] (fp32); also resets keys[0..rows) for the argmax of this step.
void launch_embed(const bf16* embed, int vocab, int hidden, RowMeta meta, int rows, float* residual,
                  unsigned long long* keys, replay::stream_ref s);

/// y = W x for `rows` (1..kGemvMaxRows) batch rows; W is [N][K] row-major (2N rows for silu_mul).
void launch_gemv(const bf16* W, int N, int K, int rows, GemvIn in, gemv_out mode, float* y_f32, bf16* y_bf16,
                 int ldy, unsigned long long* keys, int num_sms, replay::stream_ref s);

/// out[r][:] = bf16(rmsnorm(residual[r][:]) * w)  (HF order: normalise in fp32, then weight).
void launch_rmsnorm(const float* residual, const bf16* w, int hidden, float eps, int rows, bf16* out,
                    replay::stream_ref s);
/// act[r][n] = bf16(silu(gu[r][n]) * gu[r][N + n]).
void launch_silu_mul(const float* gu, int N, int rows, bf16* act, replay::stream_ref s);
/// keys[r] = argmax of logits[r][0..V) packed as (orderable value << 32 | ~index).
void launch_argmax(const float* logits, int V, int rows, unsigned long long* keys, replay::stream_ref s);

/// Per-head RMSNorm + RoPE of K and copy of V for every row, written into the paged pool (prefill).
void launch_kv_write(const float* qkv, int q_heads, const bf16* k_norm, float eps, const float2* rope, RowMeta meta,
                     int rows, KvPool kv, int layer, replay::stream_ref s);

/// Attention for `rows` rows: per-head RMSNorm + RoPE of Q, and (write_kv) of the row's new K/V
/// written to the pool first; then softmax(q·K^T / sqrt(d)) V over positions 0..pos[r] of the row's
/// sequence through its block table, split over sp.splits blocks per (row, kv head) when the context
/// is long (AttnSplit). out is [rows][q_heads * head_dim] bf16.
void launch_attention(const float* qkv, int q_heads, const bf16* q_norm, const bf16* k_norm, float eps,
                      const float2* rope, RowMeta meta, int rows, KvPool kv, int layer, bool write_kv, AttnSplit sp,
                      bf16* out, replay::stream_ref s);
/// The split count for a bucket of `rows` rows: 1 when rows × kv_heads blocks already cover the
/// SMs; otherwise as many blocks as fit on the GPU at once (one wave) when every context is long,
/// at most kMaxAttnSplits (QWEN_ATTN_SPLITS lowers the cap; 1 turns split-KV off).
int attention_splits(int rows, int q_heads, int kv_heads, int head_dim, int num_sms);
/// kAttnMinChunk, or QWEN_ATTN_MIN_CHUNK rounded up to a multiple of 64 (diagnostics).
int attention_min_chunk();

/// Read-bandwidth probe (the floor of a kernel that only streams `bytes` from p): 16-byte loads,
/// 8 blocks of 256 threads per SM, 4 loads in flight per thread.
void launch_read_probe(const void* p, std::size_t bytes, unsigned* sink, int num_sms, replay::stream_ref s);

/// One link of the kernel-per-matrix floor: a streaming read of `bytes` from p (like the read probe)
/// that issues its first loads, then waits for the previous kernel (griddepcontrol.wait, launched
/// with PDL when enabled) as the decode GEMVs do. A chain of links with a decode step's matrix sizes,
/// captured as a graph, times what one kernel per matrix costs with no arithmetic at all; bytes = 0
/// launches one block that only waits (the stand-in for a kernel that reads no weights).
void launch_read_link(const void* p, std::size_t bytes, unsigned* sink, int num_sms, replay::stream_ref s);

/// Decodes a packed argmax key into the token id.
inline int key_to_token(unsigned long long key) { return static_cast<int>(0xFFFFFFFFu - (key & 0xFFFFFFFFu)); }

}  // namespace qwen
