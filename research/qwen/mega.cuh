// research/qwen/mega.cuh: the persistent decode kernel (`--kernels mega`, bucket 1).
//
// The whole decode step of one row is one launch: one block per SM, all blocks resident (a
// cooperative launch), walking the step's phases in order (embed; per layer QKV, attention, O +
// residual, gate/up + SiLU, down + residual; lm_head + argmax). Two things make it different from
// the streaming kernel (stream.cuh):
//
// * Weights stream per warp. Each GEMV phase's rows are split evenly over the grid's consumer warps;
//   a warp's rows of every phase, in phase order, form one stream of 4-6 KiB pieces that the block's
//   producer warp copies into the warp's ring of shared-memory slots (cp.async.bulk, one mbarrier per
//   slot) as soon as the warp frees a slot. Weights never depend on activations, so the rings run
//   ahead across phase and layer boundaries: while a phase waits for the previous one, the next
//   phases' weights keep arriving.
// * Phases hand activations over without fences. A gpu-scope fence (and so every release) waits for
//   all the bulk copies its block has in flight (H200: 4.4 us with 192 KiB in flight; 0.3 us with
//   none), which is what made the streaming kernel's phase transitions cost 4-5 us. Here every
//   activation element travels as one 64-bit word {value, tag} written by one store (the
//   low-latency protocol of NCCL): a consumer polls the words it needs until their tags say "this
//   step, this phase". A single 64-bit access is single-copy atomic, so a word with the right tag
//   carries the right value, and no ordering between different words is needed. Activations that
//   are bf16 values (attention's output, silu(gate) * up) travel as 32-bit words {bf16, 16-bit tag}
//   instead, read two per load: half the bytes and polling rounds.
//
// Tags: epoch * phases + phase + 1, the epoch read at kernel start from a device counter that the
// last block to exit increments, so a replayed graph never sees its previous step's words as ready.
// Each buffer is written once per phase that produces it, and every reader of one version has read
// it before the next version can be written (each write depends, through the phase chain, on all
// reads of the previous version), so one buffer per activation suffices.
//
// GEMV rows run on the tensor cores by default, in tiles (MegaParams::tiles): a block owns whole
// pairs of rows, a ring slot holds 2 rows x 1024 (or 1280) weights, each MMA takes 2 rows x 128
// weights (mega.cu, mma_tile), and the block adds its warps' partial sums per row in warp order.
// Without tiles (MegaParams::mma alone) a warp takes rows one at a time: each 1024-wide chunk of a
// row is 8 m16n8k16 MMAs whose diagonal holds the row's 8 segment sums (mma_chunk); rows of at most
// 1024 weights are packed two to a slot. With mma = 0 the rows use the per-matrix kernels'
// arithmetic (x rounded to bf16, the same per-lane FMA order as the pipelined and ring GEMVs), and
// with the same attention code path and split the logits are bit-identical to the `ring` kernels'.
//
// Attention is split over blocks: an item is (kv head, one of its query heads, chunk of the
// context), with chunks of at least attn_min_chunk positions and at most attn_splits of them (by
// default 128 positions, the per-matrix kernel's minimum, and as many chunks as there are blocks
// per query head). Each chunk's block writes its partial softmax state as tagged words, then merges
// its share of the outputs from every chunk's state. The merge is a second handoff (~3 us on an
// H200), worth it only past two passes of 64 positions (docs/perf-notes.md). With the
// per-matrix kernel's splits and minimum chunk the chunks and the merge are its split-KV's.
//
// Example (what model.cu does for bucket 1):
//   MegaParams p = ...;                                   // weights, metadata, tagged buffers, counters
//   const MegaGeometry g = mega_geometry(p, head_dim, group, 16, num_sms);  // p.piece = 0: it picks
//   p.slots = g.slots, p.piece = g.piece;
//   launch_mega(p, head_dim, group, g, stream);          // one step; capturable in a graph
#pragma once

#include "kernels.cuh"

#include <cstddef>
#include <cstdint>

