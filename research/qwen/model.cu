// research/qwen/model.cu: the Engine (weights, buffers, paged KV, prefill, eager and graph decode).
#include "model.hpp"

#include "mega.cuh"
#include "stream.cuh"

#include <common/device.hpp>

#include <replay/capture.hpp>
#include <replay/graph.hpp>
#include <replay/runner.hpp>

#include <cublas_v2.h>
#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <cstdlib>
#include <array>
#include <map>
#include <cstring>
#include <string>

namespace qwen {

#define QWEN_CUBLAS(call)                                                                           \
  do {                                                                                              \
    const cublasStatus_t qwen_st_ = (call);                                                        \
    if (qwen_st_ != CUBLAS_STATUS_SUCCESS)                                                          \
      throw std::runtime_error(fmt::format("cuBLAS call {} failed: {}", #call, cublasGetStatusString(qwen_st_))); \
  } while (false)

namespace {

std::string lname(int i, const char* suffix) { return fmt::format("model.layers.{}.{}", i, suffix); }

/// A per-tensor seed: FNV-1a of the tensor name mixed with the user seed.
std::uint64_t name_seed(std::uint64_t seed, const std::string& name) {
  std::uint64_t h = 1469598103934665603ull;
  for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h ^ (seed * 0x9E3779B97F4A7C15ull);
}

std::size_t align_elems(std::size_t n) { return (n + 127) / 128 * 128; }  // 256-byte alignment for bf16

}  // namespace

struct Engine::Impl {
  Config cfg;
  EngineOptions opt;
  int max_rows = 0;  // rows of the activation buffers: max(max_batch, prefill_chunk)
  int num_sms = 0;
  replay::stream stream;
  cublasHandle_t cublas = nullptr;
  replay::device_buffer<std::byte> cublas_ws;

  // Weights (one allocation) and views into it.
  replay::device_buffer<bf16> weights;
  const bf16* embed = nullptr;
  const bf16* final_norm = nullptr;
  const bf16* lm_head = nullptr;
  std::vector<LayerWeights> layers;
  replay::device_buffer<float2> rope;  // [max_context][head_dim/2] (cos, sin)

  // Paged KV pool and its bookkeeping.
  replay::device_buffer<bf16> kv_pool;
  KvPool kv;
  std::optional<PagedKvBook> book;

  // Step metadata: rows [token | pos | slot], each max_rows long; the block tables.
  replay::step_meta_array<std::int32_t> row_meta;
  replay::device_buffer<std::int32_t> block_table;
  replay::pinned_buffer<std::int32_t> block_table_host;
  replay::event table_copied;
  bool table_copy_pending = false;
  RowMeta meta;

  // Activations (static, max_rows rows).
  replay::device_buffer<float> residual;  // [rows][H] fp32 residual stream
  replay::device_buffer<bf16> xn;         // [rows][H] normalised input of a GEMM
  replay::device_buffer<float> qkv;       // [rows][q_dim + 2 kv_dim]
  replay::device_buffer<bf16> attn;       // [rows][q_dim]
  replay::device_buffer<float> gu;        // [rows][2 I] gate | up (GEMM path)
  replay::device_buffer<bf16> act;        // [rows][I]
  replay::device_buffer<float> logits;    // [max_batch][V]
  replay::device_buffer<unsigned long long> keys;        // [rows] packed argmax
  replay::device_buffer<float> attn_partial;  // split-KV attention: partial softmax states (AttnSplit)
  replay::device_buffer<unsigned> attn_arrived;  // split-KV attention: chunks done per (row, kv head)
  int attn_min_chunk = kAttnMinChunk;
  replay::pinned_buffer<unsigned long long> keys_host;  // [rows]

  /// The streaming kernel's program of one bucket (1, 2 or 4 rows): phases, counters, launches.
  struct StreamProgram {
    replay::device_buffer<StreamPhase> phases;
    replay::device_buffer<unsigned> counters;  // [ticket, exited] per launch, then completed items per phase
    std::vector<StreamLaunch> launches;
    StreamGeometry geo;
    std::vector<int> kinds;                                // per phase: 0 embed, 1 QKV, 2 attention, 3 O, 4 gate/up, 5 down, 6 lm_head
    replay::device_buffer<unsigned long long> trace;       // per phase completion time (opt.stream_trace)
  };
  std::map<int, StreamProgram> programs;  // by bucket; empty for the legacy kernels

  /// The persistent kernel (mega.cuh) of bucket 1: its parameters, tagged activations, counters.
  replay::device_buffer<MegaLayer> mega_layers;
  replay::device_buffer<unsigned long long> mega_words;  // x | qkv | attn | act | attention partials (tagged words)
  replay::device_buffer<unsigned long long> mega_best;   // [grid] per-block argmax keys
  replay::device_buffer<unsigned> mega_sync;             // epoch, blocks exited
  replay::device_buffer<unsigned long long> mega_trace;  // QWEN_MEGA_TRACE=1: per block and phase stamps
  MegaParams mega;
  MegaGeometry mega_geo;
  bool mega_on = false;
  std::string mega_off_reason;  // why the persistent kernel does not serve bucket 1 (kernels mega)

  std::vector<int> buckets;
  /// The bucketed graph pool with eager fallback: one graph per bucket, captured on first use.
  std::optional<replay::step_runner<replay::graph_key>> runner;
  long long eager_steps = 0;

  ~Impl() {
    if (cublas != nullptr) (void)cublasDestroy(cublas);
  }

  // ---------------------------------------------------------------------------------------------
  void init(const replay_examples::safetensors* st) {
    cfg.validate();
    opt.validate(cfg);
    if (st != nullptr) check_weights(cfg, *st);
    // ---- GPU work starts here -----------------------------------------------------------------
    num_sms = replay_examples::sm_count();
    init_kernel_attributes();
    stream = replay::stream();
    QWEN_CUBLAS(cublasCreate(&cublas));
    cublas_ws = replay::device_buffer<std::byte>(32u << 20);
    QWEN_CUBLAS(cublasSetWorkspace(cublas, cublas_ws.data(), cublas_ws.size()));
    QWEN_CUBLAS(cublasSetMathMode(cublas, CUBLAS_DEFAULT_MATH));

    alloc_weights(st);
    const int H = cfg.hidden_size, I = cfg.intermediate_size, V = cfg.vocab_size;
    rope = replay::device_buffer<float2>(std::size_t(opt.max_context) * cfg.head_dim / 2);
    launch_rope_table(rope.data(), opt.max_context, cfg.head_dim, cfg.rope_theta, stream);

    const int nb = static_cast<int>(opt.kv_budget_bytes / kv_block_bytes(cfg, opt.block_size));
    const int width = (opt.max_context + opt.block_size - 1) / opt.block_size;
    book.emplace(nb, opt.block_size, opt.max_batch, width);
    kv.num_blocks = nb, kv.block_size = opt.block_size, kv.kv_heads = cfg.num_key_value_heads,
    kv.head_dim = cfg.head_dim;
    kv_pool = replay::device_buffer<bf16>(kv.layer_stride() * cfg.num_hidden_layers);
    kv.base = kv_pool.data();
    REPLAY_CHECK(cudaMemsetAsync(kv_pool.data(), 0, kv_pool.size_bytes(), stream.get()));

    max_rows = std::max(opt.max_batch, opt.prefill_chunk);
    row_meta = replay::step_meta_array<std::int32_t>(3 * std::size_t(max_rows));
    block_table = replay::device_buffer<std::int32_t>(book->table().size());
    block_table_host = replay::pinned_buffer<std::int32_t>(book->table().size());
    meta.token = row_meta.device();
    meta.pos = row_meta.device() + max_rows;
    meta.slot = row_meta.device() + 2 * max_rows;
    meta.block_table = block_table.data();
    meta.table_width = width;
    push_block_table();

    const std::size_t R = max_rows;
    residual = replay::device_buffer<float>(R * H);
    xn = replay::device_buffer<bf16>(R * H);
    qkv = replay::device_buffer<float>(R * cfg.qkv_dim());
    attn = replay::device_buffer<bf16>(R * cfg.q_dim());
    gu = replay::device_buffer<float>(R * 2 * I);
    act = replay::device_buffer<bf16>(R * I);
    logits = replay::device_buffer<float>(std::size_t(opt.max_batch) * V);
    keys = replay::device_buffer<unsigned long long>(R);
    keys_host = replay::pinned_buffer<unsigned long long>(R);
    // Split-KV scratch for the largest rows × splits any decode launch uses.
    std::size_t split_rows = 0;
    for (int r = 1; r <= max_rows; ++r)
      split_rows = std::max(split_rows, std::size_t(r) * attention_splits(r, cfg.num_attention_heads,
                                                                          cfg.num_key_value_heads, cfg.head_dim,
                                                                          num_sms));
    attn_partial = replay::device_buffer<float>(split_rows * cfg.num_key_value_heads * cfg.group_size() *
                                                (cfg.head_dim + 2));
    attn_arrived = replay::device_buffer<unsigned>(R * cfg.num_key_value_heads);
    REPLAY_CHECK(cudaMemsetAsync(attn_arrived.data(), 0, attn_arrived.size_bytes(), stream.get()));
    attn_min_chunk = attention_min_chunk();

    const int top = std::min(opt.max_bucket, opt.max_batch);
    replay::runner_options ro;
    ro.buckets = replay::bucket_policy::powers_of_two(static_cast<std::size_t>(top));
    ro.oversize = opt.eager_fallback ? replay::oversize_policy::eager : replay::oversize_policy::throw_error;
    ro.pool.warmup = 1;  // one eager run before capture (same inputs: rewrites the same K/V values)
    for (std::size_t b : ro.buckets.sizes()) buckets.push_back(static_cast<int>(b));
    build_programs();
    build_mega();
    runner.emplace([this](replay::stream_ref s, const replay::graph_key& k) { decode_kernels(int(k.bucket), s); },
                   std::move(ro));
    stream.synchronize();
  }

  void alloc_weights(const replay_examples::safetensors* st) {
    const std::size_t H = cfg.hidden_size, I = cfg.intermediate_size, D = cfg.head_dim, V = cfg.vocab_size;
    const std::size_t Q = cfg.q_dim(), KV = cfg.kv_dim(), QKV = cfg.qkv_dim();
    struct Piece {
      std::string name;   // HF tensor name (random init: seed source)
      std::size_t offset; // elements into `weights`
      std::size_t count;
      bool is_norm;
    };
    std::vector<Piece> pieces;
    std::size_t total = 0;
    auto place = [&](std::size_t n) {
      const std::size_t at = total;
      total += align_elems(n);
      return at;
    };
    auto add = [&](const std::string& name, std::size_t at, std::size_t n, bool norm) {
      pieces.push_back({name, at, n, norm});
    };
    const std::size_t embed_at = place(V * H);
    add("model.embed_tokens.weight", embed_at, V * H, false);
    std::vector<std::array<std::size_t, 8>> lay(cfg.num_hidden_layers);
    for (int i = 0; i < cfg.num_hidden_layers; ++i) {
      auto& o = lay[i];
      o[0] = place(QKV * H);
      add(lname(i, "self_attn.q_proj.weight"), o[0], Q * H, false);
      add(lname(i, "self_attn.k_proj.weight"), o[0] + Q * H, KV * H, false);
      add(lname(i, "self_attn.v_proj.weight"), o[0] + (Q + KV) * H, KV * H, false);
      o[1] = place(H * Q);
      add(lname(i, "self_attn.o_proj.weight"), o[1], H * Q, false);
      o[2] = place(2 * I * H);
      add(lname(i, "mlp.gate_proj.weight"), o[2], I * H, false);
      add(lname(i, "mlp.up_proj.weight"), o[2] + I * H, I * H, false);
      o[3] = place(H * I);
      add(lname(i, "mlp.down_proj.weight"), o[3], H * I, false);
      o[4] = place(H);
      add(lname(i, "input_layernorm.weight"), o[4], H, true);
      o[5] = place(H);
      add(lname(i, "post_attention_layernorm.weight"), o[5], H, true);
      o[6] = place(D);
      add(lname(i, "self_attn.q_norm.weight"), o[6], D, true);
      o[7] = place(D);
      add(lname(i, "self_attn.k_norm.weight"), o[7], D, true);
    }
    const std::size_t norm_at = place(H);
    add("model.norm.weight", norm_at, H, true);
    std::size_t head_at = embed_at;
    if (!cfg.tie_word_embeddings) {
      head_at = place(V * H);
      add("lm_head.weight", head_at, V * H, false);
    }
    weights = replay::device_buffer<bf16>(total);
    bf16* base = weights.data();
    for (const auto& p : pieces) {
      if (st != nullptr) {
        const auto& t = st->at(p.name);
        REPLAY_CHECK(cudaMemcpyAsync(base + p.offset, t.data, p.count * sizeof(bf16), cudaMemcpyHostToDevice,
                                     stream.get()),
                     "copying tensor {}", p.name);
      } else if (p.is_norm) {
        launch_fill_const(base + p.offset, p.count, 1.0f, stream);
      } else {
        // uniform(-a, a) has std a / sqrt(3)
        launch_fill_random(base + p.offset, p.count, name_seed(opt.seed, p.name), opt.init_std * 1.7320508f, stream);
      }
    }
    embed = base + embed_at;
    final_norm = base + norm_at;
    lm_head = base + head_at;
    for (int i = 0; i < cfg.num_hidden_layers; ++i) {
      const auto& o = lay[i];
      layers.push_back({base + o[0], base + o[1], base + o[2], base + o[3], base + o[4], base + o[5], base + o[6],
                        base + o[7]});
    }
    stream.synchronize();  // pageable source memory of the copies must stay mapped until done
  }

  // ---------------------------------------------------------------------------------------------
  // Streaming programs (stream.cuh)
  [[nodiscard]] bool streaming() const {
    return opt.kernels == decode_kernels::stream_phase || opt.kernels == decode_kernels::stream_layer ||
           opt.kernels == decode_kernels::stream_step;
  }

  void build_programs() {
    if (!streaming()) return;
    for (int b : buckets)
      if (b <= kGemvMaxRows && stream_supported(b, cfg.head_dim, cfg.group_size())) programs.emplace(b, build_program(b));
  }

  StreamProgram build_program(int rows) {
    const int H = cfg.hidden_size, I = cfg.intermediate_size, Q = cfg.q_dim(), QKV = cfg.qkv_dim(),
              V = cfg.vocab_size, L = cfg.num_hidden_layers;
    const float eps = static_cast<float>(cfg.rms_norm_eps);
    std::vector<StreamPhase> ph;
    std::size_t slot = stream_attention_scratch(cfg.head_dim, cfg.group_size());
    auto gemv = [&](const bf16* W, int N, int K, GemvIn in, gemv_out mode, float* yf, bf16* yb, int ldy,
                    unsigned long long* k) {
      StreamPhase p;
      p.kind = phase_kind::gemv;
      p.mode = mode;
      p.W = W, p.N = N, p.K = K, p.in = in, p.y_f32 = yf, p.y_bf16 = yb, p.ldy = ldy, p.keys = k;
      const bool pair = mode == gemv_out::silu_mul;
      p.rows = stream_rows_per_item(K, pair, opt.stream_tile_bytes);
      p.items = (N + p.rows - 1) / p.rows;
      slot = std::max(slot, std::size_t(p.rows) * K * 2 * (pair ? 2 : 1));
      ph.push_back(p);
    };
    StreamPhase e;
    e.kind = phase_kind::embed;
    e.items = 1;
    e.embed = embed, e.vocab = V, e.hidden = H, e.residual = residual.data(), e.keys = keys.data();
    ph.push_back(e);
    for (int l = 0; l < L; ++l) {
      const auto& w = layers[l];
      gemv(w.wqkv, QKV, H, GemvIn{nullptr, residual.data(), w.in_norm, eps}, gemv_out::store_f32, qkv.data(), nullptr,
           QKV, nullptr);
      StreamPhase a;
      a.kind = phase_kind::attention;
      a.items = rows * cfg.num_key_value_heads;
      a.qkv = qkv.data(), a.q_norm = w.q_norm, a.k_norm = w.k_norm, a.rope = rope.data(), a.eps = eps, a.layer = l;
      a.q_dim = Q, a.kv_dim = cfg.kv_dim(), a.out = attn.data();
      ph.push_back(a);
      gemv(w.wo, H, Q, GemvIn{attn.data(), nullptr, nullptr, eps}, gemv_out::add_f32, residual.data(), nullptr, H,
           nullptr);
      gemv(w.wgu, I, H, GemvIn{nullptr, residual.data(), w.post_norm, eps}, gemv_out::silu_mul, nullptr, act.data(), I,
           nullptr);
      gemv(w.wdown, H, I, GemvIn{act.data(), nullptr, nullptr, eps}, gemv_out::add_f32, residual.data(), nullptr, H,
           nullptr);
    }
    gemv(lm_head, V, H, GemvIn{nullptr, residual.data(), final_norm, eps}, gemv_out::argmax, logits.data(), nullptr, V,
         keys.data());
    const int P = static_cast<int>(ph.size());

    std::vector<std::pair<int, int>> groups;  // phases [first, second) per launch
    if (opt.kernels == decode_kernels::stream_step) {
      groups.push_back({0, P});
    } else if (opt.kernels == decode_kernels::stream_layer) {
      groups.push_back({0, 1});
      for (int l = 0; l < L; ++l) groups.push_back({1 + 5 * l, 6 + 5 * l});
      groups.push_back({P - 1, P});
    } else {
      for (int p = 0; p < P; ++p) groups.push_back({p, p + 1});
    }
    const int G = static_cast<int>(groups.size());
    StreamProgram prog;
    prog.kinds.push_back(0);
    for (int l = 0; l < L; ++l)
      for (int k = 1; k <= 5; ++k) prog.kinds.push_back(k);
    prog.kinds.push_back(6);
    if (opt.stream_trace) {
      prog.trace = replay::device_buffer<unsigned long long>(ph.size());
      REPLAY_CHECK(cudaMemset(prog.trace.data(), 0, prog.trace.size_bytes()));
    }
    prog.counters = replay::device_buffer<unsigned>(2 * std::size_t(G) + P);
    REPLAY_CHECK(cudaMemset(prog.counters.data(), 0, prog.counters.size_bytes()));
    std::vector<unsigned> totals;
    for (const auto& [g0, g1] : groups) {
      unsigned first = 0;
      for (int p = g0; p < g1; ++p) {
        ph[p].first = static_cast<int>(first);
        first += static_cast<unsigned>(ph[p].items);
        ph[p].wait = p > g0 ? p - 1 : -1;
        ph[p].wait_items = p > g0 ? ph[p - 1].items : 0;
        ph[p].signal = p + 1 < g1 ? 1 : 0;
      }
      totals.push_back(first);
    }
    prog.phases = replay::device_buffer<StreamPhase>(ph.size());
    REPLAY_CHECK(cudaMemcpy(prog.phases.data(), ph.data(), ph.size() * sizeof(StreamPhase), cudaMemcpyHostToDevice));
    const int max_k = std::max({H, Q, I});
    prog.geo = stream_geometry(rows, cfg.head_dim, cfg.group_size(), static_cast<int>(slot), max_k,
                               opt.stream_max_slots, num_sms);
    for (int g = 0; g < G; ++g) {
      StreamLaunch Lc;
      Lc.phases = prog.phases.data();
      Lc.p0 = groups[g].first, Lc.p1 = groups[g].second;
      Lc.total = totals[g];
      Lc.ctr = prog.counters.data() + 2 * g;
      Lc.done = prog.counters.data() + 2 * G;
      Lc.meta = meta;
      Lc.kv = kv;
      Lc.slot_bytes = prog.geo.slot_bytes;
      Lc.slots = prog.geo.slots;
      Lc.trace = opt.stream_trace ? prog.trace.data() : nullptr;
      prog.launches.push_back(Lc);
    }
    return prog;
  }

  void build_mega() {
    if (opt.kernels != decode_kernels::mega || !mega_supported(cfg.head_dim, cfg.group_size())) return;
    if (cfg.intermediate_size % 2 != 0) {  // act's half words are polled in pairs
      mega_off_reason = "odd intermediate size";
      return;
    }
    const int L = cfg.num_hidden_layers, H = cfg.hidden_size, I = cfg.intermediate_size, Q = cfg.q_dim();
    std::vector<MegaLayer> ml(L);
    for (int l = 0; l < L; ++l) {
      const auto& w = layers[l];
      ml[l] = MegaLayer{w.wqkv, w.wo, w.wgu, w.wdown, w.in_norm, w.post_norm, w.q_norm, w.k_norm};
    }
    mega_layers = replay::device_buffer<MegaLayer>(ml.size());
    REPLAY_CHECK(cudaMemcpy(mega_layers.data(), ml.data(), ml.size() * sizeof(MegaLayer), cudaMemcpyHostToDevice));
    const int splits = opt.mega_attn_splits > 0
                           ? opt.mega_attn_splits
                           : mega_attention_splits(cfg.num_key_value_heads, cfg.group_size(), num_sms);
    const int part_splits = mega_part_splits(splits, cfg.group_size());  // (items of two query heads: more)
    const std::size_t part_words =
        part_splits > 1 ? std::size_t(cfg.num_attention_heads) * part_splits * (cfg.head_dim + 2) : 0;
    // x and qkv as 64-bit words, attn and act as 32-bit half words (Q + I of them, rounded up to
    // whole 64-bit words), then the partial states.
    const std::size_t half_words = (std::size_t(Q) + I + 1) / 2;
    const std::size_t words = std::size_t(H) + cfg.qkv_dim() + half_words + part_words;
    mega_words = replay::device_buffer<unsigned long long>(words);
    REPLAY_CHECK(cudaMemset(mega_words.data(), 0, mega_words.size_bytes()));  // tag 0: never a step's tag
    mega_best = replay::device_buffer<unsigned long long>(num_sms);
    mega_sync = replay::device_buffer<unsigned>(2);
    REPLAY_CHECK(cudaMemset(mega_sync.data(), 0, mega_sync.size_bytes()));
    MegaParams& p = mega;
    p.layers = mega_layers.data();
    p.num_layers = L;
    p.hidden = H, p.q_dim = Q, p.kv_dim = cfg.kv_dim(), p.intermediate = I, p.vocab = cfg.vocab_size;
    p.eps = static_cast<float>(cfg.rms_norm_eps);
    p.embed = embed, p.lm_head = lm_head, p.final_norm = final_norm, p.rope = rope.data();
    p.meta = meta;
    p.kv = kv;
    p.x = mega_words.data();
    p.qkv = p.x + H;
    p.attn = reinterpret_cast<unsigned*>(p.qkv + cfg.qkv_dim());
    p.act = p.attn + Q;
    p.attn_part = part_words > 0 ? p.qkv + cfg.qkv_dim() + half_words : nullptr;
    p.attn_splits = splits;
    p.attn_min_chunk = opt.mega_attn_min_chunk;
    p.attn_heads = opt.mega_attn_heads;
    // Tensor-core rows need every matrix width to be a multiple of 256 (else the FMA rows).
    p.mma = opt.mega_mma && H % 256 == 0 && Q % 256 == 0 && I % 256 == 0 ? 1 : 0;
    // Tiles of rows on the tensor cores where the shapes allow them, else one row at a time.
    p.tiles = p.mma != 0 && opt.mega_tiles && mega_tiles_fit(p) ? 1 : 0;
    p.logits = logits.data();
    p.keys = keys.data();
    p.block_best = mega_best.data();
    p.sync = mega_sync.data();
    if (const char* t = std::getenv("QWEN_MEGA_TRACE"); t != nullptr && std::atoi(t) != 0) {
      if (!mega_trace_built()) {
        fmt::print(stderr, "qwen: QWEN_MEGA_TRACE=1 ignored: the persistent kernel was built without its trace "
                           "(configure with -DQWEN_MEGA_TRACE=ON)\n");
      } else {
        mega_trace = replay::device_buffer<unsigned long long>(std::size_t(num_sms) * (5 * L + 2) * kMegaMarks);
        REPLAY_CHECK(cudaMemset(mega_trace.data(), 0, mega_trace.size_bytes()));
        p.trace = mega_trace.data();
      }
    }
    // The geometry's choice of weights per slot; QWEN_MEGA_PIECE=n forces n with tensor-core rows one
    // at a time, not tiles (diagnostics; the FMA rows and tiles take 2048).
    p.piece = 0;
    if (const char* e = std::getenv("QWEN_MEGA_PIECE"); e != nullptr && std::atoi(e) > 0 && p.mma != 0)
      p.piece = std::atoi(e), p.tiles = 0;
    // QWEN_MEGA_SERIAL_ISSUE=1: the producer lanes issue one at a time (for racecheck; slower).
    if (const char* e = std::getenv("QWEN_MEGA_SERIAL_ISSUE"); e != nullptr && std::atoi(e) > 0) p.serial_issue = 1;
    // Tiles: the producer's pause after issuing and the weights per slot, per device
    // (mega_device_tuning); QWEN_MEGA_PACE=n: n ns, QWEN_MEGA_TILE_PIECE=n: n weights per slot, 2048,
    // 2560 or 5120 (diagnostics).
    if (p.tiles != 0) {
      int dev = 0;
      REPLAY_CHECK(cudaGetDevice(&dev));
      const MegaTuning tune = mega_device_tuning(dev, cfg.hidden_size);
      p.pace_ns = tune.pace_ns;
      p.piece = tune.tile_piece;
      if (const char* e = std::getenv("QWEN_MEGA_PACE"); e != nullptr) p.pace_ns = std::max(0, std::atoi(e));
      if (const char* e = std::getenv("QWEN_MEGA_TILE_PIECE"); e != nullptr && std::atoi(e) > 0) p.piece = std::atoi(e);
    }
    try {
      mega_geo = mega_geometry(p, cfg.head_dim, cfg.group_size(), env_slots(), num_sms);
    } catch (const replay::usage_error& e) {  // e.g. too little shared memory: the ring kernels serve bucket 1
      mega_off_reason = e.what();
      mega_layers.reset(), mega_words.reset(), mega_best.reset(), mega_sync.reset(), mega_trace.reset();
      return;
    }
    p.slots = mega_geo.slots;
    p.piece = mega_geo.piece;
    mega_on = true;
  }
  /// The persistent kernel's trace of the last step: per phase kind, medians over layers of the gap
  /// between phase completions, of when blocks had their input staged after the previous phase
  /// completed, and of the blocks' time on their rows.
  [[nodiscard]] std::string mega_trace_summary() const {
    if (mega_trace.size() == 0) return {};
    const int L = cfg.num_hidden_layers, P = 5 * L + 2, grid = mega_geo.grid;
    std::vector<unsigned long long> t(mega_trace.size());
    REPLAY_CHECK(cudaMemcpy(t.data(), mega_trace.data(), mega_trace.size_bytes(), cudaMemcpyDeviceToHost));
    auto at = [&](int b, int ph, int w) { return static_cast<double>(t[(std::size_t(b) * P + ph) * kMegaMarks + w]) * 1e-3; };
    std::vector<double> done(P, 0.0);
    double start = 1e300;
    for (int b = 0; b < grid; ++b)
      if (at(b, 1, 0) > 0) start = std::min(start, at(b, 1, 0));
    done[0] = start;
    static const char* names[] = {"qkv", "attention", "o", "gate/up", "down", "lm_head"};
    std::vector<std::vector<double>> gap(6), staged(6), staged_max(6), rows(6), rows_max(6), waits(6), waited(6);
    std::vector<std::vector<double>> cyc_wait(6), cyc_math(6), cyc_epi(6);  // QWEN_MEGA_PROF builds
    std::vector<double> own, pass, shared;  // attention after staging: own chunk done, pass done, state shared
    auto median = [](std::vector<double> v) {
      if (v.empty()) return 0.0;
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    for (int ph = 1; ph < P; ++ph) {
      const int kind = ph == P - 1 ? 5 : (ph - 1) % 5;
      std::vector<double> st, rw, ow, pa, sh;
      for (int b = 0; b < grid; ++b) {
        if (at(b, ph, 1) <= 0) continue;
        done[ph] = std::max(done[ph], at(b, ph, 2));
        st.push_back(at(b, ph, 1) - done[ph - 1]);
        rw.push_back(at(b, ph, 2) - at(b, ph, 1));
        if (kind != 1) {  // GEMV: ring slots found empty, and the time waited for them (all warps)
          waits[kind].push_back(static_cast<double>(t[(std::size_t(b) * P + ph) * kMegaMarks + 4]));
          waited[kind].push_back(at(b, ph, 3) / kMegaWarps);
          if (const double c = 1e3 / kMegaWarps; at(b, ph, 6) > 0)  // SM cycles per warp (at(): 1e-3)
            cyc_wait[kind].push_back(at(b, ph, 5) * c), cyc_math[kind].push_back(at(b, ph, 6) * c),
                cyc_epi[kind].push_back(at(b, ph, 7) * c);
        }
        if (kind == 1 && at(b, ph, 3) > 0) {
          ow.push_back(at(b, ph, 3) - at(b, ph, 1));
          pa.push_back(at(b, ph, 4) - at(b, ph, 1));
          sh.push_back(at(b, ph, 5) - at(b, ph, 1));
        }
      }
      if (!ow.empty()) own.push_back(median(ow)), pass.push_back(median(pa)), shared.push_back(median(sh));
      if (st.empty()) {
        done[ph] = done[ph - 1];
        continue;
      }
      gap[kind].push_back(done[ph] - done[ph - 1]);
      staged[kind].push_back(median(st));
      staged_max[kind].push_back(*std::max_element(st.begin(), st.end()));
      rows[kind].push_back(median(rw));
      rows_max[kind].push_back(*std::max_element(rw.begin(), rw.end()));
    }
    std::string s = fmt::format("mega trace (last step): first phase entry -> lm_head done {:.1f} us", done[P - 1] - start);
    for (int k = 0; k < 6; ++k) {
      if (gap[k].empty()) continue;
      double sum = 0;
      for (double x : gap[k]) sum += x;
      s += fmt::format("\n  {:9}: gap median {:6.2f} us (sum {:7.1f}); input staged after {:5.2f} (slowest block {:5.2f}); "
                       "rows {:5.2f} (slowest {:5.2f})",
                       names[k], median(gap[k]), sum, median(staged[k]), median(staged_max[k]), median(rows[k]),
                       median(rows_max[k]));
      if (k != 1 && !waits[k].empty()) {
        double w = 0, ns = 0;
        for (double x : waits[k]) w += x;
        for (double x : waited[k]) ns += x;
        s += fmt::format("\n             (ring slots found empty: {:.1f} per block and phase; {:.2f} us waited per warp)",
                         w / waits[k].size(), ns / waited[k].size());
      }
      if (!cyc_math[k].empty())
        s += fmt::format("\n             (rows, SM cycles per warp: slot waits {:.0f}, arithmetic {:.0f}, "
                         "epilogues {:.0f})",
                         median(cyc_wait[k]), median(cyc_math[k]), median(cyc_epi[k]));
      if (k == 1 && !own.empty())
        s += fmt::format("\n             (attention, after staging: pass over the positions done {:5.2f} us, cross-warp "
                         "state shared {:5.2f}, own chunk written {:5.2f}; the rest merges the chunks)",
                         median(pass), median(shared), median(own));
    }
    // Balance over blocks: each block's rows time per GEMV kind, relative to the phase's median block,
    // averaged over layers; and how often the slowest tenth of blocks of one layer is among the slowest
    // tenth of the next (1: the same SMs are slow every layer; 0.1: chance).
    auto slowest_first = [grid](const std::vector<double>& v) {  // block indices, largest value first
      std::vector<int> order(grid);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int a, int b) { return v[a] > v[b]; });
      return order;
    };
    for (int k : {0, 2, 3, 4}) {
      std::vector<double> rel(grid, 0.0);
      std::vector<std::vector<int>> slow;
      int layers_seen = 0;
      for (int ph = 1; ph < P - 1; ++ph) {
        if ((ph - 1) % 5 != k) continue;
        std::vector<double> rw(grid, 0.0);
        for (int b = 0; b < grid; ++b) rw[b] = at(b, ph, 1) > 0 ? at(b, ph, 2) - at(b, ph, 1) : 0.0;
        const double med = median(rw);
        if (med <= 0) continue;
        ++layers_seen;
        for (int b = 0; b < grid; ++b) rel[b] += rw[b] / med;
        std::vector<int> order = slowest_first(rw);
        order.resize(std::max(1, grid / 10));
        slow.push_back(order);
      }
      if (layers_seen == 0) continue;
      for (double& r : rel) r /= layers_seen;
      double again = 0;
      for (std::size_t i = 1; i < slow.size(); ++i)
        for (int b : slow[i])
          again += std::count(slow[i - 1].begin(), slow[i - 1].end(), b) ? 1.0 : 0.0;
      if (slow.size() > 1) again /= double(slow.size() - 1) * slow[0].size();
      const std::vector<int> order = slowest_first(rel);
      std::string sl;
      for (int i = 0; i < std::min(grid, 12); ++i)
        sl += fmt::format(" {}/sm{}:{:.3f}", order[i], static_cast<long long>(t[std::size_t(order[i]) * P * kMegaMarks]) - 1,
                          rel[order[i]]);
      std::vector<double> sorted = rel;
      std::sort(sorted.begin(), sorted.end());
      s += fmt::format("\n  balance {:9}: block rows / median, mean over layers: min {:.3f} p10 {:.3f} p90 {:.3f} max {:.3f}; "
                       "slowest tenth again next layer {:.2f}; slowest (block/sm:ratio){}",
                       names[k], sorted.front(), sorted[grid / 10], sorted[grid - 1 - grid / 10], sorted.back(), again, sl);
    }
    return s + "\n";
  }

  /// QWEN_MEGA_SLOTS caps the persistent kernel's ring slots per warp (diagnostics; default 16).
  static int env_slots() {
    const char* e = std::getenv("QWEN_MEGA_SLOTS");
    return e != nullptr ? std::max(2, std::atoi(e)) : 16;
  }

  [[nodiscard]] std::string describe_kernels() const {
    std::string s = fmt::format("decode kernels {}", decode_kernels_name(opt.kernels));
    if (opt.kernels == decode_kernels::mega)
      return mega_on ? s + fmt::format(" (bucket 1: one launch, grid {}, {} ring slots of {} KiB per warp, smem {} KiB, "
                                       "attention items of {} in up to {} chunks of at least {} positions, rows on {}, producer pause {} ns, "
                                       "{} words in flight per thread while staging; other buckets: ring)",
                                       mega_geo.grid, mega_geo.slots, mega_geo.slot_bytes / 1024, mega_geo.smem / 1024.0,
                                       cfg.group_size() < 2 || mega.attn_heads == 1 ? "1 query head"
                                       : mega.attn_heads == 2                       ? "2 query heads"
                                                                                    : "1 query head (2 where that splits a long context finer)",
                                       mega.attn_splits, mega.attn_min_chunk, mega.tiles != 0 ? fmt::format("tensor cores, tiles of 2 rows x {} weights", mega_geo.piece / 2)
                                       : mega.mma != 0 ? std::string("tensor cores")
                                                       : std::string("FMAs"),
                                       mega.pace_ns, mega_geo.poll_batch)
                     : s + fmt::format(" ({}: ring kernels)", mega_off_reason.empty()
                                                                  ? std::string("shape not supported by the persistent kernel")
                                                                  : mega_off_reason);
    if (!streaming())
      return s + (opt.kernels == decode_kernels::legacy_u8 || opt.kernels == decode_kernels::rowpipe_u8
                      ? " (8 loads in flight)"
                      : "");
    if (programs.empty()) return s + " (shape not supported by the streaming kernel: legacy kernels)";
    for (const auto& [b, p] : programs)
      s += fmt::format("; bucket {}: {} launch(es), grid {}, {} slots x {} KiB, smem {} KiB", b, p.launches.size(),
                       p.geo.grid, p.geo.slots, p.geo.slot_bytes / 1024.0, p.geo.smem / 1024.0);
    return s;
  }

  // ---------------------------------------------------------------------------------------------
  // Metadata
  void push_block_table() {
    auto [b, e] = book->dirty();
    if (b == e) return;
    if (table_copy_pending) table_copied.synchronize();  // never overwrite staging still being read
    std::memcpy(block_table_host.data() + b, book->table().data() + b, std::size_t(e - b) * sizeof(std::int32_t));
    REPLAY_CHECK(cudaMemcpyAsync(block_table.data() + b, block_table_host.data() + b,
                                 std::size_t(e - b) * sizeof(std::int32_t), cudaMemcpyHostToDevice, stream.get()));
    table_copied.record(stream);
    table_copy_pending = true;
    book->clear_dirty();
  }

  /// Stages rows (padding rows point at the scratch slot, token 0, position 0) and pushes metadata.
  void stage_and_push(std::span<const DecodeRow> rows, int padded) {
    auto st = row_meta.staging();
    for (int r = 0; r < max_rows; ++r) {
      const bool real = r < static_cast<int>(rows.size());
      st[r] = real ? rows[r].token : 0;
      st[max_rows + r] = real ? rows[r].pos : 0;
      st[2 * max_rows + r] = real ? rows[r].slot : book->scratch_slot();
    }
    (void)padded;
    push_block_table();
    row_meta.push(stream);
  }

  // ---------------------------------------------------------------------------------------------
  // Building blocks
  void gemm(const bf16* W, int N, int K, const bf16* X, int rows, float* Y, int ldy, float beta, replay::stream_ref s) {
    const float alpha = 1.0f;
    QWEN_CUBLAS(cublasSetStream(cublas, s.get()));
    QWEN_CUBLAS(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, N, rows, K, &alpha, W, CUDA_R_16BF, K, X, CUDA_R_16BF,
                             K, &beta, Y, CUDA_R_32F, ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }

  /// Decode attention's split-KV setting for a bucket of `rows` rows (prefill: none).
  [[nodiscard]] AttnSplit attn_split(int rows, bool decode) const {
    if (!decode) return {};
    return {attention_splits(rows, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, num_sms),
            attn_min_chunk, attn_partial.data(),
            attn_arrived.data()};
  }

  /// The decoder layers on `rows` rows through the GEMM path. decode: K/V written inside attention
  /// (one row per sequence); prefill: written for all rows first (rows of one sequence read each other).
  void layers_gemm(int rows, bool decode, replay::stream_ref s) {
    const int H = cfg.hidden_size, I = cfg.intermediate_size, Q = cfg.q_dim(), QKV = cfg.qkv_dim();
    const float eps = static_cast<float>(cfg.rms_norm_eps);
    for (int l = 0; l < cfg.num_hidden_layers; ++l) {
      const auto& w = layers[l];
      launch_rmsnorm(residual.data(), w.in_norm, H, eps, rows, xn.data(), s);
      gemm(w.wqkv, QKV, H, xn.data(), rows, qkv.data(), QKV, 0.f, s);
      if (!decode) launch_kv_write(qkv.data(), cfg.num_attention_heads, w.k_norm, eps, rope.data(), meta, rows, kv, l, s);
      launch_attention(qkv.data(), cfg.num_attention_heads, w.q_norm, w.k_norm, eps, rope.data(), meta, rows, kv, l,
                       decode, attn_split(rows, decode), attn.data(), s);
      gemm(w.wo, H, Q, attn.data(), rows, residual.data(), H, 1.f, s);
      launch_rmsnorm(residual.data(), w.post_norm, H, eps, rows, xn.data(), s);
      gemm(w.wgu, 2 * I, H, xn.data(), rows, gu.data(), 2 * I, 0.f, s);
      launch_silu_mul(gu.data(), I, rows, act.data(), s);
      gemm(w.wdown, H, I, act.data(), rows, residual.data(), H, 1.f, s);
    }
  }

  /// The whole decode step for a bucket of `rows` rows: every launch reads per-step values from meta.
  void decode_kernels(int rows, replay::stream_ref s) {
    const int H = cfg.hidden_size, I = cfg.intermediate_size, Q = cfg.q_dim(), QKV = cfg.qkv_dim(),
              V = cfg.vocab_size;
    const float eps = static_cast<float>(cfg.rms_norm_eps);
    set_gemv_loads(opt.kernels == decode_kernels::legacy_u8 || opt.kernels == decode_kernels::rowpipe_u8 ? 8 : 4);
    set_gemv_rowpipe(opt.kernels == decode_kernels::rowpipe || opt.kernels == decode_kernels::rowpipe_u8 ||
                     opt.kernels == decode_kernels::ring || opt.kernels == decode_kernels::mega);
    set_gemv_ring(opt.kernels == decode_kernels::ring || opt.kernels == decode_kernels::mega);
    ring_trace_begin_step();
    if (mega_on && rows == 1) {
      launch_mega(mega, cfg.head_dim, cfg.group_size(), mega_geo, s);
      return;
    }
    if (auto it = programs.find(rows); it != programs.end()) {
      for (const auto& Lc : it->second.launches)
        launch_stream(Lc, rows, cfg.head_dim, cfg.group_size(), it->second.geo, s);
      return;
    }
    launch_embed(embed, V, H, meta, rows, residual.data(), keys.data(), s);
    if (rows <= kGemvMaxRows) {
      for (int l = 0; l < cfg.num_hidden_layers; ++l) {
        const auto& w = layers[l];
        launch_gemv(w.wqkv, QKV, H, rows, GemvIn{nullptr, residual.data(), w.in_norm, eps}, gemv_out::store_f32,
                    qkv.data(), nullptr, QKV, nullptr, num_sms, s);
        launch_attention(qkv.data(), cfg.num_attention_heads, w.q_norm, w.k_norm, eps, rope.data(), meta, rows, kv, l,
                         true, attn_split(rows, true), attn.data(), s);
        launch_gemv(w.wo, H, Q, rows, GemvIn{attn.data(), nullptr, nullptr, eps}, gemv_out::add_f32, residual.data(),
                    nullptr, H, nullptr, num_sms, s);
        launch_gemv(w.wgu, I, H, rows, GemvIn{nullptr, residual.data(), w.post_norm, eps}, gemv_out::silu_mul, nullptr,
                    act.data(), I, nullptr, num_sms, s);
        launch_gemv(w.wdown, H, I, rows, GemvIn{act.data(), nullptr, nullptr, eps}, gemv_out::add_f32, residual.data(),
                    nullptr, H, nullptr, num_sms, s);
      }
      launch_gemv(lm_head, V, H, rows, GemvIn{nullptr, residual.data(), final_norm, eps}, gemv_out::argmax,
                  logits.data(), nullptr, V, keys.data(), num_sms, s);
    } else {
      layers_gemm(rows, true, s);
      launch_rmsnorm(residual.data(), final_norm, H, eps, rows, xn.data(), s);
      gemm(lm_head, V, H, xn.data(), rows, logits.data(), V, 0.f, s);
      launch_argmax(logits.data(), V, rows, keys.data(), s);
    }
  }

  int bucket_for(int n) const {
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
};

// -------------------------------------------------------------------------------------------------

Engine::Engine(const Config& cfg, const EngineOptions& opt, const replay_examples::safetensors* weights)
    : impl_(std::make_unique<Impl>()) {
  impl_->cfg = cfg;
  impl_->opt = opt;
  impl_->init(weights);
}
Engine::~Engine() = default;
Engine::Engine(Engine&&) noexcept = default;
Engine& Engine::operator=(Engine&&) noexcept = default;

const Config& Engine::config() const { return impl_->cfg; }
const EngineOptions& Engine::options() const { return impl_->opt; }
PagedKvBook& Engine::kv() { return *impl_->book; }
replay::stream_ref Engine::stream() const { return impl_->stream; }
const std::vector<int>& Engine::buckets() const { return impl_->buckets; }
int Engine::bucket_for(int rows) const { return impl_->bucket_for(rows); }
GraphStats Engine::graph_stats() const {
  const auto& m = *impl_;
  const replay::pool_stats ps = m.runner->stats();
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
replay::pool_stats Engine::pool_stats() const { return impl_->runner->stats(); }
std::string Engine::describe_kernels() const { return impl_->describe_kernels(); }

std::string Engine::stream_trace_summary(int bucket) const {
  const auto& m = *impl_;
  if (m.mega_on && bucket == 1) return m.mega_trace_summary();
  auto it = m.programs.find(bucket);
  if (it == m.programs.end() || it->second.trace.size() == 0) return {};
  const auto& prog = it->second;
  std::vector<unsigned long long> t(prog.trace.size());
  REPLAY_CHECK(cudaMemcpy(t.data(), prog.trace.data(), prog.trace.size_bytes(), cudaMemcpyDeviceToHost));
  static const char* names[] = {"embed", "qkv", "attention", "o", "gate/up", "down", "lm_head"};
  std::vector<std::vector<double>> d(7);
  for (std::size_t p = 1; p < t.size(); ++p)
    d[prog.kinds[p]].push_back(static_cast<double>(static_cast<long long>(t[p] - t[p - 1])) * 1e-3);
  std::string s = fmt::format("phase completion gaps (last step, bucket {}): embed -> lm_head done {:.1f} us", bucket,
                              static_cast<double>(static_cast<long long>(t.back() - t.front())) * 1e-3);
  for (int k = 1; k <= 6; ++k) {
    auto v = d[k];
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    double sum = 0;
    for (double x : v) sum += x;
    s += fmt::format("; {}: median {:.2f} us, min {:.2f}, max {:.2f}, sum {:.1f}", names[k], v[v.size() / 2], v.front(),
                     v.back(), sum);
  }
  return s;
}
std::size_t Engine::weight_bytes() const { return impl_->weights.size_bytes(); }
std::size_t Engine::kv_pool_bytes() const { return impl_->kv_pool.size_bytes(); }
std::size_t Engine::buffer_bytes() const {
  const auto& m = *impl_;
  return m.residual.size_bytes() + m.xn.size_bytes() + m.qkv.size_bytes() + m.attn.size_bytes() + m.gu.size_bytes() +
         m.act.size_bytes() + m.logits.size_bytes() + m.keys.size_bytes() + m.rope.size_bytes() +
         m.block_table.size_bytes() + m.cublas_ws.size_bytes() + 3 * sizeof(std::int32_t) * m.max_rows +
         m.attn_partial.size_bytes() + m.attn_arrived.size_bytes() + m.mega_layers.size_bytes() +
         m.mega_words.size_bytes() + m.mega_best.size_bytes() + m.mega_sync.size_bytes() + m.mega_trace.size_bytes();
}

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
  const int H = m.cfg.hidden_size, V = m.cfg.vocab_size;
  const float eps = static_cast<float>(m.cfg.rms_norm_eps);
  std::vector<DecodeRow> rows;
  int last = 0;
  for (int c0 = 0; c0 < n; c0 += m.opt.prefill_chunk) {
    const int c = std::min(m.opt.prefill_chunk, n - c0);
    rows.clear();
    for (int r = 0; r < c; ++r) rows.push_back({slot, tokens[c0 + r], start + c0 + r});
    m.stage_and_push(rows, c);
    launch_embed(m.embed, V, H, m.meta, c, m.residual.data(), m.keys.data(), m.stream);
    m.layers_gemm(c, false, m.stream);
    last = c - 1;
  }
  // Head on the last prompt row only.
  launch_rmsnorm(m.residual.data() + std::size_t(last) * H, m.final_norm, H, eps, 1, m.xn.data(), m.stream);
  m.gemm(m.lm_head, V, H, m.xn.data(), 1, m.logits.data(), V, 0.f, m.stream);
  launch_argmax(m.logits.data(), V, 1, m.keys.data(), m.stream);
  REPLAY_CHECK(cudaMemcpyAsync(m.keys_host.data(), m.keys.data(), sizeof(unsigned long long), cudaMemcpyDeviceToHost,
                               m.stream.get()));
  if (!logits.empty())
    REPLAY_CHECK(cudaMemcpyAsync(logits.data(), m.logits.data(), std::size_t(V) * sizeof(float),
                                 cudaMemcpyDeviceToHost, m.stream.get()));
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
  m.stage_and_push(rows, bucket);       // padded rows: scratch slot, token 0, position 0
  auto key = [](std::size_t b) { return replay::graph_key{.bucket = static_cast<std::uint32_t>(b)}; };
  if (use_graph) {
    (void)m.runner->run_batch(static_cast<std::size_t>(n), m.stream, key);
  } else {
    m.decode_kernels(bucket, m.stream);  // the same launches, issued directly
    ++m.eager_steps;
  }
  REPLAY_CHECK(cudaMemcpyAsync(m.keys_host.data(), m.keys.data(), std::size_t(n) * sizeof(unsigned long long),
                               cudaMemcpyDeviceToHost, m.stream.get()));
  if (!logits.empty())
    REPLAY_CHECK(cudaMemcpyAsync(logits.data(), m.logits.data(), std::size_t(n) * m.cfg.vocab_size * sizeof(float),
                                 cudaMemcpyDeviceToHost, m.stream.get()));
  m.stream.synchronize();
  for (int i = 0; i < n; ++i) next[i] = key_to_token(m.keys_host[i]);
}

void Engine::prewarm_graphs(int max_rows) {
  auto& m = *impl_;
  std::vector<replay::graph_key> keys;
  for (int b : m.buckets)
    if (b <= max_rows) keys.push_back({.bucket = static_cast<std::uint32_t>(b)});
  m.stage_and_push({}, max_rows);  // warm-up runs read metadata: all rows padding (scratch slot)
  (void)m.runner->prewarm(keys, m.stream);
}

}  // namespace qwen
