// nanogpt/model.cu: the Model (model.hpp): it owns the weights, the decode step's weight image,
// the activations and the static KV cache (one frozen arena), the step metadata, the pinned token
// slot and the graphs; it issues prefill, eager and graph steps and the device loop, and keeps the
// host's prediction of the metadata the device holds; and the decode step's weight image, built
// here on the host. generate() and generate_looped() drive the Model. The kernels are in
// decode_step.cu and prefill.cu.
#include "model.hpp"

#include "kernels.cuh"

#include "common/timing.hpp"

#include <replay/replay.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace nanogpt {
namespace {

using namespace detail;

/// The launches of a Model: its parameters, buffers and metadata, and its launch settings.
struct Launcher {
  const ModelParams& p;
  const Buffers& b;
  const StageImage* image;  // device copy of the decode step's shared-memory image
  const StepMeta* meta;     // device address of the step metadata
  ModelOptions opt;
  /// The device loop (capture_loop_graph): the sampler appends its token there instead of handing
  /// it to the host. Null otherwise.
  replay::token_loop_ref loop{};

  /// One decode step: one kernel, what eager mode launches and graph mode captures. `chained`: the
  /// step follows another step in the same graph (the device loop's body), so it is launched with
  /// PDL and stages its weights while the previous step runs.
  void decode_step(cudaStream_t s, bool chained = false) const {
    launch_decode_step(image, meta, b, loop, chained ? opt.pdl : kPdlFirst, s);
  }

  /// Prefill of `rows` prompt tokens (eager only).
  void prefill(cudaStream_t s, int rows) const { launch_prefill(p, meta, b, rows, opt.pdl, s); }
};

/// The StageImage of `w` (host side, once per Model): LayerNorms folded into the linear layer
/// after them (in double), matrices swizzled as decode_step_kernel reads them.
std::unique_ptr<StageImage> make_stage_image(const Weights& w) {
  auto img = std::make_unique<StageImage>();
  std::memset(img.get(), 0, sizeof(StageImage));
  const auto t = [&](const std::string& name) { return w.tensor(name); };
  // Rows of `m` ([rows][cols], cols = 4 * chunks) scaled by gamma (if any), swizzled; the per-row
  // constants sum_j m[r][j] * beta[j] + bias[r] into c (if any).
  const auto put = [](float4* dst, int chunks, std::span<const float> m, int rows, std::span<const float> gamma,
                      std::span<const float> beta, std::span<const float> bias, float* c) {
    const int cols = 4 * chunks;
    for (int r = 0; r < rows; ++r) {
      double acc = bias.empty() ? 0.0 : bias[static_cast<std::size_t>(r)];
      float row[C::ffn_hidden];
      for (int j = 0; j < cols; ++j) {
        const float v = m[static_cast<std::size_t>(r * cols + j)];
        row[j] = gamma.empty() ? v : v * gamma[static_cast<std::size_t>(j)];
        if (!beta.empty()) acc += static_cast<double>(v) * beta[static_cast<std::size_t>(j)];
      }
      for (int q = 0; q < chunks; ++q)
        dst[r * chunks + (q ^ (r & 7))] = make_float4(row[4 * q], row[4 * q + 1], row[4 * q + 2], row[4 * q + 3]);
      if (c != nullptr) c[r] = static_cast<float>(acc);
    }
  };
  const std::span<const float> none;
  std::copy_n(t("token_embedding_table.weight").data(), C::vocab_size * C::n_embd, &img->tok_emb[0][0]);
  std::copy_n(t("position_embedding_table.weight").data(), C::block_size * C::n_embd, &img->pos_emb[0][0]);
  for (int l = 0; l < C::n_layer; ++l) {
    const auto n = [&](std::string_view leaf) { return t(fmt::format("blocks.{}.{}", l, leaf)); };
    AttnStage& a = img->layer[l].attn;
    put(&a.qkv[0][0], C::n_embd / 4, n("sa.qkv.weight"), 3 * C::n_embd, n("ln1.weight"), n("ln1.bias"), none, a.qkv_c);
    put(&a.proj[0][0], C::n_embd / 4, n("sa.attn_proj.weight"), C::n_embd, none, none, none, nullptr);
    std::copy_n(n("sa.attn_proj.bias").data(), C::n_embd, a.proj_b);
    FfnStage& f = img->layer[l].ffn;
    put(&f.fc1[0][0], C::n_embd / 4, n("ffwd.net.0.weight"), C::ffn_hidden, n("ln2.weight"), n("ln2.bias"),
        n("ffwd.net.0.bias"), f.fc1_c);
    put(&f.fc2[0][0], C::ffn_hidden / 4, n("ffwd.net.2.weight"), C::n_embd, none, none, none, nullptr);
    std::copy_n(n("ffwd.net.2.bias").data(), C::n_embd, f.fc2_b);
  }
  put(&img->head.w[0][0], C::n_embd / 4, t("lm_head.weight"), C::vocab_size, t("ln_f.weight"), t("ln_f.bias"),
      t("lm_head.bias"), img->head.c);
  return img;
}

}  // namespace

