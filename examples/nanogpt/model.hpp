// nanogpt/model.hpp: the decoder's host API (plain C++; the kernels live in decode_step.cu and
// prefill.cu, the Model in model.cu).
//
// A Model owns everything a decode step touches, allocated once in its constructor: the weights,
// the decode step's weight image (what its kernel copies into shared memory), the residual-stream
// and query buffers, the static KV cache (block_size slots per head), the
// logits, the step metadata (replay::step_meta<StepMeta>: token, position, sequence length,
// sampling settings at a fixed device address), a pinned slot the sampler writes the token into,
// and the device loop's token buffer (replay::token_loop). Nothing is allocated after
// construction, so every address a captured graph holds stays valid for the Model's lifetime.
//
// One decode step = the step metadata on the device → the step's one kernel (decode_step.cu), whose
// sampler writes the token into pinned host memory, where the host picks it up (it polls that
// memory, and synchronises the stream only if the token is unusually late). The metadata reaches the device in
// one of three ways (MetaPath): pushed by the host before the step, copied by a node at the start
// of the graph, or written by the previous step's sampler on the device. The kernels are the same
// in every mode; only how they are launched differs:
//   Mode::eager  launches the step's kernel from the host (kernels_per_decode_step launches);
//   Mode::graph  replays the graph captured by capture_decode_graph() (one cudaGraphLaunch);
//   decode_loop() replays the graph captured by capture_loop_graph(): a WHILE node whose body is
//                the same step, run up to K times on the device per launch (replay/device_loop.hpp).
// The graphs do not depend on the position, token, prompt, sampling settings or K (all read from
// device memory), so one capture serves every step of every generation.
//
// Thread safety: none; use a Model from one thread. Move-only.
#pragma once

#include "config.hpp"
#include "weights.hpp"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string_view>
#include <vector>

namespace nanogpt {

/// How a decode step is launched.
enum class Mode { eager, graph };
constexpr std::string_view to_string(Mode m) noexcept { return m == Mode::eager ? "eager" : "graph"; }

/// How the step metadata (StepMeta) reaches the kernels, which always read it from the device copy
/// of a replay::step_meta.
enum class MetaPath {
  /// replay::step_meta::push before each step: an async host-to-device copy on the stream, then the
  /// kernels read the device copy. Steps may be enqueued back to back.
  push,
  /// Graph mode: the graph starts with a copy node (replay::step_meta::capture_copy), so a step is
  /// write staging → replay, with no separate copy call. Eager mode pushes.
  graph_copy,
  /// The kernels read replay::step_meta's device copy, and the last kernel of every step (and of
  /// the prefill) writes the next step's metadata there itself: the token it sampled, at position
  /// seq_len, with the same sampling settings. The host keeps the same prediction; a step whose
  /// metadata matches it (every step of an ordinary generation) is launch → token, with nothing
  /// written by the host and nothing read over the bus; any other step (a new prompt, a forced
  /// token, other sampling settings, a step enqueued before the previous token was read) is pushed
  /// as with `push`. The default: the fastest for one step at a time.
  device,
};
constexpr std::string_view to_string(MetaPath m) noexcept {
  return m == MetaPath::push ? "push" : m == MetaPath::graph_copy ? "graph-copy" : "device";
}

/// Launch settings (the same for both modes, so eager and graph stay bit-identical).
struct ModelOptions {
  /// Programmatic dependent launch (sm_90+): each kernel but the first of a step or prefill may
  /// start while the previous one runs, loading its weights before it waits for the previous
  /// kernel's output. Off: plain launches.
  bool pdl = true;
  /// How the step metadata reaches the kernels.
  MetaPath meta = MetaPath::device;
};

/// What one launch of the device loop did.
struct LoopLaunch {
  int steps = 0;         ///< decode steps run (= tokens appended)
  bool stopped = false;  ///< the last token was the stop token
};

/// No usable CUDA device (the message says why).
class no_device_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Throws no_device_error unless a CUDA device can be used; returns its name.
std::string require_device();

class Model {
 public:
  /// Kernels in one decode step: one (embedding, every layer, lm_head and sampling in one block).
  static constexpr int kernels_per_decode_step = 1;
  /// Kernels in a prefill: embedding, per layer {QKV, attention, FFN}, lm_head + sampling.
  static constexpr int kernels_per_prefill = 2 + 3 * Config::n_layer;

  /// Uploads `weights` and allocates every buffer. Needs a CUDA device whose blocks may use the
  /// decode step's 222 KiB of shared memory (sm_90): throws no_device_error otherwise.
  explicit Model(const Weights& weights, ModelOptions options = {});
  ~Model();
  Model(Model&&) noexcept;
  Model& operator=(Model&&) noexcept;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  /// Eager prefill: writes the prompt's keys and values into cache slots [0, prompt.size()) and
  /// returns the first new token (sampled from the last prompt position's logits).
  /// Requires 1 <= prompt.size() <= block_size and every id in [0, vocab_size).
  std::int32_t prefill(std::span<const std::int32_t> prompt, const Sampling& sampling);

  /// One decode step: feeds `token` at position `pos` (cache slot `pos` is written; slots < pos must
  /// hold the sequence so far) and returns the sampled next token. Mode::graph needs
  /// capture_decode_graph() first.
  std::int32_t decode_step(std::int32_t token, int pos, const Sampling& sampling, Mode mode);

