// examples/qwen/model.cu: the Engine: weights, the buffer arena, the paged KV pool, the decode step,
// prefill, and eager / graph decode through replay::step_runner (tensor parallel: one rank's shard,
// its collectives in the step, and replay::lockstep_runner).
#include "model.hpp"
#include "cublas.hpp"
#include "sample.cuh"

#include <common/device.hpp>

#include <replay/device_loop.hpp>
#include <replay/runner.hpp>
#if QWEN_WITH_NCCL
#  include <replay/lockstep.hpp>
#  include <replay/nccl.hpp>
#endif

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

namespace qwen {

namespace {

std::string lname(int i, const char* suffix) { return fmt::format("model.layers.{}.{}", i, suffix); }

/// A per-tensor seed: FNV-1a of the tensor name mixed with the user seed.
std::uint64_t name_seed(std::uint64_t seed, const std::string& name) {
  std::uint64_t h = 1469598103934665603ull;
  for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h ^ (seed * 0x9E3779B97F4A7C15ull);
}

std::size_t align_elems(std::size_t n) { return (n + 127) / 128 * 128; }  // 256-byte alignment for bf16
std::size_t align_bytes(std::size_t n) { return (n + 255) / 256 * 256; }

constexpr std::size_t kCublasWorkspace = 32u << 20;

}  // namespace

struct Engine::Impl {
  Config cfg;
  EngineOptions opt;
  /// This rank's share of the model (tensor parallel; at tp_size 1 the whole model): its query and
  /// kv heads, intermediate rows and lm_head rows (vocabulary ids [vocab0, vocab0 + vocab)).
  struct Shard {
    int rank = 0, size = 1;
    int q_heads = 0, kv_heads = 0, inter = 0, vocab = 0, vocab0 = 0;
    int q_dim = 0, kv_dim = 0, qkv_dim = 0;
  } sh;
#if QWEN_WITH_NCCL
  TpComms comms{};  // tp_size > 1: the step's collectives and the runner's agreements
#endif
  PeerSum peers{};  // tp_size > 1, TpSum::one_shot: the group's exchange buffers (comms.sum)
  int max_rows = 0;  // rows of the activation buffers: max(max_batch, prefill_chunk)
  int num_sms = 0;
  replay::stream stream;
  CublasHandle cublas;

  // Weights: one allocation; Q/K/V stacked into one matrix and gate/up into another.
  replay::device_buffer<bf16> weights;
  const bf16* embed = nullptr;

  // The paged KV pool and its host bookkeeping.
  replay::device_buffer<bf16> kv_pool;
  KvPool kv;
  std::optional<PagedKvBook> book;

  // Step metadata (copied before each step): one RowStep per row, and the block table, whose rows
  // are copied as the host's bookkeeping changes them.
  replay::step_meta_array<RowStep> row_meta;       // [max_rows]
  replay::step_meta_array<std::int32_t> table_meta;  // [(max_seqs + 1) * width]
  RowMeta meta;
  // The sampler's parameters (EngineOptions::sampling), pushed when set_sampling changes them.
  std::optional<replay::step_meta<SampleParams>> sample_meta;
  SampleParams sample_params;

  // Every other buffer, carved from one arena: fixed addresses for the engine's lifetime.
  replay::static_arena arena;
  float* residual = nullptr;                 // [rows][H] fp32 residual stream
  bf16* xn = nullptr;                        // [rows][H] normalised input of a GEMM (cuBLAS path)
  float* qkv = nullptr;                      // [rows][q_dim + 2 kv_dim]
  bf16* attn = nullptr;                      // [rows][q_dim]
  float* gu = nullptr;                       // [rows][2 I] gate | up (cuBLAS path)
  bf16* act = nullptr;                       // [rows][I] SiLU(gate) * up
  float* logits = nullptr;                   // [max_batch][V] what the sampler reads (tp 1: the lm_head's output)
  float* head_out = nullptr;                 // [max_batch][vocab shard] the lm_head's output (tp 1: logits)
  float* gathered = nullptr;                 // tp > 1, sampling: [tp][max_batch][vocab shard] all-gathered
  unsigned long long* keys = nullptr;        // [rows] packed argmax
  float2* rope = nullptr;                    // [max_context][head_dim / 2] (cos, sin)
  float* attn_partial = nullptr;             // split-KV partial softmax states
  unsigned* attn_arrived = nullptr;          // split-KV arrival counters, zero between launches
  std::byte* cublas_ws = nullptr;
  replay::pinned_buffer<unsigned long long> keys_host;

  /// A decoder layer as the step launches it: four projections and attention's norms.
  struct Layer {
    Linear qkv, o, gate_up, down;
    const bf16* q_norm = nullptr;
    const bf16* k_norm = nullptr;
  };
  std::vector<Layer> layers;
  Linear head;  // final norm + lm_head + argmax (sampling: + logits, then the sampler)

  /// What a bucket runs: each projection's GEMV plan (none: cuBLAS) and attention's plan.
  struct BucketPlan {
    std::optional<GemvPlan> qkv, o, gate_up, down, head;
    AttnPlan attn;
  };
  std::map<int, BucketPlan> plans;
  BucketPlan oversize;  // batches above the largest bucket (eager fallback): cuBLAS, no split

  std::vector<int> buckets;
  std::optional<replay::step_runner<replay::graph_key>> runner;  // tp_size 1
#if QWEN_WITH_NCCL
  std::optional<replay::lockstep_runner<replay::graph_key>> tp_runner;  // tp_size > 1: the same bucket on every rank
#endif
  long long eager_steps = 0;

  [[nodiscard]] replay::pool_stats runner_stats() const {
#if QWEN_WITH_NCCL
    if (tp_runner) return tp_runner->stats();
#endif
    return runner->stats();
  }

