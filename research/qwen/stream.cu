// research/qwen/stream.cu: the streaming decode kernel (see stream.cuh), then its launcher.
//
// Block = 8 compute warps + 1 control warp. Shared memory: a ring of `slots` slots (one work item's
// weight rows each, filled by bulk copies) and the staged input x of the current phase (bf16, rows x K).
//
// Control warp (lane 0): claims tickets (the first `slots` at once, then one ahead), fills slot
// i % slots with item i (phase and index in shared memory; weights by cp.async.bulk completing on
// full[slot], or a bare arrive for items without weights), waits until the compute warps release
// the slot (empty[slot]), then refills it. When the block's run of consecutive items of one phase
// ends it adds the run's length to that phase's completed counter (red.release.gpu), only for phases
// that a later phase of the same launch waits for.
// Compute warps: wait for full[slot]; on the first item of a phase wait for the previous phase's
// counter (ld.acquire.gpu, one thread, then a named barrier) and stage x; compute; release the slot.
#include "stream.cuh"
#include "device_helpers.cuh"

#include <replay/error.hpp>

#include <fmt/format.h>

#include <cstdio>

namespace qwen {
namespace {

using namespace dev;

constexpr int kSW = 8;                     // compute warps
constexpr int kSThreads = (kSW + 1) * 32;  // + the control warp
constexpr int kMaxSlots = 8;
static_assert(kSW * 32 == 256, "compute_sync() names 256 threads");

/// Barrier of the 8 compute warps only (the control warp runs on its own).
__device__ __forceinline__ void compute_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

// ------------------------------------------------------------------------------------------------
// Block state
// ------------------------------------------------------------------------------------------------

template <int B>
struct Shared {
  unsigned long long full[kMaxSlots];   // slot filled (bulk copy bytes arrived)
  unsigned long long empty[kMaxSlots];  // slot released by the 8 compute warps
  unsigned long long best[B];           // argmax: this block's best key per row
  unsigned long long* keys;             // argmax: where to reduce `best` at exit (nullptr: no argmax item)
  StreamPhase desc[2];                  // descriptor of the current phase (double-buffered per phase change)
  int phase[kMaxSlots];                 // phase of the item in the slot; -1: no more items
  int local[kMaxSlots];                 // item index within its phase
  float red[kSW][B];                    // RMSNorm partial sums
  float part[2][kSW][2][B];             // K-split partial dot products (double-buffered by item parity)
};

/// On the first item of a phase: wait until the phase it depends on (same launch) has `need` completed
/// items (relaxed polling, then one acquire fence), then line up the compute warps (which also makes
/// the shared descriptor visible and means every warp is done with the previous item's shared x).
__device__ __forceinline__ void ready(const StreamLaunch& L, int wait, unsigned need, int tid) {
  if (wait >= 0 && tid == 0) {
    const unsigned* f = L.done + wait;
    if (ld_relaxed(f) < need) {
      const unsigned long long t0 = global_ns();
      for (unsigned n = 1; ld_relaxed(f) < need; ++n)
        if ((n & 255u) == 0 && global_ns() - t0 > kStuckNs) stuck("a phase", wait, static_cast<int>(need));
    }
    fence_acquire();
  }
  __syncwarp();
  compute_sync();
}

/// x of a GEMV phase into shared memory as bf16 [B][K]: copied, or the fp32 residual RMS-normalised
/// (the same reduction order as gemv_kernel's prologue). Activations are read through L2 (__ldcg).
template <int B>
__device__ void stage_x(const StreamPhase& ph, bf16* xs, Shared<B>& sh, int tid, int lane, int warp) {
  const int K = ph.K;
  if (ph.in.norm_w != nullptr) {
    const float* x = ph.in.x_f32;
    float ss[B];
#pragma unroll
    for (int b = 0; b < B; ++b) ss[b] = 0.f;
    for (int k = tid * 4; k < K; k += kSW * 32 * 4) {
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const float4 v = __ldcg(reinterpret_cast<const float4*>(x + std::size_t(b) * K + k));
        ss[b] += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
      }
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
      ss[b] = warp_sum(ss[b]);
      if (lane == 0) sh.red[warp][b] = ss[b];
    }
    compute_sync();
    float rs[B];
#pragma unroll
    for (int b = 0; b < B; ++b) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < kSW; ++w) s += sh.red[w][b];
      rs[b] = rsqrtf(s / K + ph.in.eps);
    }
    for (int k = tid * 8; k < K; k += kSW * 32 * 8) {
      float g[8];
      unpack8(*reinterpret_cast<const uint4*>(ph.in.norm_w + k), g);
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const float4 a = __ldcg(reinterpret_cast<const float4*>(x + std::size_t(b) * K + k));
        const float4 c = __ldcg(reinterpret_cast<const float4*>(x + std::size_t(b) * K + k + 4));
        uint4 o;
        o.x = pack2(a.x * rs[b] * g[0], a.y * rs[b] * g[1]);
        o.y = pack2(a.z * rs[b] * g[2], a.w * rs[b] * g[3]);
        o.z = pack2(c.x * rs[b] * g[4], c.y * rs[b] * g[5]);
        o.w = pack2(c.z * rs[b] * g[6], c.w * rs[b] * g[7]);
        *reinterpret_cast<uint4*>(xs + std::size_t(b) * K + k) = o;
      }
    }
  } else {
    for (int k = tid * 8; k < K; k += kSW * 32 * 8) {
#pragma unroll
      for (int b = 0; b < B; ++b)
        *reinterpret_cast<uint4*>(xs + std::size_t(b) * K + k) =
            __ldcg(reinterpret_cast<const uint4*>(ph.in.x_bf16 + std::size_t(b) * K + k));
    }
  }
  compute_sync();
}

