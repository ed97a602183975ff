// research/qwen/mega.cu: the persistent decode kernel (see mega.cuh), then its launcher.
//
// Block = 8 consumer warps + 1 producer warp, one block per SM. Shared memory: per consumer warp a
// ring of `slots` slots (MegaParams::piece weights each, 4-6 KiB), then a work area used either by a
// GEMV phase (the staged input x as bf16, and the fp32 residual row the RMSNorm reads) or by an
// attention item (q, the cross-warp softmax state, the new K/V). Attention items are (kv head, one
// of its query heads, chunk of the context), each on its own block; with several chunks each writes
// its partial state, then merges its share of the outputs from all of them (attention_combine).
//
// Per GEMV phase a consumer warp owns the contiguous rows [g N / GW, (g + 1) N / GW) (g: the warp's
// index in the grid, GW: consumer warps in the grid) and walks them piece by piece (up to a slot's
// weights of one row; gate and up pieces alternate for the gate/up projection); rows of at most
// 1024 weights are packed two to a slot (two consecutive rows, or a gate row and its up row) and go
// two at a time. Lane w of the producer warp keeps consumer warp w's ring full in
// that same order, over every GEMV of the step: it refills a slot once all 32 lanes of the warp have
// arrived on the slot's "empty" barrier. Only the consumer warps take part in the phases' barriers
// (named barrier 1).
//
// compute-sanitizer racecheck attributes a bulk copy that several producer lanes issue in one
// instruction to one of them, and reports the reads of the other lanes' rings as hazards
// (probes/raceprobe.cu shows it on an 8-ring block that is correct by construction). With
// MegaParams::serial_issue (QWEN_MEGA_SERIAL_ISSUE=1) the lanes issue one at a time: the same
// protocol, which racecheck follows (0 hazards), at a cost in speed.
#include "mega.cuh"
#include "device_helpers.cuh"

#include <replay/error.hpp>

#include <fmt/format.h>

#include <algorithm>

namespace qwen {
namespace {

using namespace dev;

constexpr int kMW = kMegaWarps;        // consumer warps per block (16 at 128 registers spilled and ran slower)
constexpr int kCThreads = kMW * 32;    // consumer threads
constexpr int kMThreads = kCThreads + 32;  // + the producer warp
constexpr int kAW = 8;                 // warps of the RMSNorm reduction and of attention (the per-matrix
                                       // kernels' 8, so that the summation orders match theirs)
constexpr int kMaxRingSlots = 8;       // slots per warp at most (the smallest slot, 4 KiB, fits 6 times)
constexpr int kChunk = 1024;           // weights per lane-chunk (the per-matrix GEMVs' summation unit)
// Weights per slot: MegaParams::piece (mega_geometry: 2048, 2560 or 3072). 4 KiB of bf16 against 2 KiB:
// 4B 2.88 -> 3.32 ms (H200); rows of 2560 weights in 4 KiB slots filled their second slot a quarter.
constexpr int kMaxPiece = 4 * kChunk;
// Tagged words in flight per thread while staging (12: spills). kPollBatch by default; kPollBatchWide
// in the variants for models wider than 2048 (pick): 4B's 2560 residual words then take one polling
// round instead of two and its down input 2 instead of 3 (H200 4B -3%, H100 -1.7%), but the
// registers cost the narrow 0.6B 2-3.5%, whose stagings need one round either way.
constexpr int kPollBatch = 8;
constexpr int kPollBatchWide = 10;
constexpr int kSmemLayers = 48;        // layer tables up to this long are copied to shared memory
                                       // (64: 4B's fifth 5 KiB slot per warp did not fit)
constexpr int kSmemTable = 256;        // block-table rows up to this long are copied to shared memory
/// Bytes of the work area's GEMV staging: x as bf16 (the widest input), or x as bf16 then the fp32
/// residual row (xf) (host and device use this one formula).
__host__ __device__ constexpr std::size_t stage_bytes(int hidden, int q_dim, int intermediate) {
  const std::size_t kmax = static_cast<std::size_t>(hidden > q_dim ? (hidden > intermediate ? hidden : intermediate)
                                                                   : (q_dim > intermediate ? q_dim : intermediate));
  const std::size_t a = kmax * 2, b = (std::size_t(hidden) * 2 + 15) / 16 * 16 + std::size_t(hidden) * 4;
  return ((a > b ? a : b) + 15) / 16 * 16;
}
// The trace (MegaParams::trace) is compiled in only by a build with -DQWEN_MEGA_TRACE_BUILD=1 (CMake
// option QWEN_MEGA_TRACE): its checks alone, never taken, made the step 1.2-2% slower (H200, 0.6B and 4B).
#ifndef QWEN_MEGA_TRACE_BUILD
#define QWEN_MEGA_TRACE_BUILD 0
#endif

// ------------------------------------------------------------------------------------------------
// Tagged words
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ unsigned long long ld_word(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_word(unsigned long long* p, float v, unsigned tag) {
  const unsigned long long w = (static_cast<unsigned long long>(tag) << 32) | __float_as_uint(v);
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
}
__device__ __forceinline__ unsigned word_tag(unsigned long long w) { return static_cast<unsigned>(w >> 32); }
__device__ __forceinline__ float word_val(unsigned long long w) { return __uint_as_float(static_cast<unsigned>(w)); }

// Half words: activations that are bf16 values (attention's output, silu(gate) * up) travel as 32-bit
// words {bf16 bits (low), 16-bit tag (high)}, also written by one store each: half the words' bytes,
// and a thread polls two of them with one 64-bit load (a load may see one half new and the other
// old; each half was written by one store and carries its own tag), so a thread's kPollBatch loads
// (the same registers as the 64-bit words') cover twice the elements: 0.6B's down
// input (3072) and 4B's O input (4096) take one polling round instead of two, 4B's down input 3
// instead of 5. The 16-bit tag is the word tag mod 65535, plus 1: never 0 (the buffers' initial
// state), and two successive writes of a word (tags fewer than 65535 apart) never share it.
__device__ __forceinline__ unsigned half_tag(unsigned tag) { return tag % 65535u + 1u; }
__device__ __forceinline__ void st_hword(unsigned* p, float v, unsigned tag) {
  const unsigned w = (half_tag(tag) << 16) | __bfloat16_as_ushort(__float2bfloat16(v));
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(w) : "memory");
}

/// The value of word p once it carries `tag`; `w` is a load of it already issued.
__device__ __forceinline__ float settle(const unsigned long long* p, unsigned long long w, unsigned tag) {
  if (word_tag(w) != tag) {
    const unsigned long long t0 = global_ns();
    for (unsigned n = 1; word_tag(w = ld_word(p)) != tag; ++n)
      if ((n & 1023u) == 0 && global_ns() - t0 > kStuckNs) stuck("an activation word", static_cast<int>(tag), 0);
  }
  return word_val(w);
}

/// Settles words w[i] (loads of addr(i) already issued) for i < count: every round re-requests all
/// the words that are not ready(w) yet, so a round costs one round trip whatever their number.
/// (`tag`: for the hang report.)
template <int N, class Addr, class Ready>
__device__ __forceinline__ void settle_all_if(unsigned long long (&w)[N], int count, unsigned tag, Ready&& ready,
                                              Addr&& addr) {
  unsigned long long t0 = 0;
  for (unsigned n = 0;; ++n) {
    bool all = true;
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (i < count && !ready(w[i])) all = false, w[i] = ld_word(addr(i));
    if (all) return;
    if (n == 0) t0 = global_ns();
    else if ((n & 1023u) == 0 && global_ns() - t0 > kStuckNs) stuck("activation words", static_cast<int>(tag), 0);
  }
}
/// settle_all_if until every word carries `tag`.
template <int N, class Addr>
__device__ __forceinline__ void settle_all(unsigned long long (&w)[N], int count, unsigned tag, Addr&& addr) {
  settle_all_if(w, count, tag, [tag](unsigned long long v) { return word_tag(v) == tag; }, static_cast<Addr&&>(addr));
}

/// store(i, word) for every i < n, once word at(i) is ready(word); the block's consumer threads split
/// the words, PB of them in flight per thread.
template <int PB = kPollBatch, class At, class Ready, class Store>
__device__ __forceinline__ void poll_words_if(int n, unsigned tag, Ready&& ready, At&& at, Store&& store) {
  for (int base = threadIdx.x; base < n; base += kCThreads * PB) {
    unsigned long long w[PB];
    const int count = min(PB, (n - base + kCThreads - 1) / kCThreads);
#pragma unroll
    for (int i = 0; i < PB; ++i)
      if (i < count) w[i] = ld_word(at(base + i * kCThreads));
    settle_all_if(w, count, tag, ready, [&](int i) { return at(base + i * kCThreads); });
#pragma unroll
    for (int i = 0; i < PB; ++i)
      if (i < count) store(base + i * kCThreads, w[i]);
  }
}
/// store(i, value) for every i < n, once word at(i) carries `tag`.
template <int PB = kPollBatch, class At, class Store>
__device__ __forceinline__ void poll_words(int n, unsigned tag, At&& at, Store&& store) {
  poll_words_if<PB>(
      n, tag, [tag](unsigned long long v) { return word_tag(v) == tag; }, static_cast<At&&>(at),
      [&](int i, unsigned long long v) { store(i, word_val(v)); });
}
/// The half words src[0, n) (n even) into dst[0, n) as bf16, once each carries half_tag(tag): a
/// 64-bit word of poll_words_if is a pair of them, ready when both halves are.
template <int PB = kPollBatch>
__device__ __forceinline__ void poll_half_range(const unsigned* src, int n, unsigned tag, bf16* dst) {
  const unsigned ht = half_tag(tag);
  const auto* pairs = reinterpret_cast<const unsigned long long*>(src);
  poll_words_if<PB>(
      n / 2, tag,
      [ht](unsigned long long w) {
        return static_cast<unsigned>(w >> 16 & 0xffffu) == ht && static_cast<unsigned>(w >> 48) == ht;
      },
      [pairs](int i) { return pairs + i; },
      [dst](int i, unsigned long long w) {
        reinterpret_cast<unsigned*>(dst)[i] =
            static_cast<unsigned>(w & 0xffffu) | static_cast<unsigned>(w >> 16 & 0xffff0000u);
      });
}
/// poll_words over the contiguous words src[0, n).
template <int PB = kPollBatch, class Store>
__device__ __forceinline__ void poll_range(const unsigned long long* src, int n, unsigned tag, Store&& store) {
  poll_words<PB>(n, tag, [src](int i) { return src + i; }, static_cast<Store&&>(store));
}

// ------------------------------------------------------------------------------------------------
// The weight stream
// ------------------------------------------------------------------------------------------------

/// Barrier of the consumer warps only (the producer warp runs on its own).
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kCThreads) : "memory"); }

enum : int { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3, kLmHead = 4 };

struct MegaGemv {
  const bf16* W;
  int N, K;
};