  // ---------------------------------------------------------------------------------------------
  // Setup: all checks first, then every allocation.
  void init(const replay_examples::safetensors* st) {
    cfg.validate();
    opt.validate(cfg);
    if (st != nullptr) check_weights(cfg, *st);
    const int tp = opt.tp_size;
    sh = {.rank = opt.tp_rank, .size = tp, .q_heads = cfg.num_attention_heads / tp,
          .kv_heads = cfg.num_key_value_heads / tp, .inter = cfg.intermediate_size / tp,
          .vocab = cfg.vocab_size / tp, .vocab0 = opt.tp_rank * (cfg.vocab_size / tp)};
    sh.q_dim = sh.q_heads * cfg.head_dim, sh.kv_dim = sh.kv_heads * cfg.head_dim;
    sh.qkv_dim = sh.q_dim + 2 * sh.kv_dim;
#if QWEN_WITH_NCCL
    if (tp > 1) {
      int device = -1;
      REPLAY_CHECK(cudaGetDevice(&device));
      for (const auto* c : {&comms.step, &comms.agree})
        if (!*c || c->size() != tp || c->rank() != opt.tp_rank || c->device() != device)
          throw replay::usage_error(fmt::format(
              "qwen::Engine: rank {} of {} on device {} needs communicators of that rank, size and device",
              opt.tp_rank, tp, device));
      if (opt.tp_sum == TpSum::one_shot && (comms.sum.size != tp || comms.sum.rank != opt.tp_rank))
        throw replay::usage_error(fmt::format("qwen::Engine: rank {} of {} sums over peer memory (TpSum::one_shot) "
                                              "and needs its group's PeerSum", opt.tp_rank, tp));
    }
#else
    if (tp > 1) throw input_error("tensor parallel needs a build with NCCL (QWEN_WITH_NCCL)");
#endif
    // ---- GPU work starts here -----------------------------------------------------------------
    num_sms = replay_examples::sm_count();
    const std::int64_t nb = opt.kv_blocks(cfg);
    std::size_t free_bytes = 0, total_bytes = 0;
    REPLAY_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    if (opt.kv_budget_bytes > free_bytes)
      throw input_error(fmt::format("--kv-mem-mb: a KV budget of {:.0f} MiB ({} blocks of {} tokens) exceeds the "
                                    "device's free memory of {:.0f} MiB",
                                    opt.kv_budget_bytes / 1048576.0, nb, opt.block_size, free_bytes / 1048576.0));
    init_gemv_attributes();
    init_attention_attributes();
    init_prefill_attention_attributes();
    stream = replay::stream();
    alloc_weights(st);
    for (auto& l : layers)
      for (Linear* op : {&l.qkv, &l.o, &l.gate_up, &l.down}) make_weight_maps(*op);
    make_weight_maps(head);
    alloc_kv(static_cast<int>(nb));
    alloc_buffers();
    if (opt.sampling) {
      sample_meta.emplace(sample_params);
      sample_meta->push(stream);
    }
    build_layers();
    launch_rope_table(rope, opt.max_context, cfg.head_dim, cfg.rope_theta, stream);
    push_block_table();

    replay::runner_options ro;
    ro.buckets = replay::bucket_policy::powers_of_two(static_cast<std::size_t>(std::min(opt.max_bucket, opt.max_batch)));
    ro.oversize = opt.eager_fallback ? replay::oversize_policy::eager : replay::oversize_policy::throw_error;
    ro.pool.warmup = 1;  // one eager run before capture (same inputs: rewrites the same K/V values)
    for (std::size_t b : ro.buckets.sizes()) buckets.push_back(static_cast<int>(b));
    plan_buckets();
    auto step_fn = [this](replay::stream_ref s, const replay::graph_key& k) { step(static_cast<int>(k.bucket), s); };
#if QWEN_WITH_NCCL
    if (tp > 1)  // oversize batches: bucket_for() has checked eager_fallback; they run eagerly on every rank
      tp_runner.emplace(step_fn, replay::nccl_agreement(comms.agree),
                        replay::lockstep_options{.rank = sh.rank, .pool = ro.pool, .buckets = ro.buckets});
    else
#endif
      runner.emplace(step_fn, std::move(ro));
    stream.synchronize();
  }