/// Partial dot products of weight row(s) in shared memory with x over k = kbeg, kbeg + 256, ... < kend.
template <int B, bool PAIR>
__device__ __forceinline__ void dot_rows(const bf16* w0, const bf16* w1, const bf16* xs, int K, int kbeg, int kend,
                                         float (&acc)[2][B]) {
#pragma unroll 2
  for (int k = kbeg; k < kend; k += 256) {
    float wf0[8], wf1[8];
    unpack8(*reinterpret_cast<const uint4*>(w0 + k), wf0);
    if constexpr (PAIR) unpack8(*reinterpret_cast<const uint4*>(w1 + k), wf1);
#pragma unroll
    for (int b = 0; b < B; ++b) {
      float xf[8];
      unpack8(*reinterpret_cast<const uint4*>(xs + std::size_t(b) * K + k), xf);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        acc[0][b] = fmaf(wf0[j], xf[j], acc[0][b]);
        if constexpr (PAIR) acc[1][b] = fmaf(wf1[j], xf[j], acc[1][b]);
      }
    }
  }
}

template <int B>
__device__ __forceinline__ void gemv_epilogue(const StreamPhase& ph, int n, const float (&a)[2][B], Shared<B>& sh) {
#pragma unroll
  for (int b = 0; b < B; ++b) {
    const std::size_t o = std::size_t(b) * ph.ldy + n;
    switch (ph.mode) {
      case gemv_out::store_f32: ph.y_f32[o] = a[0][b]; break;
      case gemv_out::add_f32: ph.y_f32[o] = __ldcg(ph.y_f32 + o) + a[0][b]; break;
      case gemv_out::silu_mul: {
        const float g = a[0][b];
        ph.y_bf16[o] = __float2bfloat16(g / (1.f + __expf(-g)) * a[1][b]);
        break;
      }
      case gemv_out::argmax:
        ph.y_f32[o] = a[0][b];
        atomicMax(&sh.best[b], argmax_key(a[0][b], n));
        sh.keys = ph.keys;
        break;
    }
  }
}