/// GEMV j of the step: 4 per layer (QKV, O, gate/up, down), then lm_head.
__device__ __forceinline__ MegaGemv gemv_of(const MegaParams& p, const MegaLayer* layers, int j) {
  if (j >= 4 * p.num_layers) return {p.lm_head, p.vocab, p.hidden};
  const MegaLayer& w = layers[j >> 2];
  switch (j & 3) {
    case kQkv: return {w.wqkv, p.q_dim + 2 * p.kv_dim, p.hidden};
    case kO: return {w.wo, p.hidden, p.q_dim};
    case kGateUp: return {w.wgu, p.intermediate, p.hidden};
    default: return {w.wdown, p.hidden, p.intermediate};
  }
}
__device__ __forceinline__ int gemv_halves(const MegaParams& p, int j) {
  return j < 4 * p.num_layers && (j & 3) == kGateUp ? 2 : 1;
}
/// First row of warp g of GW in a matrix of N rows (warp g owns [split(g), split(g + 1))).
__device__ __forceinline__ int row_split(int g, int N, int GW) {
  // 32-bit when it fits (g < GW <= 16 K warps, N < 256 K rows): a 64-bit division is a long call
  return static_cast<unsigned>(N) < (1u << 18) ? static_cast<int>(static_cast<unsigned>(g * N) / static_cast<unsigned>(GW))
                                               : static_cast<int>(static_cast<long long>(g) * N / GW);
}

/// Lane 0's position in its warp's weight stream: GEMV j, row, unit = piece * halves + half. Rows of
/// at most kChunk weights are packed: one slot holds two consecutive rows (or a gate row and its up
/// row), so a ring holds twice as many of them (Qwen3-0.6B: QKV, gate/up and lm_head).
struct Cursor {
  int j, row, end, unit, units, halves;
  MegaGemv m;
};

/// From GEMV c.j on, the first with rows for warp g (c.j = 4 L + 1: the stream has ended).
__device__ __forceinline__ void cursor_seek(Cursor& c, const MegaParams& p, const MegaLayer* layers, int g,
                                            int GW, int piece) {
  for (; c.j <= 4 * p.num_layers; ++c.j) {
    c.m = gemv_of(p, layers, c.j);
    c.row = row_split(g, c.m.N, GW);
    c.end = row_split(g + 1, c.m.N, GW);
    if (c.row < c.end) {
      c.halves = gemv_halves(p, c.j);
      c.unit = 0;
      c.units = c.m.K <= kChunk ? 1 : (c.m.K + piece - 1) / piece * c.halves;
      return;
    }
  }
}
__device__ __forceinline__ void cursor_next(Cursor& c, const MegaParams& p, const MegaLayer* layers, int g,
                                            int GW, int piece) {
  if (++c.unit < c.units) return;
  c.unit = 0;
  c.row += c.m.K <= kChunk && c.halves == 1 && c.row + 1 < c.end ? 2 : 1;
  if (c.row < c.end) return;
  ++c.j;
  cursor_seek(c, p, layers, g, GW, piece);
}
/// One ring slot's bulk copies: `rows` copies of `bytes` each, the r-th from src + r * src_stride to
/// dst + r * dst_stride (a packed gate/up slot: the gate row and its up row; a tile: its 2 rows);
/// bytes == 0: none (the stream has ended).
struct PieceCopy {
  bf16* dst = nullptr;
  const bf16* src = nullptr;
  unsigned bytes = 0;
  int rows = 1;
  std::size_t src_stride = 0;  // elements
  int dst_stride = 0;          // elements
};

/// The cursor's piece for slot s of `ring` (nothing once the stream has ended), then advance.
__device__ __forceinline__ PieceCopy cursor_piece(Cursor& c, const MegaParams& p, const MegaLayer* layers, int g,
                                                  int GW, int piece, bf16* ring, int s) {
  PieceCopy pc;
  if (c.j > 4 * p.num_layers) return pc;
  pc.dst = ring + std::size_t(s) * piece;
  if (c.m.K <= kChunk) {  // packed: rows c.row and c.row + 1, or gate row c.row and its up row
    const unsigned row_bytes = static_cast<unsigned>(c.m.K) * sizeof(bf16);
    pc.src = c.m.W + std::size_t(c.row) * c.m.K;
    if (c.halves == 2) {
      pc.bytes = row_bytes;
      pc.rows = 2;
      pc.dst_stride = c.m.K;
      pc.src_stride = std::size_t(c.m.N) * c.m.K;
    } else {
      pc.bytes = (c.row + 1 < c.end ? 2u : 1u) * row_bytes;
    }
  } else {
    const int half = c.unit % c.halves, k0 = c.unit / c.halves * piece;
    pc.bytes = static_cast<unsigned>(min(piece, c.m.K - k0)) * sizeof(bf16);
    pc.src = c.m.W + (std::size_t(half) * c.m.N + c.row) * c.m.K + k0;
  }
  cursor_next(c, p, layers, g, GW, piece);
  return pc;
}

// Tiles (MegaParams::tiles): a GEMV's rows in pairs; a block owns the pairs [row_split(b, N / 2, grid),
// row_split(b + 1, ...)) (gate/up: each pair's gate rows and up rows, as two "virtual" pairs, gate
// first), and its items, (virtual pair, slice of PW / 2 weights of each row), pair-major, are split
// evenly over its consumer warps. A slot holds one item: 2 rows x PW / 2 weights, row r at
// r * PW / 2 (two bulk copies of PW bytes). Tiles of 4 rows x 512 weights (1 KiB copies) were
// measured too, and streamed slower: docs/perf-notes.md.
constexpr int kTileRows = 2;
constexpr int kTileBlock = 128;  // weights of a row per MMA (mma_tile); slices are multiples of it
constexpr int kTilePieces[] = {2048, 2560, 5120};  // weights per slot (a kernel variant each)

/// The block's share of a GEMV in tiles of tile_k weights per row: pairs [rg0, rg0 + nrg), S slices
/// per row, `halves` virtual pairs per pair, I items.
struct TileSplit {
  int rg0, nrg, S, halves, I;
};
__device__ __forceinline__ TileSplit tile_split(const MegaGemv& m, int halves, int block, int grid, int tile_k) {
  const int NG = m.N / kTileRows;
  const int rg0 = row_split(block, NG, grid), rg1 = row_split(block + 1, NG, grid);
  const int S = (m.K + tile_k - 1) / tile_k;
  return {rg0, rg1 - rg0, S, halves, (rg1 - rg0) * halves * S};
}

/// Tiles: a GEMV phase's partial row sums [kMW][tile_part_groups][kTileRows] (fp32) start right after
/// its staged x (K bf16 values), over the fp32 residual row, which only the staging reads: the lm_head's
/// 73 groups per warp (4B) then need no room beyond the down projection's staging, and the 4B ring takes a
/// fifth 5 KiB slot per warp. Host (mega_geometry) and device share these formulas.
__host__ __device__ constexpr std::size_t tile_part_offset(int K) { return (std::size_t(K) * 2 + 15) / 16 * 16; }
/// Groups a warp's items touch at most: I items over kMW warps, S per group (+1: a warp's range can
/// start inside a group).
__host__ __device__ constexpr int tile_part_groups(int I, int S) { return ((I + kMW - 1) / kMW + S - 1) / S + 1; }

/// A producer lane's position in its warp's stream of tiles: GEMV j, item i of [i, i1), which is
/// slice sl of virtual pair vg (counted along, no divisions per piece); tk weights per row and slot.
struct TileCursor {
  int j, i, i1, vg, sl, tk;
  TileSplit t;
  MegaGemv m;
};
__device__ __forceinline__ void tile_seek(TileCursor& c, const MegaParams& p, const MegaLayer* layers, int block,
                                          int warp) {
  for (; c.j <= 4 * p.num_layers; ++c.j) {
    c.m = gemv_of(p, layers, c.j);
    c.t = tile_split(c.m, gemv_halves(p, c.j), block, gridDim.x, c.tk);
    c.i = row_split(warp, c.t.I, kMW);
    c.i1 = row_split(warp + 1, c.t.I, kMW);
    if (c.i < c.i1) {
      c.vg = c.i / c.t.S;
      c.sl = c.i - c.vg * c.t.S;
      return;
    }
  }
}
__device__ __forceinline__ PieceCopy tile_piece(TileCursor& c, const MegaParams& p, const MegaLayer* layers,
                                                int block, int warp, bf16* ring, int s) {
  PieceCopy pc;
  if (c.j > 4 * p.num_layers) return pc;
  const int half = c.t.halves == 2 ? c.vg & 1 : 0, rg = c.t.rg0 + (c.t.halves == 2 ? c.vg >> 1 : c.vg);
  const int k0 = c.sl * c.tk;
  pc.dst = ring + std::size_t(s) * kTileRows * c.tk;
  pc.src = c.m.W + (std::size_t(half) * c.m.N + std::size_t(rg) * kTileRows) * c.m.K + k0;
  pc.bytes = static_cast<unsigned>(min(c.tk, c.m.K - k0)) * sizeof(bf16);
  pc.rows = kTileRows;
  pc.src_stride = static_cast<std::size_t>(c.m.K);
  pc.dst_stride = c.tk;
  if (++c.sl == c.t.S) c.sl = 0, ++c.vg;
  if (++c.i == c.i1) {
    ++c.j;
    tile_seek(c, p, layers, block, warp);
  }
  return pc;
}

/// Issues a slot's copies on its "full" barrier (the barrier expects their bytes).
__device__ __forceinline__ void issue_piece(const PieceCopy& pc, unsigned long long* bar, unsigned long long pol) {
  if (pc.bytes == 0) return;
  mbar_arrive_tx(bar, pc.bytes * static_cast<unsigned>(pc.rows));
  for (int r = 0; r < pc.rows; ++r)
    bulk_load(pc.dst + std::size_t(r) * pc.dst_stride, pc.src + r * pc.src_stride, pc.bytes, bar, pol);
}

/// The producer lanes in `ready` issue their copies (refill: after a proxy fence, which orders the
/// consumer's reads that the lane acquired before the copy): together, or with `serial` one lane at
/// a time (MegaParams::serial_issue: what compute-sanitizer racecheck can follow).
__device__ __forceinline__ void issue_lanes(bool ready, bool refill, const PieceCopy& pc, unsigned long long* bar,
                                            unsigned long long pol, bool serial, int lane) {
  if (refill && ready) fence_proxy_async();
  if (!serial) {
    if (ready) issue_piece(pc, bar, pol);
    return;
  }
  for (unsigned m = __ballot_sync(0xffffffffu, ready); m != 0; m &= m - 1) {
    if (lane == __ffs(m) - 1) issue_piece(pc, bar, pol);
    __syncwarp();
  }
}

/// A warp's consuming side of its ring.
struct Ring {
  bf16* base;
  unsigned long long* bars;   // full: the slot's bytes arrived
  unsigned long long* empty;  // the warp has read the slot (the producer may refill it)
  int slots;
  int s = 0;
  unsigned parity = 0;
};

// ------------------------------------------------------------------------------------------------
// Phases
// ------------------------------------------------------------------------------------------------

