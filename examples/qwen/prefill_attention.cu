// examples/qwen/prefill_attention.cu: causal attention over a prefill chunk, on the tensor cores.
//
// Flash-attention style (FlashAttention-2's forward pass with mma.sync): one block of 4 warps per
// (tile of 64 query rows, kv head). The G query heads that share the kv head are packed into the
// tile's rows (packed row p = chunk row p / G, query head p % G), so every K/V tile a block loads
// serves the whole group. The block walks the key positions 0..(its last row's position) in tiles
// of 64 through the sequence's block table, double-buffered in shared memory by cp.async (positions
// past the last row are zero-filled, never read); per tile each warp computes S = Q K^T for its 16
// rows (m16n8k16, bf16 in, fp32 accumulate), masks the keys after each row's position, updates its
// online softmax in fp32 (registers; the four lanes of a row reduce by shuffles) and adds P V, P
// rounded to bf16 from the score registers. Q is normalised (q_norm) and rotated (RoPE) in the
// prologue exactly as decode attention does it, then rounded to bf16 for the tensor cores.
// Shared-memory rows are padded by 16 bytes, so the 8 rows an ldmatrix reads fall in distinct banks.
#include "kernels.cuh"
#include "device.cuh"

#include <replay/error.hpp>
#include <replay/launch.hpp>

#include <fmt/format.h>

#include <cstdint>

namespace qwen {
namespace {

using namespace dev;

constexpr int kTileQ = 64;          // packed query rows per block (16 per warp)
constexpr int kTileK = 64;          // key positions per K/V tile
constexpr int kWarps = kTileQ / 16;  // 4

/// Shared memory of the kernel for head_dim D: Q [64][D + 8], then K and V, two stages each.
template <int D>
struct PrefillSmem {
  static constexpr int stride = D + 8;  // bf16 per row (16 bytes of padding)
  static constexpr int tile = kTileK * stride;
  static constexpr std::size_t bytes = 5 * std::size_t(tile) * sizeof(bf16);
};

/// Four 8x8 bf16 matrices from shared memory (lane l gives the address of row l % 8 of matrix l / 8).
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}
/// The same, each matrix transposed.
__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}