/// One GEMV item: rows [n0, n0 + nr) of the phase's matrix, weights in the ring slot `tile`
/// ([nr][K], for gate/up [nr][K] gate rows then [nr][K] up rows).
template <int B, bool PAIR>
__device__ void gemv_item(const StreamPhase& ph, int local, const bf16* tile, const bf16* xs, Shared<B>& sh, int par,
                          int tid, int lane, int warp) {
  const int K = ph.K, R = ph.rows;
  const int n0 = local * R;
  const int nr = min(R, ph.N - n0);
  if (R >= kSW) {  // a warp per row
    for (int r = warp; r < nr; r += kSW) {
      float acc[2][B] = {};
      dot_rows<B, PAIR>(tile + std::size_t(r) * K, tile + std::size_t(nr + r) * K, xs, K, lane * 8, K, acc);
#pragma unroll
      for (int j = 0; j < (PAIR ? 2 : 1); ++j)
#pragma unroll
        for (int b = 0; b < B; ++b) acc[j][b] = warp_sum(acc[j][b]);
      if (lane == 0) gemv_epilogue<B>(ph, n0 + r, acc, sh);
    }
  } else {  // C = 8 / R warps per row, each over a contiguous K range; fixed-order combine
    const int C = kSW / R;
    const int r = warp / C, c = warp % C;
    float acc[2][B] = {};
    if (r < nr) {
      const int kc = ((K + C - 1) / C + 7) / 8 * 8;
      const int kb = c * kc, ke = min(K, kb + kc);
      dot_rows<B, PAIR>(tile + std::size_t(r) * K, tile + std::size_t(nr + r) * K, xs, K, kb + lane * 8, ke, acc);
    }
#pragma unroll
    for (int j = 0; j < (PAIR ? 2 : 1); ++j)
#pragma unroll
      for (int b = 0; b < B; ++b) acc[j][b] = warp_sum(acc[j][b]);
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int b = 0; b < B; ++b) sh.part[par][warp][j][b] = acc[j][b];
    }
    compute_sync();
    if (tid < nr) {
      float a[2][B] = {};
      for (int cc = 0; cc < C; ++cc)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int b = 0; b < B; ++b) a[j][b] += sh.part[par][tid * C + cc][j][b];
      gemv_epilogue<B>(ph, n0 + tid, a, sh);
    }
  }
}

/// One attention item: row r, kv head kvh (the G query heads sharing it). The old tokens' K/V
/// (positions < pos, not written in this launch) of the first round are loaded before waiting for the
/// QKV phase; the new token's K/V come from shared memory. Scratch: the item's ring slot.
template <int B, int D, int G>
__device__ void attention_item(const StreamLaunch& L, const StreamPhase& gph, const StreamPhase& ph, int local,
                               float* scratch, bool fresh, int tid, int lane, int warp) {
  constexpr int E = D / 64;
  // LPT lanes per token (8; 16 when G * D is large, so that q and the accumulators of the G heads fit
  // in the 168 registers a 9-warp block allows), DPL dims per lane, TPW tokens per warp and round.
  constexpr int LPT = G * D > 256 ? 16 : 8;
  constexpr int DPL = D / LPT;
  constexpr int NV = DPL / 8;  // uint4 per lane per token
  constexpr int TPW = 32 / LPT;
  constexpr int T = 2;         // tokens per lane group per round
  static_assert(NV >= 1, "at least one 16-byte load per lane and token");
  const KvPool& kv = L.kv;
  const RowMeta& meta = L.meta;
  const int r = local / kv.kv_heads, kvh = local % kv.kv_heads;
  float* q_s = scratch;               // [G][D]
  float* kn = q_s + G * D;            // [D] new K (bf16-rounded, as stored)
  float* vn = kn + D;                 // [D] new V
  float* red_m = vn + D;              // [kSW][G]
  float* red_l = red_m + kSW * G;     // [kSW][G]
  float* red_acc = red_l + kSW * G;   // [kSW][G][D]

  const int pos = meta.pos[r];
  const int seq_len = pos + 1;
  const std::int32_t* table = meta.block_table + std::size_t(meta.slot[r]) * meta.table_width;
  // `gph` (global) before the wait; `ph` (the shared copy) is visible after it.
  bf16* kbase = kv.base + std::size_t(gph.layer) * kv.layer_stride();
  bf16* vbase = kbase + kv.kv_stride();
  const int sub = lane % LPT, grp = lane / LPT;

  uint4 kr[T][NV], vr[T][NV];
  auto load_old = [&](int base) {
#pragma unroll
    for (int u = 0; u < T; ++u) {
      const int t = base + u * kSW * TPW + grp;
      if (t < pos) {
        const int blk = table[t / kv.block_size];
        const std::size_t o =
            ((std::size_t(blk) * kv.kv_heads + kvh) * kv.block_size + t % kv.block_size) * D + sub * DPL;
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          kr[u][i] = *reinterpret_cast<const uint4*>(kbase + o + i * 8);
          vr[u][i] = *reinterpret_cast<const uint4*>(vbase + o + i * 8);
        }
      } else {
#pragma unroll
        for (int i = 0; i < NV; ++i) kr[u][i] = vr[u][i] = make_uint4(0, 0, 0, 0);
      }
    }
  };
  load_old(warp * TPW);
  if (fresh) ready(L, gph.wait, static_cast<unsigned>(gph.wait_items), tid);
  else compute_sync();  // the shared descriptor and scratch: lined up with the previous item

  // Per-head norm + RoPE of the G query heads (scaled by 1/sqrt(d)) and of the new K; new K/V stored.
  const float* row = ph.qkv + std::size_t(r) * (ph.q_dim + 2 * ph.kv_dim);
  const float2* rope_row = ph.rope + std::size_t(pos) * (D / 2);
  const float scale = rsqrtf(static_cast<float>(D));
  for (int item = warp; item < G + 1; item += kSW) {
    float lo[E], hi[E];
    if (item < G) {
      norm_rope_head<D>(row + (kvh * G + item) * D, ph.q_norm, ph.eps, rope_row, lane, lo, hi);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        q_s[item * D + lane * E + e] = lo[e] * scale;
        q_s[item * D + D / 2 + lane * E + e] = hi[e] * scale;
      }
    } else {
      const int blk = table[pos / kv.block_size];
      const std::size_t o = ((std::size_t(blk) * kv.kv_heads + kvh) * kv.block_size + pos % kv.block_size) * D;
      norm_rope_head<D>(row + ph.q_dim + kvh * D, ph.k_norm, ph.eps, rope_row, lane, lo, hi);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const bf16 a = __float2bfloat16(lo[e]), b = __float2bfloat16(hi[e]);
        kbase[o + lane * E + e] = a;
        kbase[o + D / 2 + lane * E + e] = b;
        kn[lane * E + e] = __bfloat162float(a);
        kn[D / 2 + lane * E + e] = __bfloat162float(b);
      }
      const float* v = row + ph.q_dim + ph.kv_dim + kvh * D;
      for (int d = lane; d < D; d += 32) {
        const bf16 a = __float2bfloat16(__ldcg(v + d));
        vbase[o + d] = a;
        vn[d] = __bfloat162float(a);
      }
    }
  }
  compute_sync();

  float q[G][DPL];