/// The block's view of the step: tags, work area, its warp's place in the grid.
struct Step {
  unsigned epoch, phases;
  int g, GW, lane, warp, tid;
  bf16* xs;     // staged GEMV input [max K] bf16
  float* xf;    // fp32 residual row [hidden] (RMSNorm input)
  unsigned char* work;
  int2* groups;               // tiles: each warp's virtual groups [x, y) of the phase
  const MegaLayer* layers;    // the layer table (a shared-memory copy when it fits)
  int pos;                    // the row's position this step
  const std::int32_t* table;  // its block-table row (a shared-memory copy when it fits)
  unsigned long long* trace;  // diagnostics (QWEN_MEGA_TRACE): [grid][phases][kMegaMarks], else nullptr
  __device__ __forceinline__ unsigned tag(int phase) const { return epoch * phases + static_cast<unsigned>(phase) + 1u; }
  /// Diagnostics: waits for ring slot `slot` (parity), counting in stamps 3 (ns waited, summed
  /// over warps) and 4 (waits that found the slot still empty) of GEMV phase `phase`.
  __device__ __forceinline__ void slot_wait(unsigned long long* bar, unsigned parity, int slot, int phase) const {
    if (!QWEN_MEGA_TRACE_BUILD || trace == nullptr || mbar_test_wait(bar, parity)) {  // test_wait: try_wait may suspend
      mbar_wait(bar, parity, slot);
      return;
    }
    const unsigned long long t0 = global_ns();
    mbar_wait(bar, parity, slot);
    if (lane == 0) {
      unsigned long long* at = trace + (std::size_t(blockIdx.x) * phases + phase) * kMegaMarks;
      atomicAdd(at + 3, global_ns() - t0);
      atomicAdd(at + 4, 1ull);
    }
  }
  /// Diagnostics: %globaltimer at a phase's entry (what 0, thread 0), when its input was staged (1,
  /// thread 0), when the block's last warp finished (2, lane 0 of every warp) and, for attention,
  /// when its last warp had written the chunk's output or partial state (3), finished its pass over
  /// the positions (4) and when the cross-warp state was in shared memory (5).
  __device__ __forceinline__ void mark(int phase, int what) const {
    if (!QWEN_MEGA_TRACE_BUILD || trace == nullptr) return;
    unsigned long long* at = trace + (std::size_t(blockIdx.x) * phases + phase) * kMegaMarks + what;
    if (what < 2 && tid == 0) *at = global_ns();
    if (what == 0 && tid == 0) at[3] = 0, at[4] = 0, at[5] = 0, at[6] = 0, at[7] = 0;  // GEMV counters
    if (what >= 2 && lane == 0) atomicMax(at, global_ns());
  }
};
__device__ __forceinline__ int phase_qkv(int l) { return 1 + 5 * l; }
__device__ __forceinline__ int phase_att(int l) { return 2 + 5 * l; }
__device__ __forceinline__ int phase_o(int l) { return 3 + 5 * l; }
__device__ __forceinline__ int phase_gu(int l) { return 4 + 5 * l; }
__device__ __forceinline__ int phase_down(int l) { return 5 + 5 * l; }
/// The phase whose residual the layer l (num_layers: lm_head) starts from.
__device__ __forceinline__ int phase_x_in(int l) { return l == 0 ? 0 : phase_down(l - 1); }

/// The norm weights w, copied (cp.async, 16 bytes per thread) into xs, where rms_stage reads each
/// thread's 8 weights just before it overwrites them with the same thread's 8 staged values. Issued
/// before the phase polls its input, so that their L2 round trip, slow under the weight streams'
/// load, overlaps the wait instead of following it.
__device__ __forceinline__ void copy_norm(const bf16* w, int K, int tid, bf16* xs) {
  for (int k = tid * 8; k < K; k += kCThreads * 8)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(xs + k)), "l"(w + k) : "memory");
}
/// xs = bf16(rmsnorm(xf) * w), w in xs (copy_norm): the arithmetic and order of the per-matrix
/// kernels' stage_x (B = 1, 8 warps: the sum of squares runs on warps 0..7), from the residual row
/// polled into shared memory.
__device__ __forceinline__ void rms_stage(const float* xf, int K, float eps, bf16* xs, float* red,
                                          const Step& st) {
  if (st.warp < kAW) {
    float ss = 0.f;
    for (int k = st.tid * 4; k < K; k += kAW * 32 * 4) {
      const float4 v = *reinterpret_cast<const float4*>(xf + k);
      ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    ss = warp_sum(ss);
    if (st.lane == 0) red[st.warp] = ss;
  }
  consumer_sync();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kAW; ++i) s += red[i];
  const float rs = rsqrtf(s / K + eps);
  asm volatile("cp.async.wait_all;" ::: "memory");  // this thread's norm weights (copy_norm) in xs
  for (int k = st.tid * 8; k < K; k += kCThreads * 8) {
    float g[8];
    unpack8(*reinterpret_cast<const uint4*>(xs + k), g);
    const float4 a = *reinterpret_cast<const float4*>(xf + k);
    const float4 c = *reinterpret_cast<const float4*>(xf + k + 4);
    uint4 o;
    o.x = pack2(a.x * rs * g[0], a.y * rs * g[1]);
    o.y = pack2(a.z * rs * g[2], a.w * rs * g[3]);
    o.z = pack2(c.x * rs * g[4], c.y * rs * g[5]);
    o.w = pack2(c.z * rs * g[6], c.w * rs * g[7]);
    *reinterpret_cast<uint4*>(xs + k) = o;
  }
}

/// c += A B on the tensor cores (m16n8k16, bf16 in, fp32 accumulate), with A's rows 8..15 zero: a01
/// and a45 are A's registers 0 and 2, b01 and b23 B's two registers.
__device__ __forceinline__ void mma_bf16(float (&c)[4], unsigned a01, unsigned a45, unsigned b01, unsigned b23) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a01), "r"(0u), "r"(a45), "r"(0u), "r"(b01), "r"(b23));
}
/// A row's dot product over a chunk of Kc weights (Kc a multiple of 256, at most 1024) on the tensor
/// cores: lane L reads the 16 bytes at L * 8 + 256 i of x and of the row (the FMA path's conflict-free
/// pattern); lanes 4g .. 4g + 3 form segment g, which is A's row g (x) and B's column g (the
/// weights), so the diagonal of C = A B holds the 8 segment sums (mma_diag). Each lane gives A and B
/// the same k positions, so every product lands on the diagonal once.
/// NR rows share x: it is loaded once, and each row has its own accumulator chain.
template <int NR>
__device__ __forceinline__ void mma_chunk(const bf16* const (&w)[NR], const bf16* x, int Kc, int lane,
                                          float (&c)[NR][4]) {
  const int q = lane * 8;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (i < (Kc >> 8)) {
      const uint4 xv = *reinterpret_cast<const uint4*>(x + q + i * 256);
      uint4 v[NR];
#pragma unroll
      for (int r = 0; r < NR; ++r) v[r] = *reinterpret_cast<const uint4*>(w[r] + q + i * 256);
#pragma unroll
      for (int r = 0; r < NR; ++r) mma_bf16(c[r], xv.x, xv.y, v[r].x, v[r].y);
#pragma unroll
      for (int r = 0; r < NR; ++r) mma_bf16(c[r], xv.z, xv.w, v[r].z, v[r].w);
    }
  }
}
/// c += one 128-weight block of a tile of 2 rows times x (MegaParams::tiles), on the tensor cores:
/// 256 weights per MMA, nothing zero. Lane L = 4 g + t holds r0 and r1, the 8 bytes at weight 4 L of
/// each row's block, and xb, x there (every shared-memory load conflict-free). Relabelling the block's
/// k = 16 g + 4 t + e as (window g, position 2 t + e % 2 + 8 (e / 2)) makes A's row m tile row m / 8
/// over window m % 8 and B's column n x over window n, so C[w][w] holds row 0's window sums and
/// C[8 + w][w] row 1's: lane 4 w + w / 2, registers w % 2 and 2 + w % 2.
__device__ __forceinline__ void mma_tile(float (&c)[4], const uint2& r0, const uint2& r1, const uint2& xb) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(r0.x), "r"(r1.x), "r"(r0.y), "r"(r1.y), "r"(xb.x), "r"(xb.y));
}
/// This lane's share of the row sum: C[g][g] if it holds it (lane (g, g / 2), register g % 2), else 0;
/// a warp_sum of it is the row's dot product.
__device__ __forceinline__ float mma_diag(const float (&c)[4], int lane) {
  return (lane & 3) == (lane >> 3) ? ((lane >> 2) & 1 ? c[1] : c[0]) : 0.f;
}

// Diagnostics (a build with -DQWEN_MEGA_PROF=1 and the trace, run with QWEN_MEGA_TRACE=1): SM cycles per warp in the
// tensor-core rows' slot waits, arithmetic (MMAs, slot release) and epilogues (warp sums, output words),
// summed over the block's warps into trace stamps 5, 6 and 7 of each GEMV phase.
#ifndef QWEN_MEGA_PROF
#define QWEN_MEGA_PROF 0
#endif
struct RowProf {
#if QWEN_MEGA_PROF
  long long t = 0, wait = 0, math = 0, epi = 0;
  __device__ __forceinline__ void start() { t = clock64(); }
  __device__ __forceinline__ void lap(long long& acc) {
    const long long now = clock64();
    acc += now - t;
    t = now;
  }
  __device__ __forceinline__ void flush(unsigned long long* at, int lane) const {
    if (lane == 0)
      atomicAdd(at + 5, static_cast<unsigned long long>(wait)),
          atomicAdd(at + 6, static_cast<unsigned long long>(math)),
          atomicAdd(at + 7, static_cast<unsigned long long>(epi));
  }
#else
  long long wait, math, epi;
  __device__ __forceinline__ void start() {}
  __device__ __forceinline__ void lap(long long&) {}
  __device__ __forceinline__ void flush(unsigned long long*, int) const {}
#endif
};

