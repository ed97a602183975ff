// nanogpt/model.hpp: the decoder's host API (plain C++; the kernels live in model.cu).
//
// A Model owns everything a decode step touches, allocated once in its constructor: the weights,
// the residual-stream and query buffers, the static KV cache (block_size slots per head), the
// logits, the step metadata (StepMeta: a pinned host struct the kernels read in place, or
// replay::step_meta<StepMeta> for the pushed and graph-copied variants, see MetaPath) and a pinned
// slot the sampler writes the token into. Nothing is allocated after construction, so every address
// a captured graph holds stays valid for the Model's lifetime.
//
// One decode step = StepMeta (token, pos, seq_len, sampling) in place → run the step's kernels →
// the sampler writes the token into pinned host memory, where the host picks it up (it polls that
// memory, and synchronises the stream only if the token is unusually late). With the default
// MetaPath::device the sampler has already written the next step's StepMeta on the device, so an
// ordinary step is launch → token; the host pushes StepMeta only for a step it did not predict. The kernels are the same in
// both modes; only how they are launched differs:
//   Mode::eager  launches the kernels one by one from the host (kernels_per_decode_step launches);
//   Mode::graph  replays the graph captured by capture_decode_graph() (one cudaGraphLaunch).
// The graph does not depend on the position, token, prompt or sampling settings (all read from
// StepMeta), so one capture serves every step of every generation.
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

/// Where the kernels read the step metadata (StepMeta) from.
enum class MetaPath {
  /// replay::step_meta::push before each step: an async host-to-device copy on the stream, then the
  /// kernels read the device copy. Steps may be enqueued back to back.
  push,
  /// Graph mode: the graph starts with a copy node (replay::step_meta::capture_copy), so a step is
  /// write staging → replay, with no separate copy call. Eager mode pushes.
  graph_copy,
  /// The kernels read a pinned host struct directly (zero-copy, over the bus): a step is write the
  /// struct → launch, with no copy at all (the default before MetaPath::device was added). The
  /// struct is rewritten only after the previous step's token arrived (every kernel of a step has
  /// read it by then), so steps cannot overlap: enqueue_decode_step() waits for the previous step.
  mapped,
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
  return m == MetaPath::push         ? "push"
         : m == MetaPath::graph_copy ? "graph-copy"
         : m == MetaPath::mapped     ? "mapped"
                                     : "device";
}

/// Launch settings (the same for both modes, so eager and graph stay bit-identical).
struct ModelOptions {
  /// Programmatic dependent launch (sm_90+): each kernel but the first of a step or prefill may
  /// start while the previous one runs, loading its weights before it waits for the previous
  /// kernel's output. Off: plain launches.
  bool pdl = true;
  /// How the step metadata reaches the kernels.
  MetaPath meta = MetaPath::device;
  /// Diagnostics: a decode step launches kernels_per_decode_step kernels that do no model work (each
  /// waits for the previous one and increments a counter; the last hands the input token back as
  /// the "sampled" token). Measures the floor of the step machinery; the text is meaningless.
  bool null_kernels = false;
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
  /// Kernels in one decode step: embedding, per layer {attention sublayer, FFN sublayer}, lm_head
  /// + sampling.
  static constexpr int kernels_per_decode_step = 2 + 2 * Config::n_layer;
  /// Kernels in a prefill: embedding, per layer {QKV, attention, FFN}, lm_head + sampling.
  static constexpr int kernels_per_prefill = 2 + 3 * Config::n_layer;

  /// Uploads `weights` and allocates every buffer (needs a CUDA device: throws no_device_error).
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

#ifdef NANOGPT_STAMPS
/// Diagnostics (a build configured with -DNANOGPT_STAMPS=ON): the stamps of the decode kernels of
/// the last `steps` decode steps: step i (0..steps-1) of them sits at [(first() + i) % steps], its
/// kernels in step order. clock64 at 0 entry, 1 the wait returned (the embedding has no wait), 2 the
/// residual row loaded and normalised, 3-6 points of each kernel's own (see model.cu), 7 its output
/// stored; %globaltimer (ns) at 0, 1 and 7 only (0 elsewhere). `ticket` counts the decode kernels
/// run since the program started. Synchronous; call between steps.
struct StepStamps {
  static constexpr int steps = 64;
  unsigned long long time[steps][Model::kernels_per_decode_step][8];
  long long clock[steps][Model::kernels_per_decode_step][8];
  unsigned ticket = 0;
  /// Where the oldest kept step sits.
  [[nodiscard]] int first() const noexcept {
    return static_cast<int>(ticket / Model::kernels_per_decode_step % steps);
  }
};
StepStamps read_stamps();
#endif

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
};

/// Prefill (eager), then n_tokens - 1 decode steps in `mode`. In graph mode the step is captured
/// after the prefill when `fresh_capture` is set or no graph exists yet (as the seed does: warm-up
/// and capture count in the end-to-end time). Checks the lengths first (check_lengths).
GenerateResult generate(Model& model, std::span<const std::int32_t> prompt, int n_tokens, Mode mode,
                        const Sampling& sampling, bool fresh_capture = true);

}  // namespace nanogpt