#pragma unroll
  for (int h = 0; h < G; ++h)
#pragma unroll
    for (int j = 0; j < DPL; ++j) q[h][j] = q_s[h * D + sub * DPL + j];
  float m[G], l[G], acc[G][DPL];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    m[h] = -INFINITY, l[h] = 0.f;
#pragma unroll
    for (int j = 0; j < DPL; ++j) acc[h][j] = 0.f;
  }
  for (int base = warp * TPW; base < seq_len; base += kSW * TPW * T) {
    if (base != warp * TPW) load_old(base);
#pragma unroll
    for (int u = 0; u < T; ++u) {
      const int t = base + u * kSW * TPW + grp;
      float kf[DPL], vf[DPL];
      if (t == pos) {
#pragma unroll
        for (int j = 0; j < DPL; ++j) kf[j] = kn[sub * DPL + j], vf[j] = vn[sub * DPL + j];
      } else {
#pragma unroll
        for (int i = 0; i < NV; ++i) unpack8(kr[u][i], kf + 8 * i), unpack8(vr[u][i], vf + 8 * i);
      }
      float s[G];
#pragma unroll
      for (int h = 0; h < G; ++h) {
        float d = 0.f;
#pragma unroll
        for (int j = 0; j < DPL; ++j) d = fmaf(q[h][j], kf[j], d);
#pragma unroll
        for (int o = 1; o < LPT; o <<= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        s[h] = d;
      }
      if (t < seq_len) {
#pragma unroll
        for (int h = 0; h < G; ++h) {
          const float mn = fmaxf(m[h], s[h]);
          const float corr = __expf(m[h] - mn);
          const float p = __expf(s[h] - mn);
          l[h] = l[h] * corr + p;
#pragma unroll
          for (int j = 0; j < DPL; ++j) acc[h][j] = fmaf(p, vf[j], acc[h][j] * corr);
          m[h] = mn;
        }
      }
    }
  }
  // Combine the lane groups of the warp, then the warps.
  combine_lane_groups<G, DPL, LPT>(m, l, acc);
  store_warp_state<G, DPL>(m, l, acc, warp, grp, sub, red_m, red_l, red_acc, D);
  compute_sync();
  for (int idx = tid; idx < G * D; idx += kSW * 32) {
    const int h = idx / D, d = idx % D;
    const auto [mx, Ls, A] = merge_warp_states<kSW>(red_m, red_l, red_acc, G, D, h, d);
    ph.out[std::size_t(r) * ph.q_dim + (kvh * G + h) * D + d] = __float2bfloat16(A / Ls);
  }
  fence_proxy_async();  // the slot's bytes were written generically; a bulk copy refills it next
}