/// One GEMV phase (KIND) of layer l: stage the input (blocks that own rows; PB words in flight per
/// thread), then each warp's rows.
template <int KIND, bool MMA, int PW, bool TILES, int PB>
__device__ void gemv_phase(const MegaParams& p, int l, const Step& st, Ring& ring, float* red,
                           float& best_v, int& best_i) {
  constexpr int R = KIND == kGateUp ? 2 : 1;
  constexpr bool kNorm = KIND == kQkv || KIND == kGateUp || KIND == kLmHead;
  constexpr bool kResidual = KIND == kO || KIND == kDown;
  const int j = KIND == kLmHead ? 4 * p.num_layers : 4 * l + KIND;
  const MegaGemv m = gemv_of(p, st.layers, j);
  const int N = m.N, K = m.K;
  // The block's rows [b0, b1) (tiles: whole pairs), the warp's [r0, r1) (rows, not tiles).
  TileSplit ts{};
  int r0 = 0, r1 = 0, b0, b1;
  if constexpr (TILES) {
    ts = tile_split(m, R, blockIdx.x, gridDim.x, PW / kTileRows);
    b0 = ts.rg0 * kTileRows, b1 = b0 + ts.nrg * kTileRows;
  } else {
    r0 = row_split(st.g, N, st.GW), r1 = row_split(st.g + 1, N, st.GW);
    b0 = row_split(blockIdx.x * kMW, N, st.GW), b1 = row_split((blockIdx.x + 1) * kMW, N, st.GW);
  }
  if (b0 == b1) return;  // no rows in this block: it neither stages nor reads this phase's input

  // Tags: the input, the residual this phase adds to, the output.
  int in_phase;
  const unsigned long long* in_words = p.x;  // the norm phases' input (fp32 words)
  const unsigned* in_half = nullptr;          // O's and down's (bf16 half words)
  const bf16* norm_w = nullptr;
  if constexpr (KIND == kQkv) in_phase = phase_x_in(l), norm_w = st.layers[l].in_norm;
  else if constexpr (KIND == kO) in_phase = phase_att(l), in_half = p.attn;
  else if constexpr (KIND == kGateUp) in_phase = phase_o(l), norm_w = st.layers[l].post_norm;
  else if constexpr (KIND == kDown) in_phase = phase_gu(l), in_half = p.act;
  else in_phase = phase_x_in(p.num_layers), norm_w = p.final_norm;
  const unsigned in_tag = st.tag(in_phase);
  const unsigned res_tag = kResidual ? st.tag(KIND == kO ? phase_x_in(l) : phase_o(l)) : 0u;
  const int out_phase = KIND == kQkv ? phase_qkv(l) : KIND == kO ? phase_o(l) : KIND == kGateUp ? phase_gu(l)
                        : KIND == kDown ? phase_down(l) : 0;
  const unsigned out_tag = st.tag(out_phase);
  const int trace_phase = KIND == kLmHead ? phase_x_in(p.num_layers) + 1 : out_phase;
  st.mark(trace_phase, 0);

  // The residual of the warp's first 32 rows (tiles: of the block's first kCThreads rows, one per
  // thread), requested before the staging.
  unsigned long long xres = 0;
  if constexpr (TILES) {
    if (kResidual && st.tid < b1 - b0) xres = ld_word(p.x + b0 + st.tid);
  } else {
    if (kResidual && st.lane < r1 - r0) xres = ld_word(p.x + r0 + st.lane);
  }

  consumer_sync();  // every warp is done with the work area (previous phase)
  if constexpr (kNorm) {
    copy_norm(norm_w, K, st.tid, st.xs);
    poll_range<PB>(in_words, K, in_tag, [&](int e, float v) { st.xf[e] = v; });
    consumer_sync();
    rms_stage(st.xf, K, p.eps, st.xs, red, st);
  } else {
    poll_half_range<PB>(in_half, K, in_tag, st.xs);
  }
  consumer_sync();
  st.mark(trace_phase, 1);

  if constexpr (TILES) {
    // Each warp's items (tile_split), then one thread per row of the block adds the warps' partial sums.
    constexpr int TK = PW / kTileRows;  // weights of a row per slot
    const int S = ts.S, I = ts.I, JM = tile_part_groups(I, S), lane = st.lane;
    float* const part_all = reinterpret_cast<float*>(st.work + tile_part_offset(K));
    const int i0 = row_split(st.warp, I, kMW), i1 = row_split(st.warp + 1, I, kMW), jb = i0 / S;
    // Lane L reads the 8 bytes at weight 4 L of every 128-weight block of each row, and of x (mma_tile).
    const bf16* const rbase = ring.base + lane * 4;
    const bf16* const xl = st.xs + lane * 4;
    float* const part = part_all + st.warp * JM * kTileRows;
    int rs = ring.s;
    unsigned rpar = ring.parity;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    int gl = jb, sl = i0 - jb * S;
    // The warp's sums of its current pair's rows (lane 0): warp sums of the diagonals (mma_tile).
    auto flush = [&] {
      const bool diag = (lane & 3) == (lane >> 3), odd = (lane >> 2) & 1;
      const float v0 = warp_sum(diag ? (odd ? c[1] : c[0]) : 0.f), v1 = warp_sum(diag ? (odd ? c[3] : c[2]) : 0.f);
      if (lane == 0) part[(gl - jb) * kTileRows] = v0, part[(gl - jb) * kTileRows + 1] = v1;
    };
    RowProf prof;
    prof.start();
    for (int i = i0; i < i1; ++i) {
      st.slot_wait(ring.bars + rs, rpar, rs, trace_phase);
      prof.lap(prof.wait);
      const int k0 = sl * TK, nb = min(TK, K - k0) / kTileBlock;
      const bf16* const w = rbase + std::size_t(rs) * PW;
#pragma unroll
      for (int b = 0; b < TK / kTileBlock; ++b) {
        if (b < nb) {
          const uint2 xb = *reinterpret_cast<const uint2*>(xl + k0 + b * kTileBlock);
          const uint2 r0 = *reinterpret_cast<const uint2*>(w + b * kTileBlock);
          const uint2 r1 = *reinterpret_cast<const uint2*>(w + TK + b * kTileBlock);
          mma_tile(c, r0, r1, xb);
        }
      }
      mbar_arrive(ring.empty + rs);
      if (++rs == ring.slots) rs = 0, rpar ^= 1u;
      prof.lap(prof.math);
      if (++sl == S || i + 1 == i1) {  // the group's last item in this warp
        flush();
        c[0] = c[1] = c[2] = c[3] = 0.f;
        sl = 0, ++gl;
        prof.lap(prof.epi);
      }
    }
    ring.s = rs, ring.parity = rpar;
    // The warp's groups [jb, gl) (none: jb = gl), for the epilogue.
    if (lane == 0) st.groups[st.warp] = make_int2(jb, i0 < i1 ? gl : jb);
    consumer_sync();  // every warp's partial sums are in part_all
    // Row e % kTileRows of the block's virtual group vg: the partial sums of the warps that hold a slice of
    // it, in warp order (the same order every step).
    int2 wg[kMW];
#pragma unroll
    for (int w = 0; w < kMW; ++w) wg[w] = st.groups[w];
    auto row_sum = [&](int vg, int e) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < kMW; ++w)
        if (wg[w].x <= vg && vg < wg[w].y) v += part_all[(w * JM + vg - wg[w].x) * kTileRows + e % kTileRows];
      return v;
    };
    for (int e = st.tid; e < b1 - b0; e += kCThreads) {
      const int n = b0 + e, vg = e / kTileRows * R;  // (row_sum takes e % kTileRows)
      const float a0 = row_sum(vg, e);
      if constexpr (KIND == kQkv) {
        st_word(p.qkv + n, a0, out_tag);
      } else if constexpr (kResidual) {
        const float xo = settle(p.x + n, e < kCThreads ? xres : ld_word(p.x + n), res_tag);
        st_word(p.x + n, xo + a0, out_tag);
      } else if constexpr (KIND == kGateUp) {
        const float a1 = row_sum(vg + 1, e);
        st_hword(p.act + n, a0 / (1.f + __expf(-a0)) * a1, out_tag);
      } else {
        p.logits[n] = a0;
        if (a0 > best_v) best_v = a0, best_i = n;
      }
    }
    if (QWEN_MEGA_TRACE_BUILD && st.trace != nullptr)
      prof.flush(st.trace + (std::size_t(blockIdx.x) * st.phases + trace_phase) * kMegaMarks, lane);
    st.mark(trace_phase, 2);
    return;
  }

  const int piece_w = PW != 0 ? PW : p.piece;  // weights per slot
  const int P = (K + piece_w - 1) / piece_w;
  // Registers for the loop's state (the structs may live in local memory when this is not inlined).
  const int lane = st.lane, S = ring.slots;
  const bf16* xs = st.xs;
  bf16* const rbase = ring.base;
  unsigned long long* const bars = ring.bars;
  unsigned long long* const empty = ring.empty;
  int rs = ring.s;
  unsigned rpar = ring.parity;
  // Row n is complete (sums of the whole warp in a0, and the up row's in a1 for gate/up): its epilogue.
  auto finish = [&](int n, float a0, [[maybe_unused]] float a1) {
    [[maybe_unused]] float xo = 0.f;
    if constexpr (kResidual) {
      const int at = n - r0;
      const unsigned long long wv = __shfl_sync(0xffffffffu, xres, at & 31);
      if (lane == 0) xo = at < 32 ? settle(p.x + n, wv, res_tag) : settle(p.x + n, ld_word(p.x + n), res_tag);
    }
    if (lane == 0) {
      if constexpr (KIND == kQkv) {
        st_word(p.qkv + n, a0, out_tag);
      } else if constexpr (kResidual) {
        st_word(p.x + n, xo + a0, out_tag);
      } else if constexpr (KIND == kGateUp) {
        st_hword(p.act + n, a0 / (1.f + __expf(-a0)) * a1, out_tag);
      } else {
        p.logits[n] = a0;
        if (a0 > best_v) best_v = a0, best_i = n;
      }
    }
  };
  // A piece of a row: one slot when packed (rows of at most kChunk weights: a lone row, or a gate row
  // and its up row), else R consecutive slots (gate/up: the gate piece, then the up piece).
  const bool packed = K <= kChunk;
  const int SR = packed ? 1 : R;
  auto wait_piece = [&] {
#pragma unroll
    for (int h = 0; h < R; ++h) {
      int s = rs + h;
      unsigned parity = rpar;
      if (s >= S) s -= S, parity ^= 1u;
      if (h < SR) st.slot_wait(bars + s, parity, s, trace_phase);
    }
  };
  // Half h's weights of chunk cc of the current piece.
  auto piece_data = [&](int h, int cc) -> const bf16* {
    return packed ? rbase + std::size_t(rs) * piece_w + h * K
                  : rbase + std::size_t(rs + h < S ? rs + h : rs + h - S) * piece_w + cc * kChunk;
  };
  // Every lane releases the slots it read (an empty barrier counts the warp's 32 lanes); the producer
  // warp then refills them with the stream's next pieces.
  auto release_piece = [&] {
#pragma unroll
    for (int h = 0; h < R; ++h)
      if (h < SR) mbar_arrive(empty + (rs + h < S ? rs + h : rs + h - S));
    rs += SR;
    if (rs >= S) rs -= S, rpar ^= 1u;
  };
  int n = r0;
  RowProf prof;
  prof.start();
  if constexpr (MMA) {  // (every width a multiple of 256: mega_geometry)
    // Rows on the tensor cores (mma_chunk): a row of 1024 weights is 8 MMAs and one warp sum.
    if constexpr (R == 1) {
      if (packed) {
        for (; n + 1 < r1; n += 2) {
          wait_piece();  // both rows in one slot
          prof.lap(prof.wait);
          float c[2][4] = {};
          mma_chunk<2>({piece_data(0, 0), piece_data(1, 0)}, xs, K, lane, c);
          release_piece();
          prof.lap(prof.math);
          const float a0 = warp_sum(mma_diag(c[0], lane)), a1 = warp_sum(mma_diag(c[1], lane));
          finish(n, a0, 0.f);
          finish(n + 1, a1, 0.f);
          prof.lap(prof.epi);
        }
      }
    }
    for (; n < r1; ++n) {
      float c[R][4];
#pragma unroll
      for (int h = 0; h < R; ++h) c[h][0] = c[h][1] = c[h][2] = c[h][3] = 0.f;
      for (int piece = 0; piece < P; ++piece) {
        const int k0 = piece * piece_w;
        wait_piece();
        prof.lap(prof.wait);
        // This piece's chunks: whole chunks of a 2048-weight piece, else up to three, the last of
        // them possibly partial (a multiple of 256). Two loops: the general one alone made the 0.6B
        // step (2048-weight pieces) 2-4% slower (H200, with the slot size a run-time value).
        auto chunk = [&](int cc, int Kc) {
          const bf16* w[R];  // gate/up: the gate and up rows (the same x)
#pragma unroll
          for (int h = 0; h < R; ++h) w[h] = piece_data(h, cc);
          mma_chunk<R>(w, xs + k0 + cc * kChunk, Kc, lane, c);
        };
        if constexpr (PW == 2 * kChunk) {
          for (int cc = 0; cc < 2 && k0 + cc * kChunk < K; ++cc) chunk(cc, min(kChunk, K - k0 - cc * kChunk));
        } else {
          const int kend = min(piece_w, K - k0);
#pragma unroll 1
          for (int cc = 0; cc * kChunk < kend; ++cc) chunk(cc, min(kChunk, kend - cc * kChunk));
        }
        release_piece();
        prof.lap(prof.math);
      }
      float a[R];
#pragma unroll
      for (int h = 0; h < R; ++h) a[h] = warp_sum(mma_diag(c[h], lane));
      finish(n, a[0], a[R - 1]);
      prof.lap(prof.epi);
    }
  }
  if constexpr (R == 1 && !MMA) {
    if (K <= kChunk) {
      // One piece per row: two rows at a time (consecutive slots, two independent FMA chains, the
      // same order within each row), x unpacked once into registers for every row of the phase.
      float xr[4][8];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int k = u * 256 + lane * 8;
        if (k < K) unpack8(*reinterpret_cast<const uint4*>(xs + k), xr[u]);
        else
#pragma unroll
          for (int e = 0; e < 8; ++e) xr[u][e] = 0.f;
      }
      for (; n + 1 < r1; n += 2) {
        uint4 w[2][4];
        wait_piece();  // both rows in one slot
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const bf16* slot = piece_data(i, 0);
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int k = u * 256 + lane * 8;
            w[i][u] = k < K ? *reinterpret_cast<const uint4*>(slot + k) : make_uint4(0, 0, 0, 0);
          }
        }
        release_piece();
        float a0 = 0.f, a1 = 0.f;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          if (u * 256 + lane * 8 < K) {
            float w0[8], w1[8];
            unpack8(w[0][u], w0);
            unpack8(w[1][u], w1);
#pragma unroll
            for (int e = 0; e < 8; ++e) a0 = fmaf(w0[e], xr[u][e], a0), a1 = fmaf(w1[e], xr[u][e], a1);
          }
        }
        a0 = warp_sum(a0);
        a1 = warp_sum(a1);
        finish(n, a0, 0.f);
        finish(n + 1, a1, 0.f);
      }
    }
  }
  for (; !MMA && n < r1; ++n) {
    float acc[R];
#pragma unroll
    for (int h = 0; h < R; ++h) acc[h] = 0.f;
    for (int piece = 0; piece < P; ++piece) {
      const int k0 = piece * piece_w;
      wait_piece();
      // The per-matrix kernels' order: 1024-wide chunks, then u, then the 8 weights of a 16-byte load
      // (the gate and up rows are independent chains).
      for (int c = 0; c < piece_w / kChunk && k0 + c * kChunk < K; ++c) {
        uint4 w[R][4];
#pragma unroll
        for (int h = 0; h < R; ++h) {
          const bf16* slot = piece_data(h, c);
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int k = u * 256 + lane * 8;
            w[h][u] = k0 + c * kChunk + k < K ? *reinterpret_cast<const uint4*>(slot + k) : make_uint4(0, 0, 0, 0);
          }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int k = k0 + c * kChunk + u * 256 + lane * 8;
          if (k < K) {
            float xv[8];
            unpack8(*reinterpret_cast<const uint4*>(xs + k), xv);
#pragma unroll
            for (int h = 0; h < R; ++h) {
              float wf[8];
              unpack8(w[h][u], wf);
#pragma unroll
              for (int e = 0; e < 8; ++e) acc[h] = fmaf(wf[e], xv[e], acc[h]);
            }
          }
        }
      }
      release_piece();
    }