namespace qwen {

/// Stamps per block and phase of the persistent kernel's trace (MegaParams::trace).
inline constexpr int kMegaMarks = 8;
/// Consumer warps per block of the persistent kernel (plus one producer warp). A build may set
/// another count with -DQWEN_MEGA_WARPS=n (up to 11 keep the 168-register cap of 9 warps; H200: 10
/// and 11 were 1.5-2.5% slower for 0.6B, 10 was 1% faster and 11 4% slower for 4B).
#ifndef QWEN_MEGA_WARPS
#define QWEN_MEGA_WARPS 8
#endif
inline constexpr int kMegaWarps = QWEN_MEGA_WARPS;

/// One layer's weights as the persistent kernel reads them (device array, one entry per layer).
struct MegaLayer {
  const bf16* wqkv = nullptr;       ///< [q_dim + 2 kv_dim][hidden]
  const bf16* wo = nullptr;         ///< [hidden][q_dim]
  const bf16* wgu = nullptr;        ///< [2 intermediate][hidden] (gate rows, then up rows)
  const bf16* wdown = nullptr;      ///< [hidden][intermediate]
  const bf16* in_norm = nullptr;    ///< [hidden]
  const bf16* post_norm = nullptr;  ///< [hidden]
  const bf16* q_norm = nullptr;     ///< [head_dim]
  const bf16* k_norm = nullptr;     ///< [head_dim]
};

/// Everything one launch reads; fixed for the engine's lifetime (per-step values come through meta).
struct MegaParams {
  const MegaLayer* layers = nullptr;  ///< device array [num_layers]
  int num_layers = 0;
  int hidden = 0, q_dim = 0, kv_dim = 0, intermediate = 0, vocab = 0;
  float eps = 1e-6f;
  const bf16* embed = nullptr;
  const bf16* lm_head = nullptr;
  const bf16* final_norm = nullptr;
  const float2* rope = nullptr;
  RowMeta meta;
  KvPool kv;
  // Activations as tagged 64-bit words {value bits (low), tag (high)}; tags start at zero.
  unsigned long long* x = nullptr;     ///< [hidden] residual stream (fp32 values)
  unsigned long long* qkv = nullptr;   ///< [q_dim + 2 kv_dim] projections (fp32)
  /// bf16 activations as 32-bit half words {bf16 bits (low), 16-bit tag (high)}, 8-byte aligned.
  unsigned* attn = nullptr;  ///< [q_dim] attention output
  unsigned* act = nullptr;   ///< [intermediate] silu(gate) * up
  /// Split attention's partial states, [query heads][mega_part_splits(...)][head_dim + 2] ({max,
  /// sum, unnormalised output} per chunk; tagged words).
  unsigned long long* attn_part = nullptr;
  /// Chunks of a decode context at most for items of one query head (1..kMaxAttnSplits; 1: never
  /// split); items of two query heads get mega_pair_splits(attn_splits). Items (query heads / heads
  /// per item x chunks) must not outnumber the blocks.
  int attn_splits = 1;
  int attn_min_chunk = 128; ///< positions per chunk at least (a multiple of 64)
  /// Query heads per attention item (with 2 or more per kv head): 1; 2; or 0: 1, or 2 in a step
  /// where items of two heads split the context into more chunks (a long context, where
  /// attn_splits caps the chunks of one-head items).
  int attn_heads = 0;
  /// GEMV rows on the tensor cores (matrices whose width is a multiple of 256): one MMA per 128
  /// weights instead of 128 FMAs per lane-chunk. 0: the per-matrix kernels' FMA order (bit-identical).
  int mma = 1;
  /// GEMV rows as tiles on the tensor cores (with mma; mega_tiles_fit): a block's pairs of rows, in
  /// slices of piece / 2 weights, split evenly over its warps, each MMA 2 rows x 128 weights (mma_tile
  /// in mega.cu), the warps' partial sums added per row in shared memory in warp order. 0: rows one
  /// (or two) at a time per warp, 8 segment sums on an MMA's diagonal.
  int tiles = 0;
  /// The producer lanes issue their bulk copies one lane at a time (QWEN_MEGA_SERIAL_ISSUE=1) instead
  /// of together: the same protocol, slower (0.6B +8%, 4B +27% on an H200), for compute-sanitizer
  /// racecheck, which attributes a copy that several lanes issue in one instruction to one of
  /// them and reports the other lanes' rings' reads as hazards (probes/raceprobe.cu).
  int serial_issue = 0;
  /// Tiles only: the producer warp pauses this many ns (__nanosleep) after every round of its loop
  /// that issued copies, so that the lanes whose slots free up meanwhile are refilled together (0: no
  /// pause, and a kernel variant without the branch; mega_device_tuning picks it per device). On an
  /// H100 the SMs' weight streams ran at uneven rates without it, different SMs slow in each phase
  /// (the slowest block of a GEMV phase finished 17% after the median one), and every phase waits
  /// for its slowest block: 100 ns made the 4B step 3% faster. On an H200 the same pause made it 11%
  /// slower with 4 KiB tile slots, but 75 ns made it 2% faster with the 5 KiB slots it takes now
  /// (docs/perf-notes.md; MegaTuning).
  int pace_ns = 0;
  float* logits = nullptr;             ///< [vocab]
  unsigned long long* keys = nullptr;  ///< [1] argmax key of the step (as launch_argmax packs it)
  unsigned long long* block_best = nullptr;  ///< [grid] each block's best key
  unsigned* sync = nullptr;  ///< [2] epoch, blocks exited (zero-initialised once)
  int slots = 0;             ///< ring slots per warp
  /// Weights per ring slot: 2048, or with tensor-core rows a multiple of 256 up to 4096; 0:
  /// mega_geometry picks one. Set it to the geometry's.
  int piece = 0;
  /// Diagnostics (QWEN_MEGA_TRACE=1 in a build with the trace: mega_trace_built()): [grid][5 layers +
  /// 2][kMegaMarks] %globaltimer stamps per block
  /// and phase (entry, input staged, last warp done; attention: own chunk done, pass done, cross-warp
  /// state shared; GEMV: ns waited for ring slots summed over warps, slots found empty; with a
  /// QWEN_MEGA_PROF build also SM cycles summed over warps in slot waits, row arithmetic and row
  /// epilogues) of the last step run; nullptr: none recorded.
  unsigned long long* trace = nullptr;
};

/// Shared-memory plan and grid of the persistent kernel.
struct MegaGeometry {
  int slots = 0;         ///< ring slots per warp
  int piece = 0;         ///< weights per slot
  int slot_bytes = 0;    ///< bytes of one slot
  int poll_batch = 0;    ///< activation words in flight per thread while staging (4B-like shapes: more)
  std::size_t smem = 0;  ///< dynamic shared memory per block
  int grid = 0;          ///< blocks: one per SM
};

/// Whether the persistent kernel was built with its trace (-DQWEN_MEGA_TRACE_BUILD=1, CMake option
/// QWEN_MEGA_TRACE); without it MegaParams::trace is ignored.
bool mega_trace_built();
/// Whether the matrices' shapes allow tiles (MegaParams::tiles): every row count a multiple of the
/// tile's rows, every width a multiple of the weights per row and MMA.
bool mega_tiles_fit(const MegaParams& p);
/// Whether the persistent kernel is built for (head_dim, query heads per kv head).
bool mega_supported(int head_dim, int group);
/// Attention's default split: as many chunks per context as there are blocks per query head, at most
/// kMaxAttnSplits (items of one query head; items of two get mega_pair_splits of it).
int mega_attention_splits(int kv_heads, int group, int grid);
/// Chunks per context at most for items of two query heads: twice those of one-head items (the same
/// number of blocks), at most kMaxAttnSplits.
constexpr int mega_pair_splits(int splits) { return 2 * splits < kMaxAttnSplits ? 2 * splits : kMaxAttnSplits; }
/// Chunks per query head that MegaParams::attn_part holds (the larger of the two item kinds').
constexpr int mega_part_splits(int splits, int group) { return group >= 2 ? mega_pair_splits(splits) : splits; }
/// Chooses the rings (p.piece weights per slot, or with 0 the size among 2048, 2560 and 3072 that keeps
/// the most weights in flight per warp; as many slots per warp as fit beside the staged activations,
/// at most max_slots), sets the kernel's shared-memory limit and checks that one block fits per SM.
MegaGeometry mega_geometry(const MegaParams& p, int head_dim, int group, int max_slots, int num_sms);
/// The persistent kernel's settings that differ by device, from the memory's peak bandwidth (measured
/// on an H100 SXM, 3.35 TB/s, and an H200, 4.8 TB/s, only; docs/perf-notes.md). The example's
/// QWEN_MEGA_PACE and QWEN_MEGA_TILE_PIECE override them.
struct MegaTuning {
  /// MegaParams::pace_ns with tiles: under 4 TB/s 100 (H100: 4B 3% faster, 0.6B 0.5%); above, 75 where
  /// hidden >= 2048 (H200, 4B in 5 KiB slots: 2.19 ms against 2.24 without; 150 ns: 2.25), else 0
  /// (H200, 0.6B: 1-2% slower with 50-150 ns).
  int pace_ns = 0;
  /// MegaParams::piece with tiles: 2048 under 4 TB/s (H100, paced: 4B 2.93 ms against 3.05 with 2560),
  /// else 0, the geometry's choice (H200: 4B takes 5 slots of 2560 weights, 2.24 ms against 2.60 with
  /// 6 of 2048, both unpaced).
  int tile_piece = 0;
};
/// The tuning for `device` and a model of `hidden` channels.
MegaTuning mega_device_tuning(int device, int hidden);
/// Launches one decode step of one row (cooperative: every block resident).
void launch_mega(const MegaParams& p, int head_dim, int group, const MegaGeometry& g, replay::stream_ref s);

}  // namespace qwen