template <int B>
__device__ void embed_item(const StreamPhase& ph, const RowMeta& meta, int tid) {
  for (int r = 0; r < B; ++r) {
    int tok = meta.token[r];
    tok = tok < 0 ? 0 : (tok >= ph.vocab ? ph.vocab - 1 : tok);
    if (tid == 0) ph.keys[r] = 0ull;
    const bf16* src = ph.embed + std::size_t(tok) * ph.hidden;
    float* dst = ph.residual + std::size_t(r) * ph.hidden;
    for (int k = tid * 8; k < ph.hidden; k += kSW * 32 * 8) {
      float f[8];
      unpack8(*reinterpret_cast<const uint4*>(src + k), f);
      *reinterpret_cast<float4*>(dst + k) = make_float4(f[0], f[1], f[2], f[3]);
      *reinterpret_cast<float4*>(dst + k + 4) = make_float4(f[4], f[5], f[6], f[7]);
    }
  }
}

/// The control warp's lane 0: tickets, slot fills, completion counters.
template <int B>
__device__ void control(const StreamLaunch& L, unsigned char* smem, Shared<B>& sh) {
  const int S = L.slots;
  const unsigned long long pol = evict_first_policy();
  int cp = L.p0;  // phase of the last ticket located (tickets only grow)
  auto fill = [&](int s, unsigned t) -> bool {
    if (t >= L.total) {
      sh.phase[s] = -1;
      mbar_arrive(&sh.full[s]);
      return false;
    }
    while (t >= static_cast<unsigned>(L.phases[cp].first + L.phases[cp].items)) ++cp;
    const StreamPhase& ph = L.phases[cp];
    const int local = static_cast<int>(t) - ph.first;
    sh.phase[s] = cp;
    sh.local[s] = local;
    if (ph.kind == phase_kind::gemv) {
      unsigned char* dst = smem + std::size_t(s) * L.slot_bytes;
      const int n0 = local * ph.rows, nr = min(ph.rows, ph.N - n0);
      const unsigned bytes = static_cast<unsigned>(nr) * static_cast<unsigned>(ph.K) * 2u;
      const bool pair = ph.mode == gemv_out::silu_mul;
      mbar_arrive_tx(&sh.full[s], pair ? 2 * bytes : bytes);
      bulk_load(dst, ph.W + std::size_t(n0) * ph.K, bytes, &sh.full[s], pol);
      if (pair) bulk_load(dst + bytes, ph.W + std::size_t(ph.N + n0) * ph.K, bytes, &sh.full[s], pol);
    } else {
      mbar_arrive(&sh.full[s]);
    }
    return true;
  };

  // Weights do not depend on earlier kernels: claim and start streaming before the PDL wait. One
  // ticket per atomic (all in flight together; one thread's atomics on one address are performed in
  // program order), so that consecutive items of a phase spread over blocks.
  unsigned tk[kMaxSlots];
#pragma unroll
  for (int s = 0; s < kMaxSlots; ++s)
    if (s < S) tk[s] = atomicAdd(L.ctr, 1u);
  int nfill = 0;
  bool ended = false;
#pragma unroll
  for (int s = 0; s < kMaxSlots; ++s) {
    if (s < S && !ended) {
      if (fill(s, tk[s])) ++nfill;
      else ended = true;
    }
  }
  unsigned next = ended ? 0u : atomicAdd(L.ctr, 1u);  // one ticket ahead: the atomic's latency is hidden
  pdl_wait();
  unsigned run = 0;  // consumed items of the current run (consecutive items of one phase)
  for (int j = 0; j < nfill; ++j) {
    const int s = j % S;
    mbar_wait(&sh.empty[s], static_cast<unsigned>(j / S) & 1u, s);
    const int p = sh.phase[s];
    ++run;
    // Item j + 1 is in the ring already (nfill >= j + slots while not ended) or is the end marker.
    const int pn = j + 1 < nfill ? sh.phase[(j + 1) % S] : -1;
    if (pn != p) {
      if (L.trace != nullptr) {
        if (atom_release_add(L.done + p, run) + run == static_cast<unsigned>(L.phases[p].items))
          L.trace[p] = global_ns();
      } else if (L.phases[p].signal) {
        red_release_add(L.done + p, run);
      }
      run = 0;
    }
    if (!ended) {
      if (fill(s, next)) {
        ++nfill;
        next = atomicAdd(L.ctr, 1u);
      } else {
        ended = true;
      }
    }
  }
}