#pragma unroll
    for (int h = 0; h < R; ++h) acc[h] = warp_sum(acc[h]);
    finish(n, acc[0], acc[R - 1]);
  }
  ring.s = rs, ring.parity = rpar;
  if (QWEN_MEGA_TRACE_BUILD && st.trace != nullptr)
    prof.flush(st.trace + (std::size_t(blockIdx.x) * st.phases + trace_phase) * kMegaMarks, lane);
  st.mark(trace_phase, 2);
}

/// A decode context's chunks (the per-matrix attention kernel's rule: with its splits and minimum
/// chunk the chunks, their partial states and the combine are the same as its split-KV).
struct AttnChunks {
  int chunk, chunks;
};
__device__ __forceinline__ AttnChunks attn_chunks(int splits, int min_chunk, int seq_len) {
  if (splits <= 1) return {seq_len, 1};
  const int even = (seq_len + splits - 1) / splits;
  const int chunk = max(min_chunk, (even + 63) / 64 * 64);
  return {chunk, (seq_len + chunk - 1) / chunk};
}
/// Split attention's partial state of query head hq (of a group of group_size), chunk c: {max, sum,
/// unnormalised output[D]}.
template <int D>
__device__ __forceinline__ unsigned long long* attn_part(const MegaParams& p, int group_size, int hq, int c) {
  return p.attn_part + (std::size_t(hq) * mega_part_splits(p.attn_splits, group_size) + c) * (D + 2);
}

/// Attention of layer l for kv head kvh, query heads h0 .. h0 + G - 1 of its group (of group_size),
/// positions of chunk c of at most `splits`: the per-matrix attention kernel's decode path (one
/// block's chunk) on warps 0..7, reading q/k/v as tagged words. With one chunk it writes the output
/// words; otherwise the chunk's partial state, which attention_combine merges. Each head's softmax is
/// independent, so splitting a group's heads over items changes no result; the item with h0 = 0
/// whose chunk holds position pos writes the new K/V to the pool.
/// T: iterations of 4 positions per warp whose K/V a warp holds in registers; the first T are
/// loaded before the item waits for its q/k/v (positions of earlier steps). See kSingleT.
template <int D, int G, int T>
__device__ void attention_phase(const MegaParams& p, int l, int kvh, int h0, int group_size, int c, int splits,
                                const Step& st) {
  constexpr int E = D / 64;
  constexpr int DPL = D / 8;
  constexpr int NV = DPL / 8;
  const KvPool& kv = p.kv;
  const int pos = st.pos;
  const int seq_len = pos + 1;
  const AttnChunks ch = attn_chunks(splits, p.attn_min_chunk, seq_len);
  if (c >= ch.chunks) return;  // a short context needs fewer chunks
  const int begin = c * ch.chunk, end = min(seq_len, begin + ch.chunk);
  const bool owns_pos = end == seq_len;
  float* q_s = reinterpret_cast<float*>(st.work);     // [G][D]
  float* red_m = q_s + G * D;                         // [kAW][G]
  float* red_l = red_m + kAW * G;                     // [kAW][G]
  float* red_acc = red_l + kAW * G;                   // [kAW][G][D]
  bf16* k_new = reinterpret_cast<bf16*>(red_acc + kAW * G * D);  // [D]
  bf16* v_new = k_new + D;                            // [D]
  const int tid = st.tid, lane = st.lane, warp = st.warp;
  const int sub = lane & 7, grp = lane >> 3;
  bf16* kbase = kv.base + std::size_t(l) * kv.layer_stride();
  bf16* vbase = kbase + kv.kv_stride();
  auto kv_offset = [&](int blk, int t) {
    return ((std::size_t(blk) * kv.kv_heads + kvh) * kv.block_size + t % kv.block_size) * D + sub * DPL;
  };
  const std::int32_t* table = st.table;
  // The earlier positions' K/V of the first iteration: written in earlier steps.
  const bool worker = warp < kAW;  // warps 8.. only take part in the barriers
  uint4 kr[T][NV], vr[T][NV];
#pragma unroll
  for (int u = 0; u < T; ++u) {
    const int t = begin + warp * 4 + u * kAW * 4 + grp;
    if (worker && t < pos && t < end) {
      const std::size_t o = kv_offset(table[t / kv.block_size], t);
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        kr[u][i] = *reinterpret_cast<const uint4*>(kbase + o + i * 8);
        vr[u][i] = *reinterpret_cast<const uint4*>(vbase + o + i * 8);
      }
    }
  }
  st.mark(phase_att(l), 0);
  consumer_sync();  // every warp is done with the work area (previous phase or item)

  const unsigned qkv_tag = st.tag(phase_qkv(l));
  const float2* rope_row = p.rope + std::size_t(pos) * (D / 2);
  const float scale = rsqrtf(static_cast<float>(D));
  const MegaLayer& w = st.layers[l];
  for (int item = warp; item < G + (owns_pos ? 1 : 0); item += kAW) {
    const bool is_q = item < G;
    const int head_off = is_q ? (kvh * group_size + h0 + item) * D : p.q_dim + kvh * D;
    HeadNormRope<D> nr;
    nr.load(is_q ? w.q_norm : w.k_norm, rope_row, lane);
    // The head's words (and V's for the K item), all requested before any is checked.
    const unsigned long long* hw = p.qkv + head_off;
    const unsigned long long* vw = p.qkv + p.q_dim + p.kv_dim + kvh * D;
    constexpr int NW = 2 * E + D / 32;
    auto addr = [&](int i) {
      return i < E ? hw + lane * E + i : i < 2 * E ? hw + D / 2 + lane * E + (i - E) : vw + lane + 32 * (i - 2 * E);
    };
    const int count = is_q ? 2 * E : NW;
    unsigned long long raw[NW];
#pragma unroll
    for (int i = 0; i < NW; ++i)
      if (i < count) raw[i] = ld_word(addr(i));
    settle_all(raw, count, qkv_tag, addr);
    float lo[E], hi[E];
#pragma unroll
    for (int e = 0; e < E; ++e) lo[e] = word_val(raw[e]), hi[e] = word_val(raw[E + e]);
    nr.apply(p.eps, lo, hi);
    if (is_q) {
#pragma unroll
      for (int e = 0; e < E; ++e) {
        q_s[item * D + lane * E + e] = lo[e] * scale;
        q_s[item * D + D / 2 + lane * E + e] = hi[e] * scale;
      }
    } else {
      const int off = pos % kv.block_size;
      const int blk_pos = table[pos / kv.block_size];
      bf16* kp = kbase + ((std::size_t(blk_pos) * kv.kv_heads + kvh) * kv.block_size + off) * D;
      bf16* vp = vbase + ((std::size_t(blk_pos) * kv.kv_heads + kvh) * kv.block_size + off) * D;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const bf16 a = __float2bfloat16(lo[e]), b = __float2bfloat16(hi[e]);
        k_new[lane * E + e] = a, k_new[D / 2 + lane * E + e] = b;
        if (h0 == 0) kp[lane * E + e] = a, kp[D / 2 + lane * E + e] = b;
      }
#pragma unroll
      for (int i = 0; i < D / 32; ++i) {
        const bf16 x = __float2bfloat16(word_val(raw[2 * E + i]));
        v_new[lane + 32 * i] = x;
        if (h0 == 0) vp[lane + 32 * i] = x;
      }
    }
  }
  consumer_sync();
  st.mark(phase_att(l), 1);

  float q[G][DPL];