std::string require_device() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw no_device_error(fmt::format("no usable CUDA device ({}: {})", cudaGetErrorName(err),
                                      cudaGetErrorString(err)));
  }
  if (count == 0) throw no_device_error("no CUDA device found");
  cudaDeviceProp prop{};
  REPLAY_CHECK(cudaGetDeviceProperties(&prop, 0));
  return prop.name;
}

struct Model::Impl {
  ModelOptions options;
  replay::stream stream;
  replay::device_buffer<float> params_mem;           // all parameters, packed (weights.hpp)
  ModelParams params{};
  replay::device_buffer<StageImage> stage_image;     // the decode step's weights (make_stage_image)
  replay::static_arena arena;                        // activations + KV cache, frozen
  Buffers buffers{};
  replay::step_meta<StepMeta> meta;                  // token, pos, seq_len, sampling
  replay::step_meta_array<std::int32_t> prompt;      // prompt token ids for prefill
  replay::pinned_buffer<std::int32_t> token_out;     // the sampler writes the token here
  replay::graph_exec exec;                           // the captured decode step
  std::size_t graph_nodes = 0;
  std::size_t graph_kernel_nodes = 0;
  replay::token_loop loop;                           // the device loop's token buffer (up to a context)
  replay::graph_exec loop_exec;                      // the captured device loop (capture_loop_graph)
  int loop_steps_per_iteration = 0;
  bool step_in_flight = false;    // a step was enqueued and its token not waited for
  // MetaPath::device and the device loop: the metadata of the step in flight, and what the device
  // holds after it (the sampler's prediction, known once its token has been read).
  StepMeta issued{};
  StepMeta predicted{};
  bool predicted_valid = false;
  std::size_t meta_writes = 0;    // Model::meta_writes()