template <int B, int D, int G>
__device__ void compute(const StreamLaunch& L, unsigned char* smem, Shared<B>& sh, int tid, int lane, int warp) {
  static_assert(sizeof(StreamPhase) % 4 == 0 && sizeof(StreamPhase) / 4 <= kSW * 32, "descriptor copy");
  pdl_wait();
  bf16* xs = reinterpret_cast<bf16*>(smem + std::size_t(L.slots) * L.slot_bytes);
  int cur = -1, sel = 0;
  for (int i = 0;; ++i) {
    const int s = i % L.slots;
    mbar_wait(&sh.full[s], static_cast<unsigned>(i / L.slots) & 1u, s);
    const int p = sh.phase[s];
    if (p < 0) break;
    const int local = sh.local[s];
    unsigned char* slot = smem + std::size_t(s) * L.slot_bytes;
    const bool fresh = p != cur;
    const StreamPhase& gph = L.phases[p];  // global; read before any wait (an acquire may drop L1)
    if (fresh) {
      // Copy the descriptor into the shared buffer not in use; visible after ready()'s barrier.
      cur = p;
      sel ^= 1;
      if (tid < static_cast<int>(sizeof(StreamPhase) / 4))
        reinterpret_cast<unsigned*>(&sh.desc[sel])[tid] = reinterpret_cast<const unsigned*>(&gph)[tid];
    }
    const StreamPhase& ph = sh.desc[sel];
    const phase_kind kind = fresh ? gph.kind : ph.kind;
    if (kind == phase_kind::gemv) {
      if (fresh) {
        ready(L, gph.wait, static_cast<unsigned>(gph.wait_items), tid);
        stage_x<B>(ph, xs, sh, tid, lane, warp);
      }
      const bf16* tile = reinterpret_cast<const bf16*>(slot);
      if (ph.mode == gemv_out::silu_mul) gemv_item<B, true>(ph, local, tile, xs, sh, i & 1, tid, lane, warp);
      else gemv_item<B, false>(ph, local, tile, xs, sh, i & 1, tid, lane, warp);
    } else if (kind == phase_kind::attention) {
      attention_item<B, D, G>(L, gph, ph, local, reinterpret_cast<float*>(slot), fresh, tid, lane, warp);
    } else {
      if (fresh) ready(L, gph.wait, static_cast<unsigned>(gph.wait_items), tid);
      embed_item<B>(ph, L.meta, tid);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&sh.empty[s]);
  }
}

template <int B, int D, int G>
__global__ void __launch_bounds__(kSThreads, 1) stream_kernel(const StreamLaunch L) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ Shared<B> sh;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  pdl_trigger();
  if (tid == 0) {
    for (int s = 0; s < L.slots; ++s) {
      mbar_init(&sh.full[s], 1);
      mbar_init(&sh.empty[s], kSW);
    }
    mbar_fence_init();
    sh.keys = nullptr;
  }
  if (tid < B) sh.best[tid] = 0ull;
  __syncthreads();
  if (warp == kSW) {
    if (lane == 0) control<B>(L, smem, sh);
    __syncwarp();
  } else {
    compute<B, D, G>(L, smem, sh, tid, lane, warp);
  }
  __syncthreads();
  if (tid == 0) {
    if (sh.keys != nullptr)
      for (int b = 0; b < B; ++b)
        if (sh.best[b] != 0ull) atomicMax(sh.keys + b, sh.best[b]);
    __threadfence();
    if (atomicAdd(L.ctr + 1, 1u) == gridDim.x - 1) {  // last block out: reset the counters for the next step
      L.ctr[0] = 0;
      L.ctr[1] = 0;
      for (int p = L.p0; p < L.p1; ++p) L.done[p] = 0;
    }
  }
}