#pragma unroll
  for (int h = 0; h < G; ++h)
#pragma unroll
    for (int j = 0; j < DPL; ++j) q[h][j] = q_s[h * D + sub * DPL + j];
  SoftmaxState<G, DPL> sm;
  sm.init();
  for (int base = begin + warp * 4; worker && base < end; base += kAW * 4 * T) {
    bool valid[T];
#pragma unroll
    for (int u = 0; u < T; ++u) {
      const int t = base + u * kAW * 4 + grp;
      valid[u] = t < end;
      if (valid[u] && t == pos) {
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          kr[u][i] = *reinterpret_cast<const uint4*>(k_new + sub * DPL + i * 8);
          vr[u][i] = *reinterpret_cast<const uint4*>(v_new + sub * DPL + i * 8);
        }
      } else if (valid[u] && base != begin + warp * 4) {
        const std::size_t o = kv_offset(table[t / kv.block_size], t);
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          kr[u][i] = *reinterpret_cast<const uint4*>(kbase + o + i * 8);
          vr[u][i] = *reinterpret_cast<const uint4*>(vbase + o + i * 8);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < T; ++u) sm.add(q, kr[u], vr[u], valid[u]);
  }
  st.mark(phase_att(l), 4);
  sm.combine_groups();
  if (worker) store_warp_state<G, DPL>(sm.m, sm.l, sm.acc, warp, grp, sub, red_m, red_l, red_acc, D);
  consumer_sync();
  st.mark(phase_att(l), 5);
  const unsigned out_tag = st.tag(phase_att(l));
  for (int idx = tid; idx < G * D; idx += kCThreads) {
    const int h = idx / D, d = idx % D;
    const auto [mx, Ls, A] = merge_warp_states<kAW>(red_m, red_l, red_acc, G, D, h, d);
    const int hq = kvh * group_size + h0 + h;
    if (ch.chunks == 1) {
      st_hword(p.attn + hq * D + d, A / Ls, out_tag);
    } else {
      unsigned long long* part = attn_part<D>(p, group_size, hq, c);
      st_word(part + 2 + d, A, out_tag);
      if (d == 0) st_word(part, mx, out_tag), st_word(part + 1, Ls, out_tag);
    }
  }
  st.mark(phase_att(l), 3);
  st.mark(phase_att(l), 2);
}

/// Split attention's second half for the item of attention_phase (several chunks only): chunk c's
/// block merges every chunk's partial state for its share of the item's G * D outputs (in chunk
/// order, the per-matrix kernel's combine) and writes those output words.
template <int D, int G>
__device__ void attention_combine(const MegaParams& p, int l, int kvh, int h0, int group_size, int c, int splits,
                                  const Step& st) {
  const AttnChunks ch = attn_chunks(splits, p.attn_min_chunk, st.pos + 1);
  const int C = ch.chunks;
  if (C == 1 || c >= C) return;
  const int o0 = row_split(c, G * D, C), no = row_split(c + 1, G * D, C) - o0;
  float* ml = reinterpret_cast<float*>(st.work);  // [C][G][2]: max, sum
  float* part_a = ml + C * G * 2;                 // [C][no]: unnormalised outputs
  const int hq0 = kvh * group_size + h0, nml = C * G * 2;
  const unsigned tag = st.tag(phase_att(l));
  consumer_sync();  // every warp is done with the work area (this block's attention items)
  poll_words(
      nml + C * no, tag,
      [&](int i) -> const unsigned long long* {
        if (i < nml) return attn_part<D>(p, group_size, hq0 + i % (2 * G) / 2, i / (2 * G)) + (i & 1);
        const int k = i - nml, o = o0 + k % no;
        return attn_part<D>(p, group_size, hq0 + o / D, k / no) + 2 + o % D;
      },
      [&](int i, float v) {
        if (i < nml) ml[i] = v;
        else part_a[i - nml] = v;
      });
  consumer_sync();
  for (int k = st.tid; k < no; k += kCThreads) {
    const int h = (o0 + k) / D, d = (o0 + k) % D;
    float mx = -INFINITY;
    for (int cc = 0; cc < C; ++cc) mx = fmaxf(mx, ml[(cc * G + h) * 2]);
    float L = 0.f, A = 0.f;
    for (int cc = 0; cc < C; ++cc) {
      const float f = __expf(ml[(cc * G + h) * 2] - mx);
      L += ml[(cc * G + h) * 2 + 1] * f;
      A += part_a[cc * no + k] * f;
    }
    st_hword(p.attn + (hq0 + h) * D + d, A / L, tag);
  }
  st.mark(phase_att(l), 2);
}

/// Attention items: of one query head by default (MegaParams::attn_heads). An item's block then
/// stages one query head, and each position costs its warps one head's dot product and softmax
/// update; the kv head's K/V are read by each of its items (from L2). One head against two (H100,
/// graph TPOT, two rounds): 0.6B -4.5%, 4B -1.7%. Where the chunks of one-head items are capped by
/// attn_splits (a long context), items of two heads get twice as many chunks on the same blocks:
/// after a 2000-token prompt one-head items alone were 5% slower (H200; docs/perf-notes.md).
/// attention_phase's T for each kind. A kernel with one-head items only was 1.5% faster on 0.6B with
/// T = 3 (4 measured the same as 3), but the kernel's registers cover both kinds, and with T = 3 on
/// either the whole step got slower (GEMV phases included): T = 2 for both.
constexpr int kSingleT = 2;
constexpr int kPairT = 2;
/// Query heads of a two-head item (1 where a kv head has one query head: no pairs).
constexpr int pair_heads(int G) { return G < 2 ? 1 : 2; }
/// Whether this step's attention runs items of two query heads (see MegaParams::attn_heads).
__device__ __forceinline__ bool attention_pairs(const MegaParams& p, int group, int seq_len) {
  if (group < 2 || p.attn_heads == 1) return false;
  if (p.attn_heads == 2) return true;
  return attn_chunks(mega_pair_splits(p.attn_splits), p.attn_min_chunk, seq_len).chunks >
         attn_chunks(p.attn_splits, p.attn_min_chunk, seq_len).chunks;
}

template <int D, int GA>
constexpr std::size_t attention_scratch_of() {
  return sizeof(float) * (GA * D + 2 * kAW * GA + kAW * GA * D) + 2 * D * sizeof(bf16);
}
template <int D, int G>
std::size_t attention_scratch() {
  return std::max(attention_scratch_of<D, 1>(), attention_scratch_of<D, pair_heads(G)>());
}

/// The producer warp: lane w < kMW keeps consumer warp w's ring full, the stream's first `slots`
/// pieces at once, then each next piece as soon as the warp releases the slot it goes into. The
/// lanes poll their "empty" barriers together (non-blocking), so one lane's wait never holds another.
/// TILES: the stream of tiles (TileCursor), else of rows (Cursor).
template <int PW, bool TILES, bool PACED>
__device__ void produce(const MegaParams& p, const MegaLayer* layers, unsigned char* smem,
                        unsigned long long (*full)[kMaxRingSlots], unsigned long long (*empty)[kMaxRingSlots], int S,
                        int lane) {
  const int GW = gridDim.x * kMW, g = blockIdx.x * kMW + lane, end = 4 * p.num_layers;
  const int piece = PW != 0 ? PW : p.piece;
  const unsigned long long pol = evict_first_policy();
  const bool serial = p.serial_issue != 0;
  bool active = lane < kMW;
  Cursor c{};
  TileCursor tc{};
  bf16* base = nullptr;
  if (active) {
    base = reinterpret_cast<bf16*>(smem) + std::size_t(lane) * S * piece;
    if constexpr (TILES) tc.j = 0, tc.tk = piece / kTileRows, tile_seek(tc, p, layers, blockIdx.x, lane);
    else c.j = 0, cursor_seek(c, p, layers, g, GW, piece);
  }
  auto next = [&](int s) {
    if constexpr (TILES) return tile_piece(tc, p, layers, blockIdx.x, lane, base, s);
    else return cursor_piece(c, p, layers, g, GW, piece, base, s);
  };
  auto more = [&] { return TILES ? tc.j <= end : c.j <= end; };
  for (int s = 0; s < S; ++s) {
    const PieceCopy pc = active ? next(s) : PieceCopy{};
    issue_lanes(active, false, pc, active ? full[lane] + s : nullptr, pol, serial, lane);
  }
  active = active && more();
  int s = 0;
  unsigned parity = 0;
  while (__any_sync(0xffffffffu, active)) {
    // The consumer lanes' reads of the slot (generic proxy) are ordered before the bulk copy that
    // overwrites it (async proxy): the barrier's release/acquire, then a proxy fence.
    const bool ready = active && mbar_test_wait(empty[lane] + s, parity);
    const PieceCopy pc = ready ? next(s) : PieceCopy{};
    issue_lanes(ready, true, pc, ready ? full[lane] + s : nullptr, pol, serial, lane);
    if (ready) {
      if (++s == S) s = 0, parity ^= 1u;
      active = more();
    }
    if (!__any_sync(0xffffffffu, ready)) __nanosleep(32);
    else if constexpr (PACED) __nanosleep(static_cast<unsigned>(p.pace_ns));  // (MegaParams::pace_ns)
  }
}