  /// The weights of this rank: a slice of each full tensor (the whole tensor at tp_size 1; README,
  /// "Tensor parallel"): q/k/v, gate and up by rows (this rank's heads and intermediate rows), O
  /// and down by columns, the lm_head by rows (vocabulary ids); the embedding and the norms whole.
  void alloc_weights(const replay_examples::safetensors* st) {
    const std::size_t H = cfg.hidden_size, I = cfg.intermediate_size, D = cfg.head_dim, V = cfg.vocab_size;
    const std::size_t Q = cfg.q_dim(), r = sh.rank;
    const std::size_t Qr = sh.q_dim, KVr = sh.kv_dim, Ir = sh.inter, Vr = sh.vocab;  // this rank's rows
    struct Piece {
      std::string name;          // HF tensor name (random init: seed source)
      std::size_t offset;        // elements into `weights`
      std::size_t rows, cols;    // the slice held: rows x cols, dense
      std::size_t row0, col0;    // its first element in the full tensor
      std::size_t ld;            // the full tensor's row length
      bool is_norm;
    };
    std::vector<Piece> pieces;
    std::size_t total = 0;
    auto place = [&](std::size_t n) { return std::exchange(total, total + align_elems(n)); };
    // Rows [row0, row0 + rows) of a [.][cols] tensor; columns [col0, col0 + cols) of a [rows][ld] one.
    auto add_rows = [&](const std::string& name, std::size_t at, std::size_t rows, std::size_t row0, std::size_t cols) {
      pieces.push_back({name, at, rows, cols, row0, 0, cols, false});
    };
    auto add_cols = [&](const std::string& name, std::size_t at, std::size_t rows, std::size_t col0, std::size_t cols,
                        std::size_t ld) { pieces.push_back({name, at, rows, cols, 0, col0, ld, false}); };
    auto add_norm = [&](const std::string& name, std::size_t at, std::size_t n) {
      pieces.push_back({name, at, 1, n, 0, 0, n, true});
    };
    const std::size_t embed_at = place(V * H);
    add_rows("model.embed_tokens.weight", embed_at, V, 0, H);  // replicated: every rank looks tokens up
    std::vector<std::array<std::size_t, 8>> lay(cfg.num_hidden_layers);
    for (int i = 0; i < cfg.num_hidden_layers; ++i) {
      auto& o = lay[i];
      o[0] = place((Qr + 2 * KVr) * H);  // [q; k; v] rows of this rank's heads
      add_rows(lname(i, "self_attn.q_proj.weight"), o[0], Qr, r * Qr, H);
      add_rows(lname(i, "self_attn.k_proj.weight"), o[0] + Qr * H, KVr, r * KVr, H);
      add_rows(lname(i, "self_attn.v_proj.weight"), o[0] + (Qr + KVr) * H, KVr, r * KVr, H);
      o[1] = place(H * Qr);  // the columns that read this rank's heads
      add_cols(lname(i, "self_attn.o_proj.weight"), o[1], H, r * Qr, Qr, Q);
      o[2] = place(2 * Ir * H);  // [gate; up] rows of this rank's intermediate rows
      add_rows(lname(i, "mlp.gate_proj.weight"), o[2], Ir, r * Ir, H);
      add_rows(lname(i, "mlp.up_proj.weight"), o[2] + Ir * H, Ir, r * Ir, H);
      o[3] = place(H * Ir);
      add_cols(lname(i, "mlp.down_proj.weight"), o[3], H, r * Ir, Ir, I);
      o[4] = place(H);
      add_norm(lname(i, "input_layernorm.weight"), o[4], H);
      o[5] = place(H);
      add_norm(lname(i, "post_attention_layernorm.weight"), o[5], H);
      o[6] = place(D);
      add_norm(lname(i, "self_attn.q_norm.weight"), o[6], D);
      o[7] = place(D);
      add_norm(lname(i, "self_attn.k_norm.weight"), o[7], D);
    }
    const std::size_t norm_at = place(H);
    add_norm("model.norm.weight", norm_at, H);
    std::size_t head_at = embed_at + std::size_t(sh.vocab0) * H;  // tied: this rank's rows of the embedding
    if (!cfg.tie_word_embeddings) {
      head_at = place(Vr * H);
      add_rows("lm_head.weight", head_at, Vr, std::size_t(sh.vocab0), H);
    }
    weights = replay::device_buffer<bf16>(total);
    bf16* base = weights.data();
    for (const auto& p : pieces) {
      const bool contiguous = p.cols == p.ld;  // whole rows: one run of the full tensor
      if (st != nullptr) {
        const bf16* src = reinterpret_cast<const bf16*>(st->at(p.name).data) + p.row0 * p.ld + p.col0;
        if (contiguous)
          REPLAY_CHECK(cudaMemcpyAsync(base + p.offset, src, p.rows * p.cols * sizeof(bf16), cudaMemcpyHostToDevice,
                                       stream.get()),
                       "copying tensor {}", p.name);
        else
          REPLAY_CHECK(cudaMemcpy2DAsync(base + p.offset, p.cols * sizeof(bf16), src, p.ld * sizeof(bf16),
                                         p.cols * sizeof(bf16), p.rows, cudaMemcpyHostToDevice, stream.get()),
                       "copying columns {}..{} of tensor {}", p.col0, p.col0 + p.cols, p.name);
      } else if (p.is_norm) {
        launch_fill_const(base + p.offset, p.cols, 1.0f, stream);
      } else if (contiguous && p.row0 == 0) {  // uniform(-a, a) has std a / sqrt(3)
        launch_fill_random(base + p.offset, p.rows * p.cols, name_seed(opt.seed, p.name), opt.init_std * 1.7320508f,
                           stream);
      } else {  // a shard: the values of the same elements of the full tensor
        launch_fill_random_slice(base + p.offset, p.rows, p.cols, p.ld, p.row0, p.col0, name_seed(opt.seed, p.name),
                                 opt.init_std * 1.7320508f, stream);
      }
    }
    embed = base + embed_at;
    const float eps = static_cast<float>(cfg.rms_norm_eps);
    head = {.W = base + head_at, .N = sh.vocab, .K = cfg.hidden_size,
            .in = {.norm_w = base + norm_at, .eps = eps},
            .mode = opt.sampling ? gemv_out::store_f32 : gemv_out::argmax, .index0 = sh.vocab0};
    // O and down: through NCCL, rank 0 adds its product to the residual and the other ranks store
    // their partial products there, and the all-reduce after them (step) sums the ranks' residuals;
    // over peer memory, every rank stores its product in its exchange buffer (build_layers) and the
    // sum's kernel adds all of them to the residual.
    const gemv_out partial = sh.rank == 0 && !peer_sum() ? gemv_out::add_f32 : gemv_out::store_f32;
    for (int i = 0; i < cfg.num_hidden_layers; ++i) {
      const auto& o = lay[i];
      Layer l;
      l.qkv = {.W = base + o[0], .N = sh.qkv_dim, .K = cfg.hidden_size, .in = {.norm_w = base + o[4], .eps = eps},
               .mode = gemv_out::store_f32};
      l.o = {.W = base + o[1], .N = cfg.hidden_size, .K = sh.q_dim, .in = {.eps = eps}, .mode = partial};
      l.gate_up = {.W = base + o[2], .N = sh.inter, .K = cfg.hidden_size,
                   .in = {.norm_w = base + o[5], .eps = eps}, .mode = gemv_out::silu_mul};
      l.down = {.W = base + o[3], .N = cfg.hidden_size, .K = sh.inter, .in = {.eps = eps}, .mode = partial};
      l.q_norm = base + o[6];
      l.k_norm = base + o[7];
      layers.push_back(l);
    }
    stream.synchronize();  // pageable source memory of the copies must stay mapped until done
  }

