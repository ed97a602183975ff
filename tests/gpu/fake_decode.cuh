// A stand-in for a decode step, shared by the device-loop tests: the "sampled" token is a function
// of the step metadata; the kernel appends it, then writes the next step's metadata (as a model's
// sampler does). host_tokens() is the reference sequence.
#pragma once

#include <replay/device_loop.hpp>

#include <vector>

namespace fake_decode {
namespace {  // each test executable has its own copy

struct fake_meta {
  int token;
  int pos;
  int seq_len;
  int seed;
};
__host__ __device__ inline int fake_sample(const fake_meta& m) { return (m.token * 31 + m.pos * 7 + m.seed) % 50; }

__global__ void fake_decode_step(fake_meta* meta, int context, replay::token_loop_ref loop) {
  const fake_meta m = *meta;
  const int token = fake_sample(m);
  meta->token = token;
  meta->pos = m.seq_len;
  meta->seq_len = m.seq_len + 1;
  (void)loop.append(token, m.seq_len + 1 >= context);
}

inline std::vector<int> host_tokens(fake_meta m, int n) {
  std::vector<int> out;
  for (int i = 0; i < n; ++i) {
    const int t = fake_sample(m);
    out.push_back(t);
    m = {t, m.seq_len, m.seq_len + 1, m.seed};
  }
  return out;
}

}  // namespace
}  // namespace fake_decode