/// PW: weights per ring slot, or 0 for MegaParams::piece (a run-time value cost the 0.6B step 1.5%).
/// TILES: GEMV rows as tiles (MegaParams::tiles; MMA, and PW 2048 or 2560).
/// PACED: the producer pauses after its rounds that issued (MegaParams::pace_ns; tiles only): a variant
/// of its own, because the branch alone cost the H200's 4B step 2.5% where the pause is off.
/// PB: activation words in flight per thread while staging (kPollBatch, or kPollBatchWide: pick).
template <int D, int G, bool MMA, int PW, bool TILES, bool PACED, int PB = kPollBatch>
__global__ void __launch_bounds__(kMThreads, 1) mega_kernel(const MegaParams p) {
  static_assert(!TILES || (MMA && (PW == 2048 || PW == 2560 || PW == 5120)), "tiles: slots of 4, 5 or 10 KiB");
  constexpr int GP = pair_heads(G);
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ unsigned long long bars[kMW][kMaxRingSlots];   // full
  __shared__ unsigned long long empty[kMW][kMaxRingSlots];  // released by the consumer warp
  __shared__ float red[kMW];
  __shared__ unsigned long long red_key[kMW];
  static_assert(sizeof(MegaLayer) % 8 == 0, "the layer table is copied in 8-byte words");
  __shared__ MegaLayer layers_s[kSmemLayers];
  __shared__ std::int32_t table_s[kSmemTable];
  __shared__ int4 item_s;  // this block's attention item (see below)
  __shared__ int2 groups_s[kMW];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int S = p.slots;
  const int pos = p.meta.pos[0];
  const std::int32_t* table = p.meta.block_table + std::size_t(p.meta.slot[0]) * p.meta.table_width;
  const int table_len = pos / p.kv.block_size + 1;
  if (table_len <= kSmemTable)
    for (int i = tid; i < table_len; i += kMThreads) table_s[i] = table[i];
  if (p.num_layers <= kSmemLayers)
    for (int i = tid; i < p.num_layers * static_cast<int>(sizeof(MegaLayer) / 8); i += kMThreads)
      reinterpret_cast<unsigned long long*>(layers_s)[i] = reinterpret_cast<const unsigned long long*>(p.layers)[i];
  if (tid == 0) {
    for (int w = 0; w < kMW; ++w)
      for (int s = 0; s < S; ++s) mbar_init(&bars[w][s], 1), mbar_init(&empty[w][s], 32);
    mbar_fence_init();
  }
  __syncthreads();

  Step st;
  st.layers = p.num_layers <= kSmemLayers ? layers_s : p.layers;
  st.pos = pos;
  st.table = table_len <= kSmemTable ? table_s : table;
  st.tid = tid, st.lane = lane, st.warp = warp;
  st.g = blockIdx.x * kMW + warp;
  st.GW = gridDim.x * kMW;
  st.epoch = __ldcg(p.sync);  // written by the previous step's last block (kernel boundary)
  st.phases = 5u * static_cast<unsigned>(p.num_layers) + 2u;
  st.trace = p.trace;
  const int piece = PW != 0 ? PW : p.piece;
  if (QWEN_MEGA_TRACE_BUILD && st.trace != nullptr && tid == 0) {  // the block's SM (phase 0's marks are free)
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    st.trace[std::size_t(blockIdx.x) * st.phases * kMegaMarks] = sm + 1ull;
  }
  st.work = smem + std::size_t(kMW) * S * piece * sizeof(bf16);
  st.xs = reinterpret_cast<bf16*>(st.work);
  // xf (the residual row) is only used by the phases with an RMSNorm, whose x has `hidden` values: it
  // starts after those, over the part of xs that only the wider inputs (attention output, SiLU
  // product) use.
  st.xf = reinterpret_cast<float*>(st.work + (std::size_t(p.hidden) * sizeof(bf16) + 15) / 16 * 16);
  st.groups = groups_s;

  if (warp == kMW) {  // the producer warp: the weight streams (weights never depend on activations)
    produce<PW, TILES, PACED>(p, st.layers, smem, bars, empty, S, lane);
  } else {
  Ring ring{reinterpret_cast<bf16*>(smem) + std::size_t(warp) * S * piece, bars[warp], empty[warp], S};

  // Embedding of the row's token: this block's slice of x.
  {
    int tok = p.meta.token[0];
    tok = tok < 0 ? 0 : (tok >= p.vocab ? p.vocab - 1 : tok);  // validated on the host; stay in bounds
    const int e0 = row_split(blockIdx.x, p.hidden, gridDim.x), e1 = row_split(blockIdx.x + 1, p.hidden, gridDim.x);
    const unsigned tag = st.tag(0);
    for (int e = e0 + tid; e < e1; e += kCThreads)
      st_word(p.x + e, __bfloat162float(p.embed[std::size_t(tok) * p.hidden + e]), tag);
  }

  float best_v = -INFINITY;
  int best_i = 0x7fffffff;
  // Attention items (head group gi of GA query heads, chunk c), it = gi * splits + c, at most one
  // per block (mega_geometry): item it runs on block it * grid / items, so a group's chunks sit on
  // neighbouring blocks and the groups spread over the grid. A block writes its item's partial
  // state before it waits for the other chunks' states. GA (1, or GP for a long context: see
  // MegaParams::attn_heads) is the step's choice; every block makes the same one.
  // The item is kept in shared memory ({kv head, first query head, chunk, GA}; kv head -1: none),
  // read where it is used: three more registers live across the layer loop made ptxas spill.
  {
    const bool pairs = attention_pairs(p, G, pos + 1);
    const int GA = pairs ? GP : 1, splits = pairs ? mega_pair_splits(p.attn_splits) : p.attn_splits;
    const int items = p.kv.kv_heads * (G / GA) * splits;
    const int it = row_split(blockIdx.x, items, gridDim.x);
    const int gi = it / splits;
    if (tid == 0)
      item_s = it < row_split(blockIdx.x + 1, items, gridDim.x) ? make_int4(gi / (G / GA), gi % (G / GA) * GA, it % splits, GA)
                                                                 : make_int4(-1, 0, 0, 0);
    consumer_sync();
  }
  for (int l = 0; l < p.num_layers; ++l) {
    gemv_phase<kQkv, MMA, PW, TILES, PB>(p, l, st, ring, red, best_v, best_i);
    if (const int4 item = item_s; item.x >= 0) {
      bool done = false;
      if constexpr (GP > 1) {
        if (item.w == GP) {
          const int splits = mega_pair_splits(p.attn_splits);
          attention_phase<D, GP, kPairT>(p, l, item.x, item.y, G, item.z, splits, st);
          attention_combine<D, GP>(p, l, item.x, item.y, G, item.z, splits, st);
          done = true;
        }
      }
      if (!done) {
        attention_phase<D, 1, kSingleT>(p, l, item.x, item.y, G, item.z, p.attn_splits, st);
        attention_combine<D, 1>(p, l, item.x, item.y, G, item.z, p.attn_splits, st);
      }
    }
    gemv_phase<kO, MMA, PW, TILES, PB>(p, l, st, ring, red, best_v, best_i);
    gemv_phase<kGateUp, MMA, PW, TILES, PB>(p, l, st, ring, red, best_v, best_i);
    gemv_phase<kDown, MMA, PW, TILES, PB>(p, l, st, ring, red, best_v, best_i);
  }
  gemv_phase<kLmHead, MMA, PW, TILES, PB>(p, 0, st, ring, red, best_v, best_i);

  // Argmax: the block's best key (each thread's, then each warp's), then the last block out reduces
  // them and ends the epoch.
  unsigned long long key = best_i == 0x7fffffff ? 0ull : argmax_key(best_v, best_i);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, o);
    key = other > key ? other : key;
  }
  if (lane == 0) red_key[warp] = key;
  }
  __syncthreads();
  if (tid == 0) {
    unsigned long long k = 0;
#pragma unroll
    for (int i = 0; i < kMW; ++i) k = red_key[i] > k ? red_key[i] : k;
    p.block_best[blockIdx.x] = k;
    __threadfence();  // nothing is in flight any more: cheap
    if (atomicAdd(p.sync + 1, 1u) == gridDim.x - 1) {
      __threadfence();
      unsigned long long best = 0;
      for (unsigned b = 0; b < gridDim.x; ++b) {
        const unsigned long long o = __ldcg(p.block_best + b);
        best = o > best ? o : best;
      }
      *p.keys = best;
      p.sync[1] = 0;
      p.sync[0] = st.epoch + 1u;
    }
  }
}

using kernel_ptr = void (*)(const MegaParams);

/// The variant of mega_kernel<D, G, MMA, PW, TILES, PACED> for (head_dim, query heads per kv head).
template <bool MMA, int PW, bool TILES, bool PACED = false>
kernel_ptr by_shape(int D, int G) {
  if (D == 64 && G == 1) return mega_kernel<64, 1, MMA, PW, TILES, PACED>;
  if (D == 64 && G == 2) return mega_kernel<64, 2, MMA, PW, TILES, PACED>;
  if (D == 128 && G == 1) return mega_kernel<128, 1, MMA, PW, TILES, PACED>;
  if (D == 128 && G == 2) return mega_kernel<128, 2, MMA, PW, TILES, PACED>;
  if (D == 128 && G == 4) return mega_kernel<128, 4, MMA, PW, TILES, PACED>;
  return nullptr;
}
/// Whether pick() takes a variant that stages with kPollBatchWide words in flight per thread: tiles of
/// 4 or 5 KiB slots, head_dim 128 and groups of 4 (Qwen3-4B and -8B), `wide` (wide_input).
bool poll_wide(int D, int G, int piece, bool tiles, bool wide) {
  return tiles && wide && D == 128 && G == 4 && (piece == 2 * kChunk || piece == 2560);
}
template <int PW>
kernel_ptr tiles_by_shape(int D, int G, bool paced, bool wide) {
  if constexpr (PW != 5120)
    if (poll_wide(D, G, PW, true, wide))
      return paced ? mega_kernel<128, 4, true, PW, true, true, kPollBatchWide>
                   : mega_kernel<128, 4, true, PW, true, false, kPollBatchWide>;
  return paced ? by_shape<true, PW, true, true>(D, G) : by_shape<true, PW, true, false>(D, G);
}
/// The residual row (hidden fp32 words) takes more than one polling round at kPollBatch words per thread.
bool wide_input(const MegaParams& p) { return p.hidden > kCThreads * kPollBatch; }
/// The kernel for (head_dim, query heads per kv head, tensor-core rows, weights per slot, tiles):
/// slots of 2048 weights are a compile-time constant; other sizes (tensor-core rows only) a run-time
/// value; tiles take 2048, 2560 or 5120 (a variant each, paced or not: MegaParams::pace_ns; wide or not:
/// tiles_by_shape).
kernel_ptr pick(int D, int G, bool mma, int piece, bool tiles, bool paced = false, bool wide = false) {
  constexpr int P = 2 * kChunk;
  if (tiles) {
    if (!mma) return nullptr;
    if (piece == P) return tiles_by_shape<P>(D, G, paced, wide);
    if (piece == 2560) return tiles_by_shape<2560>(D, G, paced, wide);
    if (piece == 5120) return tiles_by_shape<5120>(D, G, paced, wide);
    return nullptr;
  }
  if (piece != P) return mma ? by_shape<true, 0, false>(D, G) : nullptr;
  return mma ? by_shape<true, P, false>(D, G) : by_shape<false, P, false>(D, G);
}
std::size_t scratch(int D, int G) {
  if (D == 64 && G == 1) return attention_scratch<64, 1>();
  if (D == 64 && G == 2) return attention_scratch<64, 2>();
  if (D == 128 && G == 1) return attention_scratch<128, 1>();
  if (D == 128 && G == 2) return attention_scratch<128, 2>();
  return attention_scratch<128, 4>();
}

}  // namespace

bool mega_supported(int head_dim, int group) { return pick(head_dim, group, false, 2 * kChunk, false) != nullptr; }