  void alloc_kv(int nb) {
    const int width = (opt.max_context + opt.block_size - 1) / opt.block_size;
    book.emplace(nb, opt.block_size, opt.max_batch, width);
    kv = {.num_blocks = nb, .block_size = opt.block_size, .kv_heads = sh.kv_heads, .head_dim = cfg.head_dim};
    kv_pool = replay::device_buffer<bf16>(kv.layer_stride() * cfg.num_hidden_layers);
    kv.base = kv_pool.data();
    REPLAY_CHECK(cudaMemsetAsync(kv_pool.data(), 0, kv_pool.size_bytes(), stream.get()));
    max_rows = std::max(opt.max_batch, opt.prefill_chunk);
    row_meta = replay::step_meta_array<RowStep>(std::size_t(max_rows));
    table_meta = replay::step_meta_array<std::int32_t>(book->table().size());
    meta = {.rows = row_meta.device(), .block_table = table_meta.device(), .table_width = width};
  }

  /// Carves every buffer from one arena (sized first, then allocated once and frozen).
  void alloc_buffers() {
    const std::size_t R = max_rows, H = cfg.hidden_size, I = sh.inter, V = cfg.vocab_size, B = opt.max_batch;
    std::size_t split_rows = 0;  // split-KV scratch for the largest rows x splits of any bucket
    for (int b = 1; b <= opt.max_batch; b *= 2)
      split_rows = std::max(split_rows, std::size_t(b) * attn_plan(b).splits);
    const std::size_t partial = split_rows * sh.kv_heads * attn_partial_floats(cfg.group_size(), cfg.head_dim);
    const std::size_t arrived = R * sh.kv_heads;
    const std::size_t rope_n = std::size_t(opt.max_context) * cfg.head_dim / 2;
    // Tensor parallel: the lm_head's output is this rank's vocabulary shard; sampling gathers the
    // shards (gathered) and puts them back in vocabulary order (logits).
    const bool tp = sh.size > 1;
    const std::size_t shard_n = tp ? B * sh.vocab : 0, gathered_n = tp && opt.sampling ? B * V : 0;
    const std::size_t logits_n = !tp || opt.sampling ? B * V : 0;
    const std::size_t sizes[] = {R * H * 4,       R * H * 2,       R * sh.qkv_dim * 4, R * sh.q_dim * 2,
                                 R * 2 * I * 4,   R * I * 2,       logits_n * 4,       R * 8,
                                 rope_n * 8,      partial * 4,     arrived * 4,
                                 kCublasWorkspace, shard_n * 4,    gathered_n * 4};
    std::size_t bytes = 0;
    for (std::size_t s : sizes) bytes += align_bytes(s);
    arena = replay::static_arena(bytes);
    residual = arena.allocate<float>(R * H).data();
    xn = arena.allocate<bf16>(R * H).data();
    qkv = arena.allocate<float>(R * sh.qkv_dim).data();
    attn = arena.allocate<bf16>(R * sh.q_dim).data();
    gu = arena.allocate<float>(R * 2 * I).data();
    act = arena.allocate<bf16>(R * I).data();
    if (logits_n > 0) logits = arena.allocate<float>(logits_n).data();
    keys = arena.allocate<unsigned long long>(R).data();
    rope = arena.allocate<float2>(rope_n).data();
    attn_partial = arena.allocate<float>(partial).data();
    attn_arrived = arena.allocate<unsigned>(arrived).data();
    cublas_ws = arena.allocate<std::byte>(kCublasWorkspace).data();
    head_out = tp ? arena.allocate<float>(shard_n).data() : logits;
    if (gathered_n > 0) gathered = arena.allocate<float>(gathered_n).data();
    arena.freeze();
    REPLAY_CHECK(cudaMemsetAsync(arena.base(), 0, arena.capacity(), stream.get()));
    keys_host = replay::pinned_buffer<unsigned long long>(R);
    QWEN_CUBLAS(cublasSetWorkspace(cublas.get(), cublas_ws, kCublasWorkspace));
    QWEN_CUBLAS(cublasSetMathMode(cublas.get(), CUBLAS_DEFAULT_MATH));
  }

  /// Points the projections at their activation buffers.
  void build_layers() {
    const int H = cfg.hidden_size;
    for (auto& l : layers) {
      l.qkv.in.x_f32 = residual, l.qkv.y_f32 = qkv, l.qkv.ldy = sh.qkv_dim;
      l.o.in.x_bf16 = attn, l.o.y_f32 = peer_sum() ? peers.in[sh.rank][0] : residual, l.o.ldy = H;
      l.gate_up.in.x_f32 = residual, l.gate_up.y_bf16 = act, l.gate_up.ldy = sh.inter;
      l.down.in.x_bf16 = act, l.down.y_f32 = peer_sum() ? peers.in[sh.rank][1] : residual, l.down.ldy = H;
    }
    head.in.x_f32 = residual, head.y_f32 = head_out, head.ldy = sh.vocab, head.keys = keys;
  }

  /// Attention's plan for a bucket of `rows` rows, with the split-KV scratch.
  [[nodiscard]] AttnPlan attn_plan(int rows) const {
    AttnPlan p = plan_attention(rows, sh.q_heads, sh.kv_heads, cfg.head_dim, num_sms);
    p.min_chunk = opt.attn_min_chunk, p.partial = attn_partial, p.arrived = attn_arrived;
    return p;
  }