  Impl(const Weights& w, ModelOptions opt)
      : options(opt),
        params_mem(w.data.size()),
        stage_image(1),
        arena(static_cast<std::size_t>(2 * C::block_size * C::n_embd + 2 * C::n_layer * kCacheLayer +
                                       C::vocab_size) * sizeof(float) +
              10 * replay::static_arena::default_alignment),
        prompt(C::block_size),
        token_out(1),
        loop(static_cast<std::size_t>(C::block_size)) {
    // The decode step keeps the model's weights in shared memory (decode_step_kernel).
    int device = 0, shared_optin = 0;
    REPLAY_CHECK(cudaGetDevice(&device));
    REPLAY_CHECK(cudaDeviceGetAttribute(&shared_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    if (static_cast<std::size_t>(shared_optin) < kStepSharedBytes)
      throw no_device_error(fmt::format("the decode step needs {} bytes of shared memory per block; this device "
                                        "allows {} (an sm_90 GPU allows 232448)",
                                        kStepSharedBytes, shared_optin));
    set_decode_step_attributes();
    if (w.data.size() != packed_size())
      throw std::invalid_argument(fmt::format("nanogpt::Model: weights hold {} floats, expected {}",
                                              w.data.size(), packed_size()));
    const replay::stream_ref s(stream.get());
    params_mem.copy_from_host(std::span<const float>(w.data), s);
    const auto at = [&](std::string_view name) { return params_mem.data() + spec(name).offset; };
    params.tok_emb = at("token_embedding_table.weight");
    params.pos_emb = at("position_embedding_table.weight");
    for (int l = 0; l < C::n_layer; ++l) {
      const auto n = [&](std::string_view leaf) { return at(fmt::format("blocks.{}.{}", l, leaf)); };
      params.layer[l] = {n("ln1.weight"), n("ln1.bias"),          n("sa.qkv.weight"),     n("sa.attn_proj.weight"),
                         n("sa.attn_proj.bias"), n("ln2.weight"), n("ln2.bias"),          n("ffwd.net.0.weight"),
                         n("ffwd.net.0.bias"),   n("ffwd.net.2.weight"), n("ffwd.net.2.bias")};
    }
    params.lnf_w = at("ln_f.weight");
    params.lnf_b = at("ln_f.bias");
    params.head_w = at("lm_head.weight");
    params.head_b = at("lm_head.bias");
    const std::unique_ptr<StageImage> image = make_stage_image(w);
    stage_image.copy_from_host(std::span<const StageImage>(image.get(), 1), s);

    buffers.x = arena.allocate<float>(C::block_size * C::n_embd).data();
    buffers.q = arena.allocate<float>(C::block_size * C::n_embd).data();
    buffers.k_cache = arena.allocate<float>(C::n_layer * kCacheLayer).data();
    buffers.v_cache = arena.allocate<float>(C::n_layer * kCacheLayer).data();
    buffers.logits = arena.allocate<float>(C::vocab_size).data();
    arena.freeze();  // from here on no address changes: safe to capture
    buffers.prompt = prompt.device();
    buffers.token_out = token_out.data();  // pinned host memory is device-accessible under UVA
    buffers.advance = options.meta == MetaPath::device ? meta.device() : nullptr;
    REPLAY_CHECK(cudaMemsetAsync(arena.base(), 0, arena.capacity(), stream.get()));
    token_out[0] = -1;
    stream.synchronize();
  }

  ~Impl() { (void)cudaStreamSynchronize(stream.get()); }

  [[nodiscard]] Launcher launcher() const { return {params, buffers, stage_image.data(), meta.device(), options}; }

  /// Waits for a step enqueued without reading its token (enqueue_decode_step).
  void settle() {
    if (!step_in_flight) return;
    REPLAY_CHECK(cudaStreamSynchronize(stream.get()));
    step_in_flight = false;
  }

  /// Makes `v` the metadata the next kernels read: staged and pushed (push, eager graph_copy, and
  /// the device-advanced paths unless the device already holds it) or staged for the graph's own
  /// copy (graph_copy, graph mode). `device_advances`: the work about to run writes the next
  /// step's metadata itself (MetaPath::device, the device loop), so the host may skip the push.
  void set_meta(const StepMeta& v, bool graph_copies_it, bool device_advances) {
    // Pushed (below) unless the device already holds it: the previous step's sampler wrote it and
    // its token was read, so the write is complete. A push is stream-ordered after that step.
    const bool held = device_advances && predicted_valid && std::memcmp(&predicted, &v, sizeof v) == 0;
    predicted_valid = false;
    issued = v;
    if (held) return;
    ++meta_writes;
    if (graph_copies_it) {
      meta.graph_staging() = v;
    } else {
      meta.staging() = v;
      meta.push(replay::stream_ref(stream.get()));
    }
  }

  /// Issues one decode step: the metadata (set_meta), then the kernels (eager) or the replay
  /// (graph). The token slot is poisoned first, so a step that did not run cannot hand back a
  /// stale token.
  void issue_step(const StepMeta& v, Mode mode) {
    const replay::stream_ref s(stream.get());
    if (mode == Mode::graph && !exec)
      throw replay::usage_error("nanogpt::Model: Mode::graph before capture_decode_graph()");
    token_out[0] = -1;
    const bool advances = options.meta == MetaPath::device;
    if (mode == Mode::graph) {
      const bool in_graph = options.meta == MetaPath::graph_copy;
      set_meta(v, in_graph, advances);
      exec.launch(s);
    } else {
      set_meta(v, false, advances);
      launcher().decode_step(stream.get());
    }
    step_in_flight = true;
  }

  /// Waits for the token the sampler writes into pinned host memory. Polling that memory is the
  /// cheapest wake-up; if the token takes unusually long (a slow tool such as compute-sanitizer, or
  /// a failed kernel) the stream is synchronised, which also reports any CUDA error.
  std::int32_t wait_token() {
    const volatile std::int32_t* slot = token_out.data();
    for (int i = 0; i < (1 << 22); ++i) {
      const std::int32_t t = *slot;
      if (t >= 0 && t < C::vocab_size) return arrived(t);
    }
    REPLAY_CHECK(cudaStreamSynchronize(stream.get()));
    const std::int32_t t = *slot;
    if (t < 0 || t >= C::vocab_size)
      throw std::runtime_error(fmt::format("nanogpt: the step produced no valid token ({})", t));
    return arrived(t);
  }

  /// The token of the step in flight arrived: every kernel of the step has read the metadata by
  /// now, and (MetaPath::device) the device holds the next step's metadata.
  std::int32_t arrived(std::int32_t t) {
    step_in_flight = false;
    if (options.meta == MetaPath::device) {
      predicted = next_step_meta(issued, t);
      predicted_valid = true;
    }
    return t;
  }

  /// One launch of the device loop starting from `v`: at most `max_steps` decode steps, fewer when
  /// the stop token comes or the context fills. Appends the tokens to `out`. The metadata is
  /// pushed only when the device does not already hold it (the previous launch left it there).
  LoopLaunch run_loop(const StepMeta& v, int max_steps, std::int32_t stop_token, std::vector<std::int32_t>& out) {
    if (!loop_exec) throw replay::usage_error("nanogpt::Model: decode_loop() before capture_loop_graph()");
    settle();
    const replay::stream_ref s(stream.get());
    set_meta(v, false, /*device_advances=*/true);
    loop.arm(s, max_steps, stop_token);
    loop_exec.launch(s);
    const replay::loop_result r = loop.wait(s);  // polls the count, the stop reason and the tokens
    if (r.tokens.empty()) throw std::runtime_error("nanogpt: the device loop produced no token");
    out.insert(out.end(), r.tokens.begin(), r.tokens.end());
    const int n = static_cast<int>(r.tokens.size());
    predicted = next_step_meta(v, r.tokens.back(), n);  // what the last step's sampler wrote
    predicted_valid = true;
    return {n, r.stop == replay::loop_stop::stop_token};
  }
};

static StepMeta make_meta(std::int32_t token, int pos, int seq_len, const Sampling& s) {
  StepMeta m;
  m.token = token;
  m.pos = pos;
  m.seq_len = seq_len;
  m.greedy = s.greedy ? 1 : 0;
  m.temperature = s.temperature;
  m.seed = s.seed;
  return m;
}

static void check_sampling(const Sampling& s) {
  if (!s.greedy && !(s.temperature > 0.0f && std::isfinite(s.temperature)))
    throw std::invalid_argument(fmt::format("temperature must be a positive number (got {}); use greedy "
                                            "decoding for temperature 0",
                                            s.temperature));
}

Model::Model(const Weights& weights, ModelOptions options) {
  (void)require_device();
  impl_ = std::make_unique<Impl>(weights, options);
}
Model::~Model() = default;
Model::Model(Model&&) noexcept = default;
Model& Model::operator=(Model&&) noexcept = default;

std::int32_t Model::prefill(std::span<const std::int32_t> prompt, const Sampling& sampling) {
  if (prompt.empty() || prompt.size() > static_cast<std::size_t>(C::block_size))
    throw std::invalid_argument(fmt::format("prefill: the prompt has {} tokens; it needs 1 to {}", prompt.size(),
                                            C::block_size));
  for (auto t : prompt)
    if (t < 0 || t >= C::vocab_size)
      throw std::invalid_argument(fmt::format("prefill: token id {} outside [0, {})", t, C::vocab_size));
  check_sampling(sampling);
  Impl& m = *impl_;
  m.settle();
  const replay::stream_ref s(m.stream.get());
  auto staged = m.prompt.staging();
  std::copy(prompt.begin(), prompt.end(), staged.begin());
  m.prompt.push(s, prompt.size());
  const int rows = static_cast<int>(prompt.size());
  m.token_out[0] = -1;
  m.set_meta(make_meta(0, 0, rows, sampling), false, false);
  m.launcher().prefill(s.get(), rows);
  return m.wait_token();
}

std::int32_t Model::decode_step(std::int32_t token, int pos, const Sampling& sampling, Mode mode) {
  if (token < 0 || token >= C::vocab_size)
    throw std::invalid_argument(fmt::format("decode_step: token id {} outside [0, {})", token, C::vocab_size));
  if (pos < 0 || pos >= C::block_size)
    throw std::invalid_argument(
        fmt::format("decode_step: position {} outside the context [0, {})", pos, C::block_size));
  check_sampling(sampling);
  impl_->settle();  // a step enqueued before must not hand its token to this one
  impl_->issue_step(make_meta(token, pos, pos + 1, sampling), mode);
  return impl_->wait_token();
}

void Model::enqueue_decode_step(std::int32_t token, int pos, const Sampling& sampling, Mode mode) {
  if (token < 0 || token >= C::vocab_size || pos < 0 || pos >= C::block_size)
    throw std::invalid_argument(fmt::format("enqueue_decode_step: token {} or position {} out of range", token, pos));
  impl_->issue_step(make_meta(token, pos, pos + 1, sampling), mode);
}

void Model::synchronize() {
  REPLAY_CHECK(cudaStreamSynchronize(impl_->stream.get()));
  impl_->step_in_flight = false;
}

void Model::record_decode_step(cudaStream_t s) {
  Impl& m = *impl_;
  if (m.options.meta == MetaPath::graph_copy) m.meta.capture_copy(replay::stream_ref(s));  // every replay starts by copying StepMeta
  m.launcher().decode_step(s);
}

void Model::capture_decode_graph() {
  Impl& m = *impl_;
  const replay::stream_ref s(m.stream.get());
  replay::graph g = replay::capture(s, [&](replay::stream_ref cs) { record_decode_step(cs.get()); });
  m.graph_nodes = g.node_count();
  m.graph_kernel_nodes = g.kernel_node_count();
  m.exec = g.instantiate({.upload_stream = s.get()});
  s.synchronize();
}

void Model::capture_loop_graph(int steps_per_iteration) {
  if (steps_per_iteration < 1 || steps_per_iteration > C::block_size)
    throw std::invalid_argument(fmt::format("capture_loop_graph: {} steps per iteration (1 to {})",
                                            steps_per_iteration, C::block_size));
  Impl& m = *impl_;
  Buffers b = m.buffers;
  b.advance = m.meta.device();  // every step of the loop writes the next step's metadata
  const replay::stream_ref s(m.stream.get());
  replay::graph g = replay::capture(s, [&](replay::stream_ref cs) {
    m.loop.capture(cs, [&](replay::stream_ref body, replay::token_loop_ref ref) {
      const Launcher l{m.params, b, m.stage_image.data(), m.meta.device(), m.options, ref};
      // Several steps per run of the body, each chained to the previous one by PDL (it stages its
      // weights while the previous step runs, then waits for it): the handoff between two steps is
      // then one kernel handoff, not the end of a run of the body and the start of the next.
      for (int i = 0; i < steps_per_iteration; ++i) l.decode_step(body.get(), /*chained=*/i > 0);
    });
  });
  m.loop_steps_per_iteration = steps_per_iteration;
  m.loop_exec = g.instantiate({.upload_stream = s.get()});
  s.synchronize();
}

LoopLaunch Model::decode_loop(std::int32_t token, int pos, const Sampling& sampling, int max_steps,
                              std::int32_t stop_token, std::vector<std::int32_t>& out) {
  if (token < 0 || token >= C::vocab_size)
    throw std::invalid_argument(fmt::format("decode_loop: token id {} outside [0, {})", token, C::vocab_size));
  if (pos < 0 || pos >= C::block_size)
    throw std::invalid_argument(
        fmt::format("decode_loop: position {} outside the context [0, {})", pos, C::block_size));
  if (max_steps < 1 || pos + max_steps > C::block_size)
    throw std::invalid_argument(fmt::format("decode_loop: {} steps from position {} pass the context of {}",
                                            max_steps, pos, C::block_size));
  check_sampling(sampling);
  return impl_->run_loop(make_meta(token, pos, pos + 1, sampling), max_steps, stop_token, out);
}

bool Model::has_loop_graph() const noexcept { return static_cast<bool>(impl_->loop_exec); }
int Model::loop_steps_per_iteration() const noexcept { return impl_->loop_steps_per_iteration; }

bool Model::has_graph() const noexcept { return static_cast<bool>(impl_->exec); }
std::size_t Model::graph_nodes() const noexcept { return impl_->graph_nodes; }
std::size_t Model::graph_kernel_nodes() const noexcept { return impl_->graph_kernel_nodes; }
const ModelOptions& Model::options() const noexcept { return impl_->options; }
std::size_t Model::meta_writes() const noexcept { return impl_->meta_writes; }

cudaStream_t Model::stream() const noexcept { return impl_->stream.get(); }

std::vector<float> Model::logits() const {
  std::vector<float> out(C::vocab_size);
  REPLAY_CHECK(cudaMemcpyAsync(out.data(), impl_->buffers.logits, out.size() * sizeof(float),
                               cudaMemcpyDeviceToHost, impl_->stream.get()));
  REPLAY_CHECK(cudaStreamSynchronize(impl_->stream.get()));
  return out;
}

void check_lengths(std::size_t prompt_len, long long n_tokens) {
  if (prompt_len == 0) throw std::invalid_argument("the prompt is empty; give at least one character");
  if (prompt_len > static_cast<std::size_t>(C::block_size))
    throw std::invalid_argument(fmt::format("the prompt has {} tokens but the context holds only {}",
                                            prompt_len, C::block_size));
  if (n_tokens < 1) throw std::invalid_argument(fmt::format("--tokens must be at least 1 (got {})", n_tokens));
  if (static_cast<long long>(prompt_len) + n_tokens > C::block_size)
    throw std::invalid_argument(fmt::format(
        "the prompt ({} tokens) plus {} new tokens is {}, past the context of {}; at most {} new tokens fit "
        "after this prompt",
        prompt_len, n_tokens, static_cast<long long>(prompt_len) + n_tokens, C::block_size,
        C::block_size - static_cast<long long>(prompt_len)));
}

GenerateResult generate(Model& model, std::span<const std::int32_t> prompt, int n_tokens, Mode mode,
                        const Sampling& sampling, bool fresh_capture, std::int32_t stop_token) {
  check_lengths(prompt.size(), n_tokens);
  GenerateResult r;
  r.tokens.reserve(static_cast<std::size_t>(n_tokens));
  r.step_us.reserve(static_cast<std::size_t>(n_tokens));
  replay_examples::stopwatch total;
  replay_examples::stopwatch sw;
  std::int32_t token = model.prefill(prompt, sampling);
  r.prefill_us = sw.elapsed_us();
  r.tokens.push_back(token);
  if (mode == Mode::graph && (fresh_capture || !model.has_graph())) {
    sw.restart();
    model.capture_decode_graph();
    r.capture_us = sw.elapsed_us();
  }
  replay_examples::stopwatch decode;
  int pos = static_cast<int>(prompt.size());
  for (int i = 1; i < n_tokens && token != stop_token; ++i, ++pos) {
    sw.restart();
    token = model.decode_step(token, pos, sampling, mode);
    r.step_us.push_back(sw.elapsed_us());
    r.tokens.push_back(token);
  }
  r.stopped = token == stop_token;
  r.decode_us = decode.elapsed_us();
  r.total_us = total.elapsed_us();
  return r;
}

GenerateResult generate_looped(Model& model, std::span<const std::int32_t> prompt, int n_tokens,
                               int tokens_per_launch, const Sampling& sampling, bool fresh_capture,
                               std::int32_t stop_token) {
  check_lengths(prompt.size(), n_tokens);
  if (tokens_per_launch < 1 || tokens_per_launch > C::block_size)
    throw std::invalid_argument(fmt::format("--tokens-per-launch must be 1 to {} (got {})", C::block_size,
                                            tokens_per_launch));
  GenerateResult r;
  r.tokens.reserve(static_cast<std::size_t>(n_tokens));
  replay_examples::stopwatch total;
  replay_examples::stopwatch sw;
  std::int32_t token = model.prefill(prompt, sampling);
  r.prefill_us = sw.elapsed_us();
  r.tokens.push_back(token);
  if (fresh_capture || !model.has_loop_graph()) {
    sw.restart();
    model.capture_loop_graph(std::min(tokens_per_launch, Model::default_loop_steps_per_iteration));
    r.capture_us = sw.elapsed_us();
  }
  replay_examples::stopwatch decode;
  int pos = static_cast<int>(prompt.size());
  int remaining = n_tokens - 1;
  bool stopped = token == stop_token;
  while (remaining > 0 && !stopped) {
    sw.restart();
    const LoopLaunch l =
        model.decode_loop(token, pos, sampling, std::min(tokens_per_launch, remaining), stop_token, r.tokens);
    r.launch_us.push_back(sw.elapsed_us());
    pos += l.steps;
    remaining -= l.steps;
    token = r.tokens.back();
    stopped = l.stopped;
  }
  r.stopped = stopped;
  r.decode_us = decode.elapsed_us();
  r.total_us = total.elapsed_us();
  return r;
}

}  // namespace nanogpt