/// c += a b for one m16n8k16 tile: a 16x16 bf16 (row), b 16x8 bf16 (col), c 16x8 fp32.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// One block per (query tile, kv head); see the file comment. Fragment layouts (PTX ISA, mma.m16n8k16):
/// lane = 4 g + t holds rows g and g + 8 of a 16-row tile, columns 2t, 2t + 1 (+ 8) of each 8-column
/// piece.
template <int D>
__global__ void __launch_bounds__(kWarps * 32, 2)
    prefill_attention_kernel(const float* qkv, int q_dim, int kv_dim, int G, const bf16* q_norm, float eps,
                             const float2* rope, RowMeta meta, int rows, KvPool kv, int layer, bf16* out) {
  using Smem = PrefillSmem<D>;
  constexpr int S = Smem::stride;
  constexpr int E = D / 64;  // dims per lane in each half of a head (norm_rope_head)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* q_s = reinterpret_cast<bf16*>(smem_raw);  // [kTileQ][S]
  bf16* k_s = q_s + Smem::tile;                   // [2][kTileK][S]
  bf16* v_s = k_s + 2 * Smem::tile;               // [2][kTileK][S]

  replay::pdl::launch_dependents();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int kvh = blockIdx.y;
  const int packed = rows * G;
  const int p0 = (gridDim.x - 1 - blockIdx.x) * kTileQ;  // the last tiles (most keys) start first
  const int p_end = min(p0 + kTileQ, packed);
  // Everything below is written by earlier kernels or copies (this chunk's K/V by launch_kv_write).
  replay::pdl::wait();
  const int pos_first = meta.rows[p0 / G].pos;         // the tile's first and last row positions
  const int pos_last = meta.rows[(p_end - 1) / G].pos;  // (a chunk's positions increase with the row)
  const std::int32_t* table = meta.block_table + std::size_t(meta.rows[0].slot) * meta.table_width;
  const bf16* kbase = kv.base + std::size_t(layer) * kv.layer_stride();
  const bf16* vbase = kbase + kv.kv_stride();
  const int ntiles = pos_last / kTileK + 1;  // key tiles covering positions 0..pos_last

  // Issues the copies of key tile j (positions j*64 ..) into stage `buf`, as one commit group.
  auto load_kv = [&](int j, int buf) {
    constexpr int kPieces = D / 8;  // 16-byte pieces per row
    constexpr int kRowsPerPass = kWarps * 32 / kPieces;
#pragma unroll
    for (int it = 0; it < kTileK / kRowsPerPass; ++it) {
      const int r = it * kRowsPerPass + tid / kPieces, c = tid % kPieces;
      const int t = j * kTileK + r;
      const bool valid = t <= pos_last;
      std::size_t off = 0;
      if (valid)
        off = ((std::size_t(table[t / kv.block_size]) * kv.kv_heads + kvh) * kv.block_size + t % kv.block_size) * D;
      const int at = (buf * kTileK + r) * S + c * 8;
      cp_async16(k_s + at, kbase + off + c * 8, valid);
      cp_async16(v_s + at, vbase + off + c * 8, valid);
    }
    cp_async_commit();
  };
  load_kv(0, 0);  // in flight during the prologue

  // Prologue: Q of packed rows p0 .. p0 + 63, normalised and rotated (norm_rope_head's arithmetic),
  // as bf16. Rows past the chunk repeat its last row (computed, never stored). Each warp takes
  // kBatch rows at a time with their loads in flight together.
  constexpr int kBatch = 4;
  const int qkv_width = q_dim + 2 * kv_dim;
  for (int m0 = warp * kBatch; m0 < kTileQ; m0 += kWarps * kBatch) {
    HeadNormRope<D> nr[kBatch];
    float lo[kBatch][E], hi[kBatch][E];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int p = min(p0 + m0 + u, packed - 1);
      const int r = p / G;
      const float* x = qkv + std::size_t(r) * qkv_width + (kvh * G + p % G) * D;
      nr[u].load(q_norm, rope + std::size_t(meta.rows[r].pos) * (D / 2), lane);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        lo[u][e] = __ldcg(x + lane * E + e);
        hi[u][e] = __ldcg(x + D / 2 + lane * E + e);
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      nr[u].apply(eps, lo[u], hi[u]);
      bf16* q = q_s + (m0 + u) * S;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        q[lane * E + e] = __float2bfloat16(lo[u][e]);
        q[D / 2 + lane * E + e] = __float2bfloat16(hi[u][e]);
      }
    }
  }
  __syncthreads();

  // The warp's 16 rows of Q as A fragments, one per 16 dims.
  unsigned qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) ldsm_x4(qf[kk], q_s + (warp * 16 + (lane & 15)) * S + kk * 16 + (lane >> 4) * 8);
  int qpos[2];  // positions of this lane's rows g and g + 8
