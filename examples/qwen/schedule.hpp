// examples/qwen/schedule.hpp: running sequences to completion on a Decoder (an Engine, or a TpEngine
// over several GPUs), as the CLI's generation and the benchmark do: a staggered batch (sequences
// join and leave at their own steps) through decode(), or one sequence through the device loop
// (Engine::decode_loop).
#pragma once

#include "model.hpp"

#include <cstdint>
#include <functional>
#include <vector>

namespace qwen {

/// A prompt of n token ids drawn from (seed, index), each below `vocab`.
std::vector<int> random_prompt(int n, int vocab, std::uint64_t seed);

/// The staggered demo: `n` sequences of different prompt and output lengths (random prompts from
/// `seed`) appended to `seqs`, joining at different steps (appended to `join`).
void demo_requests(int n, int vocab, std::uint64_t seed, std::vector<SequenceRequest>& seqs,
                   std::vector<int>& join);

/// Result of running a set of sequences to completion.
struct RunResult {
  std::vector<std::vector<int>> tokens;  ///< generated tokens per sequence
  std::vector<double> step_us;           ///< host wall time of each decode step (push..read back)
  std::vector<int> step_rows;            ///< real rows of each decode step
  std::vector<int> step_bucket;          ///< rows run (bucket) of each decode step
  double prefill_ms = 0;                 ///< total prefill time
  double decode_s = 0;                   ///< total decode wall time
};

/// Receives each generated token of sequence `seq` as soon as the host has it.
using TokenSink = std::function<void(int seq, int token)>;

/// Runs `seqs` to completion: sequence i joins at step join[i] (prefilled then), decodes one token
/// per step with the others, and leaves (freeing its blocks) when it has generated its tokens or
/// one of its stop ids. `verbose` prints when sequences join and leave and when the bucket changes.
RunResult run_schedule(Decoder& eng, const std::vector<SequenceRequest>& seqs, const std::vector<int>& join,
                       bool graph, bool verbose, const TokenSink& sink = {});

/// Runs one sequence with the device loop: prefill, then one Engine::decode_loop launch per `k`
/// tokens (fewer for the last), stopping on the device at the first stop id and on the host at any
/// of them. step_us holds each launch's host wall time (push..read back) divided by the tokens it
/// produced: the time per token.
RunResult run_looped(Decoder& eng, const SequenceRequest& q, int k, const TokenSink& sink = {});

/// The buckets a run used and its padding: rows of real sequences against rows run.
struct BucketUse {
  std::size_t steps = 0;     ///< decode steps
  std::vector<int> buckets;  ///< distinct buckets, ascending
  long long real = 0;        ///< real rows over all steps
  long long run = 0;         ///< rows run (buckets) over all steps
};
BucketUse bucket_use(const RunResult& r);

/// Parity (teacher forcing): prefills the first `prefix` tokens of `prompt`, then feeds the rest
/// one per decode step (eager, or from the graphs). Returns the logits after the prefill and after
/// each step: (prompt.size() - prefix + 1) rows of vocab floats.
std::vector<float> teacher_forced_logits(Decoder& eng, const std::vector<int>& prompt, int prefix, bool graph);

/// Bytes in MiB.
inline double mib(double bytes) { return bytes / 1048576.0; }

}  // namespace qwen