  /// Chooses, once per bucket, each projection's kernel and attention's plan.
  void plan_buckets() {
    for (int b : buckets) {
      BucketPlan p;
      auto gemv = [&](const Linear& op) -> std::optional<GemvPlan> {
        if (b > opt.gemv_max_rows || !gemv_fits(op, b)) return std::nullopt;
        return plan_gemv(op, b, num_sms);
      };
      p.qkv = gemv(layers[0].qkv), p.o = gemv(layers[0].o), p.gate_up = gemv(layers[0].gate_up);
      p.down = gemv(layers[0].down), p.head = gemv(head);
      p.attn = attn_plan(b);
      plans.emplace(b, p);
    }
  }

  // ---------------------------------------------------------------------------------------------
  // The decode step: the same launches eagerly and under capture; every per-step value is read
  // from the metadata, so the captured graph of a bucket serves every step. Tensor parallel: the
  // same launches on every rank's shard, plus the collectives (reduce_residual, lm_head).
  void step(int rows, replay::stream_ref s) {
    const auto it = plans.find(rows);
    const BucketPlan& p = it != plans.end() ? it->second : oversize;
    launch_embed(embed, cfg.vocab_size, cfg.hidden_size, meta, rows, residual, keys, s);
    for (int l = 0; l < cfg.num_hidden_layers; ++l) {
      const Layer& w = layers[l];
      linear(w.qkv, rows, p.qkv, s);  // input RMSNorm folded in
      launch_attention(qkv, sh.q_heads, w.q_norm, w.k_norm, eps(), rope, meta, rows, kv, l,
                       /*write_kv=*/true, p.attn, attn, s);
      linear(w.o, rows, p.o, s);            // + residual
      reduce_residual(rows, 0, s);
      linear(w.gate_up, rows, p.gate_up, s);  // post-attention RMSNorm folded in; SiLU(gate) * up
      linear(w.down, rows, p.down, s);      // + residual
      reduce_residual(rows, 1, s);
    }
    lm_head(head, rows, p.head, meta.rows, s);  // final RMSNorm folded in
  }

  /// Tensor parallel: after O (slot 0) and after down (slot 1), residual + the sum of the ranks'
  /// products on every rank. Through NCCL, rank 0's residual holds residual + its product and every
  /// other rank's its product: one in-place sum over the ranks (rows x H floats). Over peer memory,
  /// each rank's product is in its exchange buffer `slot`: one launch_peer_sum. Nothing at tp_size 1.
  void reduce_residual(int rows, int slot, replay::stream_ref s) {
    const std::size_t n = std::size_t(rows) * cfg.hidden_size;
    if (peer_sum()) return launch_peer_sum(peers, slot, n, residual, s);
#if QWEN_WITH_NCCL
    if (sh.size > 1) replay::all_reduce(comms.step, residual, residual, n, ncclSum, s);
#else
    (void)n, (void)slot, (void)s;
#endif
  }

  /// The step's sums go through launch_peer_sum (tensor parallel, TpSum::one_shot).
  [[nodiscard]] bool peer_sum() const { return sh.size > 1 && opt.tp_sum == TpSum::one_shot; }

  /// The lm_head on `rows` rows and the choice of each row's token, as a packed key in `keys`: the
  /// GEMV's argmax epilogue, or (sampling) the logits and then the sampler, which reads the row's
  /// position from `row_meta` (the rows' step metadata) and its parameters from sample_meta.
  /// Tensor parallel: each rank's head covers its vocabulary shard; greedy, its keys carry global
  /// token ids and a max over the ranks (uint64) picks the argmax; sampling, the shards are
  /// all-gathered and put back in vocabulary order, and every rank samples the same token.
  void lm_head(const Linear& h, int rows, const std::optional<GemvPlan>& plan, const RowStep* row_meta,
               replay::stream_ref s) {
    linear(h, rows, plan, s);
#if QWEN_WITH_NCCL
    if (sh.size > 1 && !opt.sampling)
      replay::all_reduce(comms.step, keys, keys, std::size_t(rows), ncclUint64, ncclMax, s);
    if (sh.size > 1 && opt.sampling) {
      replay::all_gather(comms.step, head_out, gathered, std::size_t(rows) * sh.vocab, ncclFloat32, s);
      launch_unshard_logits(gathered, sh.size, rows, sh.vocab, logits, s);
    }
#endif
    if (opt.sampling) launch_sample(logits, cfg.vocab_size, row_meta, sample_meta->device(), rows, keys, s);
  }

  /// One prefill chunk of `rows` positions of one sequence (cuBLAS GEMMs, tensor-core attention);
  /// K/V written first, since the chunk's rows attend to each other.
  void prefill_chunk(int rows, replay::stream_ref s) {
    launch_embed(embed, cfg.vocab_size, cfg.hidden_size, meta, rows, residual, keys, s);
    for (int l = 0; l < cfg.num_hidden_layers; ++l) {
      const Layer& w = layers[l];
      linear(w.qkv, rows, std::nullopt, s);
      launch_kv_write(qkv, sh.q_heads, w.k_norm, eps(), rope, meta, rows, kv, l, s);
      launch_prefill_attention(qkv, sh.q_heads, w.q_norm, eps(), rope, meta, rows, kv, l, attn, s);
      linear(w.o, rows, std::nullopt, s);
      reduce_residual(rows, 0, s);
      linear(w.gate_up, rows, std::nullopt, s);
      linear(w.down, rows, std::nullopt, s);
      reduce_residual(rows, 1, s);
    }
  }

  [[nodiscard]] float eps() const { return static_cast<float>(cfg.rms_norm_eps); }