#pragma unroll
  for (int i = 0; i < 2; ++i) qpos[i] = meta.rows[min(p0 + warp * 16 + g + 8 * i, packed - 1) / G].pos;

  const float scale_log2 = rsqrtf(static_cast<float>(D)) * 1.4426950408889634f;  // 1/sqrt(D) * log2(e)
  float row_max[2] = {-INFINITY, -INFINITY};  // running max of the scaled scores (log2 units)
  float row_sum[2] = {0.f, 0.f};              // this lane's part of the running sum
  float o[D / 8][4];                          // unnormalised output, 16 rows x D
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;

  for (int j = 0; j < ntiles; ++j) {
    if (j + 1 < ntiles) {
      load_kv(j + 1, (j + 1) & 1);  // its stage was last read in iteration j - 1 (barrier at its end)
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // tile j's copies, from every thread, are visible
    const bf16* kt = k_s + (j & 1) * Smem::tile;
    const bf16* vt = v_s + (j & 1) * Smem::tile;

    // S = Q K^T: 16 rows x 64 keys per warp (8 pieces of 8 keys).
    float s[kTileK / 8][4];
#pragma unroll
    for (int n = 0; n < kTileK / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < kTileK / 16; ++np) {
        unsigned b[4];  // keys np*16 + 0..7 and + 8..15, dims kk*16 + 0..7 and + 8..15
        ldsm_x4(b, kt + (np * 16 + (lane >> 4) * 8 + (lane & 7)) * S + kk * 16 + ((lane >> 3) & 1) * 8);
        mma_bf16(s[2 * np], qf[kk], b[0], b[1]);
        mma_bf16(s[2 * np + 1], qf[kk], b[2], b[3]);
      }
    }
    // Scale; mask the keys after each row's position (only in tiles that reach past the first row).
    const bool masked = (j + 1) * kTileK - 1 > pos_first;
#pragma unroll
    for (int n = 0; n < kTileK / 8; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int key = j * kTileK + n * 8 + 2 * t4 + (c & 1);
        s[n][c] = masked && key > qpos[c >> 1] ? -INFINITY : s[n][c] * scale_log2;
      }
    // Online softmax. Key 0 is in tile 0 and never masked, so every row's max is finite from there on.
    float corr[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float mx = row_max[i];
#pragma unroll
      for (int n = 0; n < kTileK / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * i], s[n][2 * i + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      corr[i] = exp2f(row_max[i] - mx);  // 0 on the first tile (row_max = -inf)
      row_max[i] = mx;
    }
    float part[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < kTileK / 8; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        s[n][c] = exp2f(s[n][c] - row_max[c >> 1]);  // masked: 0
        part[c >> 1] += s[n][c];
      }
#pragma unroll
    for (int i = 0; i < 2; ++i) row_sum[i] = row_sum[i] * corr[i] + part[i];
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      o[dt][0] *= corr[0], o[dt][1] *= corr[0];
      o[dt][2] *= corr[1], o[dt][3] *= corr[1];
    }
    // O += P V: P's accumulators of keys kk*16 .. + 15 are the A fragment of that k step.
#pragma unroll
    for (int kk = 0; kk < kTileK / 16; ++kk) {
      const unsigned a[4] = {pack2(s[2 * kk][0], s[2 * kk][1]), pack2(s[2 * kk][2], s[2 * kk][3]),
                             pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        unsigned b[4];  // keys kk*16 + 0..7 and + 8..15, dims dp*16 + 0..7 and + 8..15 (transposed)
        ldsm_x4_trans(b, vt + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * S + dp * 16 + (lane >> 4) * 8);
        mma_bf16(o[2 * dp], a, b[0], b[1]);
        mma_bf16(o[2 * dp + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with stage j & 1 before it is refilled
  }

  // out[row][(kvh * G + head) * D + d] = O / sum, for the tile's rows inside the chunk.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float l = row_sum[i];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = 1.f / l;
    const int p = p0 + warp * 16 + g + 8 * i;
    if (p >= packed) continue;
    bf16* dst = out + std::size_t(p / G) * q_dim + (kvh * G + p % G) * D + 2 * t4;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<__nv_bfloat162*>(dst + dt * 8) = __floats2bfloat162_rn(o[dt][2 * i] * inv, o[dt][2 * i + 1] * inv);
  }
}

template <class F>
void with_prefill_attention(int head_dim, F&& f) {
  if (head_dim == 128) return f(prefill_attention_kernel<128>, PrefillSmem<128>::bytes);
  if (head_dim == 64) return f(prefill_attention_kernel<64>, PrefillSmem<64>::bytes);
  throw replay::usage_error(fmt::format("qwen prefill attention: head_dim {} (supported: 64, 128)", head_dim));
}

}  // namespace

void init_prefill_attention_attributes() {
  for (int d : {64, 128})
    with_prefill_attention(d, [](auto kernel, std::size_t bytes) {
      REPLAY_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
    });
}

void launch_prefill_attention(const float* qkv, int q_heads, const bf16* q_norm, float eps, const float2* rope,
                              RowMeta meta, int rows, KvPool kv, int layer, bf16* out, replay::stream_ref s) {
  if (rows < 1) throw replay::usage_error("qwen::launch_prefill_attention: at least one row");
  if (kv.kv_heads < 1 || q_heads % kv.kv_heads != 0)
    throw replay::usage_error("qwen::launch_prefill_attention: query heads must be a multiple of kv heads");
  const int G = q_heads / kv.kv_heads, D = kv.head_dim;
  const int tiles = (rows * G + kTileQ - 1) / kTileQ;
  with_prefill_attention(D, [&](auto kernel, std::size_t bytes) {
    replay::launch(kernel,
                   {.grid = dim3(tiles, kv.kv_heads), .block = dim3(kWarps * 32), .shared_bytes = bytes, .stream = s,
                    .pdl = true},
                   qkv, q_heads * D, kv.kv_heads * D, G, q_norm, eps, rope, meta, rows, kv, layer, out);
  });
}

}  // namespace qwen
