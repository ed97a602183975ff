// examples/qwen/bench.hpp: the `qwen --bench` benchmark: batch-1 TPOT per mode and of the device
// loop against two floors measured in the same process (the bytes floor: the step's weights at the
// device-to-device copy rate; the chain floor: a graph of one streaming-read kernel per matrix),
// batch 1 after a long prompt, prefill against its compute floor (its FLOPs at cuBLAS's bf16 GEMM
// rate), and batched throughput per bucket. Prints markdown tables and fills
// the "bench" object of the CLI's JSON.
#pragma once

#include "model.hpp"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace qwen {

/// What the benchmark runs (the CLI's --bench flags, checked by its prepare()).
struct BenchOptions {
  std::vector<int> prompt;         ///< batch-1 prompt; batched rows get random prompts of its length
  std::uint64_t seed = 0;          ///< seed of the random prompts
  int steps = 128;                 ///< decode steps timed per measurement
  int long_prompt = 4096;          ///< prompt tokens of the long-context measurement (0: skip it)
  std::vector<int> prefill;        ///< prompt lengths of the prefill measurement (empty: skip it)
  std::vector<int> batches;        ///< batch sizes of the throughput table
  std::vector<std::string> modes;  ///< "eager", "graph" or both, in that order
};

/// Sizes `opt` for the benchmark's requests (host, before the Engine is built): activation rows for
/// its largest batch and, when `size_kv`, a KV budget that holds its largest request (a full batch
/// of prompts like o.prompt, or the long prompt).
void size_for_bench(const Config& cfg, const BenchOptions& o, bool size_kv, EngineOptions& opt);
/// Throws input_error unless every request of the benchmark fits `opt` (validate_request), naming
/// --bench-batches for a batch size outside 1..1024.
void validate_bench(const Config& cfg, const EngineOptions& opt, const BenchOptions& o);

/// Runs the benchmark on `eng` (`device`: the GPU's name, for the headings) and writes its figures
/// under out["bench"].
void run_bench(Decoder& eng, const BenchOptions& o, const std::string& device, nlohmann::json& out);

/// The memory report: weights, KV pool, buffers and the captured graphs (printed unless `quiet`),
/// and the graph counters and pool statistics (out["memory"], out["pool"], out["graphs"]).
void report_memory(const Decoder& eng, bool quiet, nlohmann::json& out);

}  // namespace qwen