  /// Issues one decode step like decode_step() but returns without waiting for it or reading the
  /// token (for back-to-back throughput measurements). Call synchronize() before reading anything.
  void enqueue_decode_step(std::int32_t token, int pos, const Sampling& sampling, Mode mode);
  /// Waits for all work issued on the model's stream.
  void synchronize();

  /// Captures one decode step into a graph (nothing runs), instantiates and uploads it. Replaces a
  /// previous graph. Must not be called while a step is in flight (it never is: steps synchronise).
  void capture_decode_graph();
  /// Issues the launches of one decode step on `s` (the copy node first with MetaPath::graph_copy)
  /// and nothing else: what capture_decode_graph() captures. For diagnostics: capture it yourself
  /// (replay::capture, replay::audit_step) to inspect or audit the step's graph.
  void record_decode_step(cudaStream_t s);
  [[nodiscard]] bool has_graph() const noexcept;

  /// Decode steps per run of the device loop's body unless told otherwise.
  static constexpr int default_loop_steps_per_iteration = 8;

  /// Captures the device loop (nothing runs): a WHILE node whose body is `steps_per_iteration`
  /// decode steps chained by PDL; each step's sampler appends its token to the loop's buffer and
  /// writes the next step's metadata, and once the loop stops the steps left in the body do
  /// nothing. Any steps_per_iteration gives the same tokens; a launch costs whole runs of the body,
  /// so a K below it pays for the steps that do nothing. Replaces a previous loop graph.
  void capture_loop_graph(int steps_per_iteration = default_loop_steps_per_iteration);
  [[nodiscard]] bool has_loop_graph() const noexcept;
  /// The steps per run of the body of the captured loop graph (0 before capture).
  [[nodiscard]] int loop_steps_per_iteration() const noexcept;
  /// One launch of the device loop: feeds `token` at position `pos` and runs up to `max_steps`
  /// decode steps on the device, stopping after the step that samples `stop_token` (-1: none) or
  /// fills the context. Appends the tokens to `out` (polled from pinned memory: no copy, no
  /// event). The same tokens as max_steps calls of decode_step(). Needs capture_loop_graph() first;
  /// requires pos + max_steps <= block_size.
  LoopLaunch decode_loop(std::int32_t token, int pos, const Sampling& sampling, int max_steps,
                         std::int32_t stop_token, std::vector<std::int32_t>& out);
  /// Nodes / kernel nodes of the captured graph (0 before capture).
  [[nodiscard]] std::size_t graph_nodes() const noexcept;
  [[nodiscard]] std::size_t graph_kernel_nodes() const noexcept;

  /// The logits (vocab_size floats) of the last position processed by prefill or decode_step.
  [[nodiscard]] std::vector<float> logits() const;

  /// How many times the host has written or pushed step metadata since construction (prefill and
  /// decode steps). MetaPath::device skips the steps the device predicted, so an ordinary
  /// generation costs one (its prefill's); the other paths write once per step.
  [[nodiscard]] std::size_t meta_writes() const noexcept;

  [[nodiscard]] const ModelOptions& options() const noexcept;
  /// The stream every kernel runs on.
  [[nodiscard]] cudaStream_t stream() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Throws std::invalid_argument unless a prompt of `prompt_len` tokens followed by `n_tokens` new
/// tokens fits the context (prompt_len >= 1, n_tokens >= 1, prompt_len + n_tokens <= block_size).
void check_lengths(std::size_t prompt_len, long long n_tokens);

/// What one generate() call produced and how long each part took (host wall clock, µs).
struct GenerateResult {
  std::vector<std::int32_t> tokens;  ///< the n_tokens new tokens (the prompt excluded)
  double prefill_us = 0;             ///< prefill + first token on the host
  double capture_us = 0;             ///< graph mode: capture + instantiate + upload (0 if reused)
  double decode_us = 0;              ///< all decode steps
  double total_us = 0;               ///< prefill + capture + decode
  std::vector<double> step_us;       ///< each decode step: push → launch → token on the host
  std::vector<double> launch_us;     ///< generate_looped: each launch of the loop (K steps) on the host
  bool stopped = false;              ///< the generation ended on the stop token
};

/// Prefill (eager), then n_tokens - 1 decode steps in `mode`, or fewer: the generation ends after
/// the token `stop_token` (-1: none). In graph mode the step is captured after the prefill when
/// `fresh_capture` is set or no graph exists yet (as the seed does: warm-up and capture count in the
/// end-to-end time). Checks the lengths first (check_lengths).
GenerateResult generate(Model& model, std::span<const std::int32_t> prompt, int n_tokens, Mode mode,
                        const Sampling& sampling, bool fresh_capture = true, std::int32_t stop_token = -1);

/// The same generation with the device loop: prefill, then launches of up to `tokens_per_launch`
/// (1..block_size) decode steps each. The same tokens as generate() for the same arguments. A fresh
/// capture runs min(tokens_per_launch, 8) steps per run of the loop's body.
GenerateResult generate_looped(Model& model, std::span<const std::int32_t> prompt, int n_tokens,
                               int tokens_per_launch, const Sampling& sampling, bool fresh_capture = true,
                               std::int32_t stop_token = -1);

}  // namespace nanogpt