  /// y = W x with op's epilogue: the fused GEMV where the bucket has a plan, else RMSNorm (if the
  /// input is the residual), a cuBLAS GEMM and the epilogue as its own kernel.
  void linear(const Linear& op, int rows, const std::optional<GemvPlan>& plan, replay::stream_ref s) {
    if (plan) return launch_gemv(op, rows, *plan, s);
    const bf16* x = op.in.x_bf16;
    if (op.in.norm_w != nullptr) {
      launch_rmsnorm(op.in.x_f32, op.in.norm_w, op.K, op.in.eps, rows, xn, s);
      x = xn;
    }
    switch (op.mode) {
      case gemv_out::store_f32: return gemm(op.W, op.N, op.K, x, rows, op.y_f32, op.ldy, 0.f, s);
      case gemv_out::add_f32: return gemm(op.W, op.N, op.K, x, rows, op.y_f32, op.ldy, 1.f, s);
      case gemv_out::silu_mul:
        gemm(op.W, 2 * op.N, op.K, x, rows, gu, 2 * op.N, 0.f, s);
        return launch_silu_mul(gu, op.N, rows, op.y_bf16, s);
      case gemv_out::argmax:
        gemm(op.W, op.N, op.K, x, rows, op.y_f32, op.ldy, 0.f, s);
        return launch_argmax(op.y_f32, op.N, rows, op.keys, s, op.index0);
    }
  }

