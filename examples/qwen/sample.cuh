// examples/qwen/sample.cuh: the token sampler (sample.cu), run after the lm_head when the engine
// samples (EngineOptions::sampling).
#pragma once

#include "kernels.cuh"
#include "options.hpp"

namespace qwen {

/// Threads per block of the sampler (one block per row).
inline constexpr int kSampleThreads = 1024;

/// For each row r < rows: keys[r] = argmax_key(score, token), the token drawn from logits[r][0..V)
/// with *params (read on the device, so a captured graph serves every value): temperature 0 or
/// top_k 1, the largest logit (ties to the lowest token, as the fused argmax picks it); otherwise
/// a Gumbel-max draw from softmax(logits / temperature) over the top-k logits, then over the
/// smallest set of those holding at least top_p of their mass. The draw for token i is a pure
/// function of (seed, rows[r].pos + 1, i): the same eagerly, from a graph, in any bucket and in the
/// device loop. key_to_token decodes the key.
void launch_sample(const float* logits, int V, const RowStep* rows, const SampleParams* params, int nrows,
                   unsigned long long* keys, replay::stream_ref s);

}  // namespace qwen