using kernel_ptr = void (*)(const StreamLaunch);

template <int B>
kernel_ptr pick_dg(int D, int G) {
  if (D == 64 && G == 2) return stream_kernel<B, 64, 2>;
  if (D == 128 && G == 2) return stream_kernel<B, 128, 2>;
  if (D == 128 && G == 4) return stream_kernel<B, 128, 4>;
  return nullptr;
}

kernel_ptr pick(int rows, int D, int G) {
  switch (rows) {
    case 1: return pick_dg<1>(D, G);
    case 2: return pick_dg<2>(D, G);
    case 4: return pick_dg<4>(D, G);
    default: return nullptr;
  }
}

}  // namespace

bool stream_supported(int rows, int head_dim, int group) { return pick(rows, head_dim, group) != nullptr; }

int stream_rows_per_item(int K, bool pair, int tile_bytes) {
  const long long row_bytes = 2ll * K * (pair ? 2 : 1);
  const long long r = tile_bytes / row_bytes;
  return r >= 16 ? 16 : r >= 8 ? 8 : r >= 4 ? 4 : r >= 2 ? 2 : 1;
}

std::size_t stream_attention_scratch(int head_dim, int group) {
  const std::size_t G = group, D = head_dim;
  return sizeof(float) * (G * D + 2 * D + 2 * kSW * G + kSW * G * D);
}

StreamGeometry stream_geometry(int rows, int head_dim, int group, int slot_bytes, int max_k, int max_slots,
                               int num_sms) {
  const kernel_ptr k = pick(rows, head_dim, group);
  if (k == nullptr) throw replay::usage_error("qwen::stream_geometry: shape not supported by the streaming kernel");
  int dev = 0, optin = 0;
  REPLAY_CHECK(cudaGetDevice(&dev));
  REPLAY_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  cudaFuncAttributes fa{};
  REPLAY_CHECK(cudaFuncGetAttributes(&fa, k));
  StreamGeometry g;
  g.slot_bytes = (slot_bytes + 127) / 128 * 128;
  const std::size_t xs = (std::size_t(rows) * max_k * 2 + 127) / 128 * 128;
  const long long avail = static_cast<long long>(optin) - static_cast<long long>(fa.sharedSizeBytes) -
                          static_cast<long long>(xs) - 1024;
  long long slots = avail / g.slot_bytes;
  if (slots > max_slots) slots = max_slots;
  if (slots > kMaxSlots) slots = kMaxSlots;
  if (slots < 2)
    throw replay::usage_error(fmt::format("qwen::stream_geometry: {} B slots and {} B of x do not fit twice in {} B",
                                          g.slot_bytes, xs, optin));
  g.slots = static_cast<int>(slots);
  g.smem = std::size_t(g.slots) * g.slot_bytes + xs;
  REPLAY_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(g.smem)));
  int per_sm = 0;
  REPLAY_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, kSThreads, g.smem));
  if (per_sm < 1)
    throw replay::usage_error(fmt::format("qwen::stream_geometry: a block ({} threads, {} registers each, {} B shared) "
                                          "does not fit on a multiprocessor",
                                          kSThreads, fa.numRegs, g.smem + fa.sharedSizeBytes));
  g.grid = per_sm * num_sms;
  return g;
}

void launch_stream(const StreamLaunch& L, int rows, int head_dim, int group, const StreamGeometry& g,
                   replay::stream_ref s) {
  const kernel_ptr k = pick(rows, head_dim, group);
  if (k == nullptr) throw replay::usage_error("qwen::launch_stream: shape not supported by the streaming kernel");
  if (L.slots != g.slots || L.slot_bytes != g.slot_bytes)
    throw replay::usage_error("qwen::launch_stream: launch and geometry disagree");
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(g.grid);
  cfg.blockDim = dim3(kSThreads);
  cfg.dynamicSmemBytes = g.smem;
  cfg.stream = s.get();
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  REPLAY_CHECK(cudaLaunchKernelEx(&cfg, k, L), "launching qwen::stream_kernel (phases {}..{})", L.p0, L.p1);
}

}  // namespace qwen
