// research/qwen/stream.cuh: the streaming decode kernel (buckets of 1, 2 and 4 rows).
//
// A decode step is a *program*: a sequence of phases (embed; per layer norm+QKV, attention, O + residual,
// norm+gate/up+SiLU, down + residual; norm+lm_head+argmax), each a set of independent work items
// (a GEMV item = a few output rows over the whole K; an attention item = one (row, kv head)). Phase
// p needs phase p-1 complete. A launch of `stream_kernel` runs a contiguous range of phases with a
// persistent grid (one block per SM): every block takes work items in order from a ticket counter,
// and a control warp streams each item's weight rows into a ring of shared-memory slots with bulk
// copies (cp.async.bulk, completion on an mbarrier) as soon as it holds the ticket, up to `slots`
// items ahead, *across phase boundaries*: weights never depend on activations, so they stream while
// the previous phase is still being reduced. Before touching activations an item waits until the
// previous phase's completed-item counter (same launch) reaches its item count; a launch waits for the
// previous launch with griddepcontrol.wait (PDL). Tickets are handed out in phase order and a block
// processes its tickets in order, so the smallest unfinished ticket can always progress: no deadlock,
// whatever the number of resident blocks. Counters are reset by the last block to exit.
//
// Arithmetic: the same as the per-matrix kernels (x rounded to bf16, fp32 accumulation) with a fixed
// summation order that does not depend on which block runs an item, so eager and graph replays give
// bit-identical results.
#pragma once

#include "kernels.cuh"

#include <cstddef>

namespace qwen {

enum class phase_kind : int { embed = 0, gemv = 1, attention = 2 };

/// One phase of a streaming decode program (device-side array, built once per bucket).
struct StreamPhase {
  phase_kind kind = phase_kind::gemv;
  gemv_out mode = gemv_out::store_f32;
  int items = 0;   ///< work items of the phase
  int first = 0;   ///< ticket of its first item within its launch
  int wait = -1;   ///< phase index (in the program) to wait for when it runs in the same launch; -1: none
  int wait_items = 0;  ///< items of that phase (its completed counter must reach this)
  int signal = 0;  ///< 1: a later phase of the same launch waits for this one (count completed items)
  // gemv: y = W x over output rows [item * rows, item * rows + rows)
  const bf16* W = nullptr;
  int N = 0;     ///< output rows (gate/up pairs for silu_mul: W has 2N rows)
  int K = 0;     ///< input width
  int rows = 0;  ///< output rows per item: 1, 2, 4 (K split over 8 / rows warps) or a multiple of 8
  GemvIn in{};
  float* y_f32 = nullptr;
  bf16* y_bf16 = nullptr;
  int ldy = 0;
  unsigned long long* keys = nullptr;  ///< argmax keys (argmax mode; embed resets them)
  // attention: per-head norm + RoPE of q and k, new K/V into the pool, softmax(qK^T)V
  const float* qkv = nullptr;
  const bf16* q_norm = nullptr;
  const bf16* k_norm = nullptr;
  const float2* rope = nullptr;
  float eps = 1e-6f;
  int layer = 0;
  int q_dim = 0;
  int kv_dim = 0;
  bf16* out = nullptr;
  // embed: residual[r] = embed[token[r]]
  const bf16* embed = nullptr;
  int vocab = 0;
  int hidden = 0;
  float* residual = nullptr;
};

/// One launch of the streaming kernel: phases [p0, p1) of a program.
struct StreamLaunch {
  const StreamPhase* phases = nullptr;  ///< device array: the whole program
  int p0 = 0, p1 = 0;
  unsigned total = 0;        ///< work items of phases [p0, p1)
  unsigned* ctr = nullptr;   ///< [ticket, exited blocks] of this launch (zero between launches)
  unsigned* done = nullptr;  ///< completed items per program phase (zero between launches)
  RowMeta meta;
  KvPool kv;
  int slot_bytes = 0;  ///< bytes of one ring slot (multiple of 128)
  int slots = 0;       ///< ring slots (2..8)
  /// Optional (diagnostics): per program phase, the %globaltimer (ns) when its last item completed.
  /// Every phase is then counted with a returning atomic (slightly slower).
  unsigned long long* trace = nullptr;
};

/// Shared-memory plan and grid of the streaming kernel for `rows` rows.
struct StreamGeometry {
  int slot_bytes = 0;
  int slots = 0;
  std::size_t smem = 0;  ///< dynamic shared memory: slots * slot_bytes + staged x (rows * max K bf16)
  int grid = 0;          ///< resident blocks (blocks per SM x SMs)
};

/// Whether the streaming kernel is built for this shape (rows 1, 2 or 4; (head_dim, query heads per
/// kv head) in (64, 2), (128, 2), (128, 4)).
bool stream_supported(int rows, int head_dim, int group);
/// Output rows per GEMV item so that an item's weights (rows x K bf16, twice for gate/up) fill about
/// `tile_bytes`: 1, 2, 4, 8 or 16.
int stream_rows_per_item(int K, bool pair, int tile_bytes);
/// Shared memory an attention item needs (it uses its ring slot as scratch).
std::size_t stream_attention_scratch(int head_dim, int group);
/// Chooses the ring (as many slots of `slot_bytes` as fit next to the staged x, at most `max_slots`),
/// sets the kernel's shared-memory limit and computes the resident grid. Throws usage_error when
/// fewer than 2 slots fit.
StreamGeometry stream_geometry(int rows, int head_dim, int group, int slot_bytes, int max_k, int max_slots,
                               int num_sms);
/// Launches phases [L.p0, L.p1) (PDL when enabled).
void launch_stream(const StreamLaunch& L, int rows, int head_dim, int group, const StreamGeometry& g,
                   replay::stream_ref s);

}  // namespace qwen