  /// Y[rows][N] = beta Y + X[rows][K] W^T (bf16 in, fp32 out and compute).
  void gemm(const bf16* W, int N, int K, const bf16* X, int rows, float* Y, int ldy, float beta, replay::stream_ref s) {
    const float alpha = 1.0f;
    QWEN_CUBLAS(cublasSetStream(cublas.get(), s.get()));
    QWEN_CUBLAS(cublasGemmEx(cublas.get(), CUBLAS_OP_T, CUBLAS_OP_N, N, rows, K, &alpha, W, CUDA_R_16BF, K, X,
                             CUDA_R_16BF, K, &beta, Y, CUDA_R_32F, ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }

  // ---------------------------------------------------------------------------------------------
  // Metadata
  void push_block_table() {
    auto [b, e] = book->dirty();
    if (b == e) return;
    auto st = table_meta.staging();  // waits if this slot's previous copy is still reading it
    std::copy(book->table().begin() + b, book->table().begin() + e, st.begin() + b);
    table_meta.push_range(stream, std::size_t(b), std::size_t(e - b));
    book->clear_dirty();
  }

  /// Stages the rows, padded to max_batch rows (the largest bucket; padding rows: scratch slot,
  /// token 0, position 0), and pushes the metadata.
  void stage_and_push(std::span<const DecodeRow> rows) {
    const int n = std::max(static_cast<int>(rows.size()), opt.max_batch);
    auto st = row_meta.staging();
    for (int r = 0; r < n; ++r)
      st[r] = r < static_cast<int>(rows.size()) ? RowStep{rows[r].token, rows[r].pos, rows[r].slot}
                                                : RowStep{0, 0, book->scratch_slot()};
    push_block_table();
    row_meta.push(stream, std::size_t(n));
  }

  [[nodiscard]] int bucket_for(int n) const {
    for (int b : buckets)
      if (b >= n) return b;
    if (opt.eager_fallback) return n;
    throw input_error(fmt::format("batch of {} rows exceeds the largest graph bucket {} and eager fallback is off", n,
                                  buckets.back()));
  }

  void check_row(const DecodeRow& r) const {
    if (r.slot < 0 || r.slot >= book->max_seqs() || !book->in_use(r.slot))
      throw input_error(fmt::format("decode: slot {} is not an active sequence", r.slot));
    if (r.token < 0 || r.token >= cfg.vocab_size)
      throw input_error(fmt::format("token id {} is out of range (vocab size {})", r.token, cfg.vocab_size));
    if (r.pos < 0 || r.pos >= book->length(r.slot))
      throw input_error(fmt::format("decode: position {} of slot {} is not backed by KV blocks (length {})", r.pos,
                                    r.slot, book->length(r.slot)));
  }

  [[nodiscard]] std::string describe_kernels() const {
    auto name = [](const std::optional<GemvPlan>& p) -> std::string {
      if (!p) return "cuBLAS";
      switch (p->kind) {
        case GemvPlan::kernel::ring: return fmt::format("ring({})", p->slots);
        case GemvPlan::kernel::pipelined: return "pipelined";
        case GemvPlan::kernel::pipelined_deep: return "pipelined-deep";
        case GemvPlan::kernel::mma: return fmt::format("mma({})", p->piece);
      }
      return "?";
    };
    std::string s = "kernels per bucket (QKV, O, gate/up, down, lm_head; attention splits x warps):";
    for (const auto& [b, p] : plans)
      s += fmt::format(" {}: {}, {}, {}, {}, {}; {}x{}.", b, name(p.qkv), name(p.o), name(p.gate_up), name(p.down),
                       name(p.head), p.attn.splits, p.attn.warps);
    return s;
  }

  // ---------------------------------------------------------------------------------------------
  // The device loop (decode_loop): one graph whose WHILE node runs the bucket-1 step, then
  // launch_loop_advance, until the loop stops. One step per run of the body: the next step's
  // kernels (attention among them) read row 0's metadata before their PDL wait, so they must start
  // after the kernel that wrote it has ended, which a run boundary guarantees.
  std::optional<replay::token_loop> loop;  // its buffer of tokens; addresses fixed, held by loop_exec
  replay::graph_exec loop_exec;           // captured on first use

  void capture_loop() {
    loop.emplace(static_cast<std::size_t>(kMaxTokensPerLaunch));
    std::int32_t* token = &row_meta.device()->token;  // row 0's token and position
    std::int32_t* pos = &row_meta.device()->pos;
    const replay::graph g = replay::capture(stream, [&](replay::stream_ref cs) {
      loop->capture(cs, [&](replay::stream_ref body, replay::token_loop_ref ref) {
        step(1, body);
        launch_loop_advance(keys, token, pos, opt.max_context, ref, body);
      });
    });
    loop_exec = g.instantiate({.upload_stream = stream.get()});
  }

  /// Copies the lm_head's output of `n` rows, this rank's vocabulary columns, into `out` (rows of
  /// vocab floats).
  void copy_logits(std::span<float> out, int n) {
    const std::size_t V = cfg.vocab_size, Vr = sh.vocab;
    REPLAY_CHECK(cudaMemcpy2DAsync(out.data() + sh.vocab0, V * sizeof(float), head_out, Vr * sizeof(float),
                                   Vr * sizeof(float), std::size_t(n), cudaMemcpyDeviceToHost, stream.get()));
  }

  int run_loop(const DecodeRow& row, int limit, int stop_token, std::span<int> out) {
    if (!loop_exec) capture_loop();
    stage_and_push(std::span<const DecodeRow>(&row, 1));  // the first step's row, and the block table
    loop->arm(stream, limit, stop_token);                 // pushed only when it changes
    loop_exec.launch(stream);
    const replay::loop_result r = loop->wait(stream);  // polls the count and tokens the device wrote
    if (r.tokens.empty()) throw std::runtime_error("qwen: the device loop produced no token");
    std::copy(r.tokens.begin(), r.tokens.end(), out.begin());
    return static_cast<int>(r.tokens.size());
  }
};

// -------------------------------------------------------------------------------------------------

Engine::Engine(const Config& cfg, const EngineOptions& opt, const replay_examples::safetensors* weights)
    : impl_(std::make_unique<Impl>()) {
  impl_->cfg = cfg;
  impl_->opt = opt;
  impl_->init(weights);
}
#if QWEN_WITH_NCCL
Engine::Engine(const Config& cfg, const EngineOptions& opt, const replay_examples::safetensors* weights, TpComms comms)
    : impl_(std::make_unique<Impl>()) {
  impl_->cfg = cfg;
  impl_->opt = opt;
  impl_->comms = comms;
  impl_->peers = comms.sum;
  impl_->init(weights);
}
#endif
Engine::~Engine() = default;
Engine::Engine(Engine&&) noexcept = default;
Engine& Engine::operator=(Engine&&) noexcept = default;

const Config& Engine::config() const { return impl_->cfg; }
const EngineOptions& Engine::options() const { return impl_->opt; }
PagedKvBook& Engine::kv() { return *impl_->book; }
replay::stream_ref Engine::stream() const { return impl_->stream; }
const std::vector<int>& Engine::buckets() const { return impl_->buckets; }
int Engine::bucket_for(int rows) const { return impl_->bucket_for(rows); }
std::string Engine::describe_kernels() const { return impl_->describe_kernels(); }
replay::pool_stats Engine::pool_stats() const { return impl_->runner_stats(); }

GraphStats Engine::graph_stats() const {
  const auto& m = *impl_;
  const replay::pool_stats ps = m.runner_stats();
  GraphStats g;
  g.captures = static_cast<int>(ps.captures);
  g.replays = static_cast<long long>(ps.hits + ps.misses);
  g.eager_steps = m.eager_steps;
  g.fallback_steps = static_cast<long long>(ps.eager_oversize + ps.eager_fallbacks);
  g.real_rows = static_cast<long long>(ps.real_rows);
  g.padded_rows = static_cast<long long>(ps.padded_rows);
  g.graph_bytes = static_cast<std::size_t>(std::max<std::int64_t>(0, ps.resident_device_bytes));
  for (const auto& k : ps.keys)
    if (k.resident && k.key.rfind("bucket ", 0) == 0) g.nodes_per_bucket[std::atoi(k.key.c_str() + 7)] = k.last_capture.nodes;
  return g;
}

std::size_t Engine::weight_bytes() const { return impl_->weights.size_bytes(); }
std::size_t Engine::kv_pool_bytes() const { return impl_->kv_pool.size_bytes(); }
std::size_t Engine::buffer_bytes() const {
  return impl_->arena.capacity() + impl_->row_meta.span().size_bytes() + impl_->table_meta.span().size_bytes() +
         (impl_->sample_meta ? sizeof(SampleParams) : 0);
}

void Engine::set_sampling(const SampleParams& p) {
  auto& m = *impl_;
  p.validate();
  if (!m.opt.sampling && p.temperature != 0.f)
    throw input_error("sampling with a temperature above 0 needs an engine built with EngineOptions::sampling on");
  if (p == m.sample_params) return;
  m.sample_params = p;
  if (m.sample_meta) m.sample_meta->push(m.stream, p);  // ordered before the next step's launches
}

const SampleParams& Engine::sampling() const { return impl_->sample_params; }

int Engine::prefill(int slot, std::span<const int> tokens, int start, std::span<float> logits) {
  auto& m = *impl_;
  const int n = static_cast<int>(tokens.size());
  if (n < 1) throw input_error("prefill: empty prompt");
  if (slot < 0 || slot >= m.book->max_seqs() || !m.book->in_use(slot))
    throw input_error(fmt::format("prefill: slot {} is not an active sequence", slot));
  if (start < 0 || start + n > m.book->length(slot))
    throw input_error(fmt::format("prefill: positions {}..{} of slot {} are not backed by KV blocks (length {})", start,
                                  start + n - 1, slot, m.book->length(slot)));
  for (int t : tokens)
    if (t < 0 || t >= m.cfg.vocab_size)
      throw input_error(fmt::format("token id {} is out of range (vocab size {})", t, m.cfg.vocab_size));
  if (!logits.empty() && logits.size() < std::size_t(m.cfg.vocab_size))
    throw replay::usage_error("prefill: logits span smaller than the vocabulary");
  std::vector<DecodeRow> rows;
  int last = 0;
  for (int c0 = 0; c0 < n; c0 += m.opt.prefill_chunk) {
    const int c = std::min(m.opt.prefill_chunk, n - c0);
    rows.clear();
    for (int r = 0; r < c; ++r) rows.push_back({slot, tokens[c0 + r], start + c0 + r});
    m.stage_and_push(rows);
    m.prefill_chunk(c, m.stream);
    last = c - 1;
  }
  // The head on the last prompt row only (the sampler reads that row's position).
  Linear head = m.head;
  head.in.x_f32 = m.residual + std::size_t(last) * m.cfg.hidden_size;
  m.lm_head(head, 1, std::nullopt, m.meta.rows + last, m.stream);
  REPLAY_CHECK(cudaMemcpyAsync(m.keys_host.data(), m.keys, sizeof(unsigned long long), cudaMemcpyDeviceToHost,
                               m.stream.get()));
  if (!logits.empty()) m.copy_logits(logits, 1);
  m.stream.synchronize();
  return key_to_token(m.keys_host[0]);
}

void Engine::decode(std::span<const DecodeRow> rows, bool use_graph, std::span<int> next, std::span<float> logits) {
  auto& m = *impl_;
  const int n = static_cast<int>(rows.size());
  if (n < 1 || n > m.opt.max_batch)
    throw input_error(fmt::format("decode: {} rows, expected 1..{}", n, m.opt.max_batch));
  if (next.size() < rows.size()) throw replay::usage_error("decode: `next` smaller than the number of rows");
  if (!logits.empty() && logits.size() < rows.size() * std::size_t(m.cfg.vocab_size))
    throw replay::usage_error("decode: logits span smaller than rows x vocab");
  for (int i = 0; i < n; ++i) {
    m.check_row(rows[i]);
    for (int j = 0; j < i; ++j)
      if (rows[j].slot == rows[i].slot) throw input_error(fmt::format("decode: slot {} appears twice", rows[i].slot));
  }
  const int bucket = m.bucket_for(n);  // checks the oversize policy before any GPU work
  m.stage_and_push(rows);              // padded rows: scratch slot, token 0, position 0
  if (use_graph) {
    auto key = [](std::size_t b) { return replay::graph_key{.bucket = static_cast<std::uint32_t>(b)}; };
#if QWEN_WITH_NCCL
    if (m.tp_runner) (void)m.tp_runner->run_batch(static_cast<std::size_t>(n), m.stream, key);
    else
#endif
      (void)m.runner->run_batch(static_cast<std::size_t>(n), m.stream, key);
  } else {
    m.step(bucket, m.stream);  // the same launches, issued directly
    ++m.eager_steps;
  }
  REPLAY_CHECK(cudaMemcpyAsync(m.keys_host.data(), m.keys, std::size_t(n) * sizeof(unsigned long long),
                               cudaMemcpyDeviceToHost, m.stream.get()));
  if (!logits.empty()) m.copy_logits(logits, n);
  m.stream.synchronize();
  for (int i = 0; i < n; ++i) next[i] = key_to_token(m.keys_host[i]);
}

std::size_t Engine::prewarm_graphs() {
  auto& m = *impl_;
  m.stage_and_push({});  // warm-up runs read metadata: all rows padding (the scratch slot)
  auto key = [](std::size_t b) { return replay::graph_key{.bucket = static_cast<std::uint32_t>(b)}; };
#if QWEN_WITH_NCCL
  if (m.tp_runner) return m.tp_runner->prewarm_buckets(m.stream, key);
#endif
  return m.runner->prewarm_buckets(m.stream, key);
}

void Engine::record_decode_step(int rows, replay::stream_ref s) { impl_->step(rows, s); }

int Engine::decode_loop(int slot, int token, int pos, int k, int stop_token, std::span<int> out) {
  auto& m = *impl_;
  const int V = m.cfg.vocab_size, C = m.opt.max_context;
  if (m.sh.size > 1)
    throw input_error("decode_loop: the device loop runs on one GPU; with tensor parallel (--tp) decode one step "
                      "per call");
  if (k < 1 || k > kMaxTokensPerLaunch)
    throw input_error(fmt::format("decode_loop: {} tokens per launch, expected 1..{}", k, kMaxTokensPerLaunch));
  if (out.size() < static_cast<std::size_t>(k)) throw replay::usage_error("decode_loop: `out` smaller than k");
  if (slot < 0 || slot >= m.book->max_seqs() || !m.book->in_use(slot))
    throw input_error(fmt::format("decode_loop: slot {} is not an active sequence", slot));
  if (token < 0 || token >= V)
    throw input_error(fmt::format("token id {} is out of range (vocab size {})", token, V));
  if (stop_token < -1 || stop_token >= V)
    throw input_error(
        fmt::format("decode_loop: stop token {} is out of range (-1: none; vocab size {})", stop_token, V));
  if (pos < 0 || pos + 2 > C)
    throw input_error(fmt::format("decode_loop: position {} leaves no room for a token in the context of {}", pos, C));
  if (pos > m.book->length(slot))
    throw input_error(fmt::format("decode_loop: position {} of slot {} is past its cached positions (length {})", pos,
                                  slot, m.book->length(slot)));
  // The steps' inputs sit at positions [pos, pos + k), the last one at most at C - 2 (its token
  // fills the context); their K/V blocks are reserved now and the loop stops at their end.
  m.book->ensure(slot, std::min(pos + k, C - 1));
  const int limit = std::min(k, m.book->length(slot) - pos);
  return m.run_loop(DecodeRow{slot, token, pos}, limit, stop_token, out);
}

}  // namespace qwen