int mega_attention_splits(int kv_heads, int group, int grid) {
  return std::clamp(grid / std::max(kv_heads * group, 1), 1, kMaxAttnSplits);
}

namespace {
/// Slot weights a step's rows take with `piece` weights per slot (a row starts a new slot; rows of at
/// most kChunk weights go two to a slot).
double slot_weights(const MegaParams& p, int piece) {
  double layer = 0.0, head = 0.0;
  auto add = [&](double& b, double rows, int K, int halves) {
    b += K <= kChunk ? (halves == 2 ? rows : rows / 2) * piece
                     : rows * halves * ((K + piece - 1) / piece) * double(piece);
  };
  add(layer, p.q_dim + 2.0 * p.kv_dim, p.hidden, 1);
  add(layer, p.hidden, p.q_dim, 1);
  add(layer, p.intermediate, p.hidden, 2);
  add(layer, p.hidden, p.intermediate, 1);
  add(head, p.vocab, p.hidden, 1);
  return layer * p.num_layers + head;
}
/// Slot weights a step's tiles take with tk weights per row and slot (a row's last slice may fill its
/// slot partly).
double tile_slot_weights(const MegaParams& p, int tk) {
  auto rows = [tk](double n, int K) { return n * ((K + tk - 1) / tk) * double(tk); };
  const double layer = rows(p.q_dim + 2.0 * p.kv_dim, p.hidden) + rows(p.hidden, p.q_dim) +
                       rows(2.0 * p.intermediate, p.hidden) + rows(p.hidden, p.intermediate);
  return layer * p.num_layers + rows(p.vocab, p.hidden);
}

}  // namespace

bool mega_trace_built() { return QWEN_MEGA_TRACE_BUILD != 0; }

bool mega_tiles_fit(const MegaParams& p) {
  for (int n : {p.hidden, p.q_dim + 2 * p.kv_dim, p.intermediate, p.vocab})
    if (n % kTileRows != 0) return false;
  for (int k : {p.hidden, p.q_dim, p.intermediate})
    if (k % kTileBlock != 0) return false;
  return true;
}

MegaGeometry mega_geometry(const MegaParams& p, int head_dim, int group, int max_slots, int num_sms) {
  const bool tiles = p.tiles != 0;
  const kernel_ptr k0 = pick(head_dim, group, p.mma != 0, 2 * kChunk, tiles);
  if (k0 == nullptr)
    throw replay::usage_error("qwen::mega_geometry: shape not supported by the persistent kernel");
  if (tiles && !mega_tiles_fit(p))
    throw replay::usage_error(fmt::format("qwen::mega_geometry: tiles need row counts that are multiples of {} and "
                                          "widths that are multiples of {}",
                                          kTileRows, kTileBlock));
  if (p.mma != 0 && (p.hidden % 256 != 0 || p.q_dim % 256 != 0 || p.intermediate % 256 != 0))
    throw replay::usage_error("qwen::mega_geometry: tensor-core rows need matrix widths that are multiples of 256");
  if (p.hidden % 8 != 0 || p.q_dim % 8 != 0 || p.intermediate % 8 != 0)
    throw replay::usage_error("qwen::mega_geometry: matrix widths must be multiples of 8");
  if (p.attn_splits < 1 || p.attn_splits > kMaxAttnSplits ||
      (mega_part_splits(p.attn_splits, group) > 1 && p.attn_part == nullptr))
    throw replay::usage_error("qwen::mega_geometry: attention splits must be in 1..kMaxAttnSplits, with partial states");
  if (p.attn_heads < 0 || p.attn_heads > 2)
    throw replay::usage_error("qwen::mega_geometry: query heads per attention item must be 0 (auto), 1 or 2");
  const bool singles = group < 2 || p.attn_heads != 2, pairs = group >= 2 && p.attn_heads != 1;
  if ((singles && p.kv.kv_heads * group * p.attn_splits > num_sms) ||
      (pairs && p.kv.kv_heads * (group / 2) * mega_pair_splits(p.attn_splits) > num_sms))
    throw replay::usage_error(fmt::format("qwen::mega_geometry: {} attention splits give more items than the {} blocks",
                                          p.attn_splits, num_sms));
  if (p.attn_min_chunk < 64 || p.attn_min_chunk % 64 != 0)
    throw replay::usage_error("qwen::mega_geometry: attention's minimum chunk must be a positive multiple of 64");
  if (p.pace_ns < 0 || p.pace_ns > 1000000 || (p.pace_ns > 0 && !tiles))
    throw replay::usage_error("qwen::mega_geometry: the producer's pause needs tiles and must be 0..1000000 ns");
  int dev = 0, optin = 0, coop = 0;
  REPLAY_CHECK(cudaGetDevice(&dev));
  REPLAY_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  REPLAY_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
  if (coop == 0) throw replay::usage_error("qwen::mega_geometry: the device has no cooperative launch");
  cudaFuncAttributes fa{};
  REPLAY_CHECK(cudaFuncGetAttributes(&fa, k0));  // (every variant has the same static shared memory)
  // Tiles: each GEMV's partial sums after its staged x (tile_part_offset), for the most items a block
  // gets, over the tile slot sizes (the size is chosen below).
  std::size_t part_end = 0;
  if (tiles) {
    for (int piece : kTilePieces) {
      const int tk = piece / kTileRows;
      auto end = [&](int N, int K, int halves) {
        const int S = (K + tk - 1) / tk, I = (N / kTileRows + num_sms - 1) / num_sms * halves * S;
        return tile_part_offset(K) + std::size_t(kMW) * tile_part_groups(I, S) * kTileRows * sizeof(float);
      };
      part_end = std::max({part_end, end(p.q_dim + 2 * p.kv_dim, p.hidden, 1), end(p.hidden, p.q_dim, 1),
                           end(p.intermediate, p.hidden, 2), end(p.hidden, p.intermediate, 1), end(p.vocab, p.hidden, 1)});
    }
  }
  const std::size_t work =
      (std::max({stage_bytes(p.hidden, p.q_dim, p.intermediate), part_end, scratch(head_dim, group)}) + 127) / 128 * 128;
  const long long avail = static_cast<long long>(optin) - static_cast<long long>(fa.sharedSizeBytes) -
                          static_cast<long long>(work) - 1024;
  // Weights per slot: p.piece, or (0) the candidate that keeps the most weights in flight per warp:
  // slots that fit, times their size, times the share of slot space the step's rows fill (H200, 4B:
  // 5 slots of 2560 weights, 2.58 ms against 2.64 with 6 of 2048). Only the tensor-core rows take
  // other sizes than 2048 (the FMA rows keep the per-matrix kernels' order, and one variant each).
  auto slots_of = [&](int piece) {
    return std::min<long long>(
        {avail / (kMW * piece * static_cast<long long>(sizeof(bf16))), max_slots, kMaxRingSlots});
  };
  // Tiles likewise between 2048 and 2560 weights per slot (rows of 1024 or 1280 weights per slot).
  int piece = p.piece;
  if (piece == 0 && tiles) {
    const double useful = slot_weights(p, 1);
    double best = -1.0;
    for (int c : {2 * kChunk, 5 * kChunk / 2}) {
      const double score = static_cast<double>(slots_of(c)) * c * useful / tile_slot_weights(p, c / kTileRows);
      if (score > best * 1.0001) best = score, piece = c;
    }
  } else if (piece == 0) {
    const double useful = slot_weights(p, 1);  // every row in slots of one weight: no waste
    double best = -1.0;
    for (int c : {2 * kChunk, 5 * kChunk / 2, 3 * kChunk}) {
      if (pick(head_dim, group, p.mma != 0, c, false) == nullptr) continue;
      const double score = static_cast<double>(slots_of(c)) * c * useful / slot_weights(p, c);
      if (score > best * 1.0001) best = score, piece = c;
    }
  }
  if (piece < 2 * kChunk || (piece > kMaxPiece && !tiles) || piece % 256 != 0 ||
      pick(head_dim, group, p.mma != 0, piece, tiles) == nullptr)
    throw replay::usage_error(
        fmt::format("qwen::mega_geometry: {} weights per ring slot; it needs 2048, or with tensor-core rows "
                    "a multiple of 256 in [2048, {}] (tiles: 2048, 2560 or 5120)",
                    piece, kMaxPiece));
  const kernel_ptr k = pick(head_dim, group, p.mma != 0, piece, tiles, p.pace_ns > 0, wide_input(p));
  const long long slots = slots_of(piece);
  if (slots < 2)
    throw replay::usage_error(fmt::format("qwen::mega_geometry: {} B of staging leave no room for 2 ring slots per warp",
                                          work));
  MegaGeometry g;
  g.slots = static_cast<int>(slots);
  g.piece = piece;
  g.slot_bytes = piece * static_cast<int>(sizeof(bf16));
  g.poll_batch = poll_wide(head_dim, group, piece, tiles, wide_input(p)) ? kPollBatchWide : kPollBatch;
  g.smem = std::size_t(kMW) * g.slots * piece * sizeof(bf16) + work;
  REPLAY_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(g.smem)));
  int per_sm = 0;
  REPLAY_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, kMThreads, g.smem));
  if (per_sm < 1)
    throw replay::usage_error(fmt::format("qwen::mega_geometry: a block ({} registers per thread, {} B shared) does "
                                          "not fit on a multiprocessor",
                                          fa.numRegs, g.smem + fa.sharedSizeBytes));
  g.grid = num_sms;
  return g;
}

MegaTuning mega_device_tuning(int device, int hidden) {
  int clock_khz = 0, bus_bits = 0;
  REPLAY_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device));
  REPLAY_CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device));
  const double peak = 2.0 * clock_khz * 1e3 * bus_bits / 8.0;  // bytes/s (two transfers per clock)
  MegaTuning t;
  if (peak > 0.0 && peak < 4e12) t.pace_ns = 100, t.tile_piece = 2 * kChunk;
  else if (hidden >= 2048) t.pace_ns = 75;
  return t;
}

void launch_mega(const MegaParams& p, int head_dim, int group, const MegaGeometry& g, replay::stream_ref s) {
  const kernel_ptr k = pick(head_dim, group, p.mma != 0, p.piece, p.tiles != 0, p.pace_ns > 0, wide_input(p));
  if (k == nullptr) throw replay::usage_error("qwen::launch_mega: shape not supported by the persistent kernel");
  if (p.slots != g.slots || p.piece != g.piece)
    throw replay::usage_error("qwen::launch_mega: parameters and geometry disagree");
  if (p.pace_ns < 0 || p.pace_ns > 1000000 || (p.pace_ns > 0 && p.tiles == 0))
    throw replay::usage_error("qwen::launch_mega: the producer's pause needs tiles and must be 0..1000000 ns");
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(g.grid);
  cfg.blockDim = dim3(kMThreads);
  cfg.dynamicSmemBytes = g.smem;
  cfg.stream = s.get();
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;  // every block resident: blocks wait for each other's words
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  REPLAY_CHECK(cudaLaunchKernelEx(&cfg, k, p), "launching qwen::mega_kernel (grid {}, {} B shared)", g.grid, g.smem);
}

}  // namespace qwen
