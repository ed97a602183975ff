// examples/qwen/ops.cu: the small kernels: random initialisation, the RoPE table, the embedding
// lookup, RMSNorm, SiLU·up and argmax (the cuBLAS path of large buckets and prefill), the logits
// of tensor-parallel sampling put back in vocabulary order, and the end of a step in the device loop.
#include "kernels.cuh"
#include "device.cuh"

#include <common/rng.hpp>

#include <replay/device_loop.hpp>
#include <replay/error.hpp>
#include <replay/launch.hpp>

#include <cstdint>

namespace qwen {
namespace {

using namespace dev;

__global__ void fill_random_kernel(bf16* p, std::size_t n, std::uint64_t seed, float scale) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    const std::uint64_t h = replay_examples::splitmix64(seed ^ (i * 0xD1B54A32D192ED03ull));
    const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    p[i] = __float2bfloat16((2.f * u - 1.f) * scale);
  }
}

__global__ void fill_random_slice_kernel(bf16* p, std::size_t rows, std::size_t cols, std::size_t ld, std::size_t row0,
                                         std::size_t col0, std::uint64_t seed, float scale) {
  const std::size_t n = rows * cols;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    const std::size_t full = (row0 + i / cols) * ld + col0 + i % cols;  // the index fill_random_kernel uses
    const std::uint64_t h = replay_examples::splitmix64(seed ^ (full * 0xD1B54A32D192ED03ull));
    const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    p[i] = __float2bfloat16((2.f * u - 1.f) * scale);
  }
}

__global__ void fill_const_kernel(bf16* p, std::size_t n, float v) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(v);
}

__global__ void rope_table_kernel(float2* rope, int max_pos, int half, int head_dim, float theta) {
  const int total = max_pos * half;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const int p = i / half, j = i % half;
    // As transformers computes it in fp32: inv_freq = 1 / theta^(2j/d); angle = pos * inv_freq.
    const float inv = 1.0f / powf(theta, static_cast<float>(2 * j) / static_cast<float>(head_dim));
    const float a = static_cast<float>(p) * inv;
    float s, c;
    sincosf(a, &s, &c);
    rope[i] = make_float2(c, s);
  }
}

__global__ void embed_kernel(const bf16* __restrict__ embed, int vocab, int hidden, RowMeta meta, float* residual,
                             unsigned long long* keys) {
  replay::pdl::launch_dependents();
  replay::pdl::wait();
  const int r = blockIdx.x;
  int tok = meta.rows[r].token;
  tok = tok < 0 ? 0 : (tok >= vocab ? vocab - 1 : tok);  // inputs are validated on the host; stay in bounds
  if (threadIdx.x == 0) keys[r] = 0ull;
  const bf16* src = embed + std::size_t(tok) * hidden;
  float* dst = residual + std::size_t(r) * hidden;
  for (int k = threadIdx.x * 8; k < hidden; k += blockDim.x * 8) {
    float f[8];
    unpack8(*reinterpret_cast<const uint4*>(src + k), f);
    *reinterpret_cast<float4*>(dst + k) = make_float4(f[0], f[1], f[2], f[3]);
    *reinterpret_cast<float4*>(dst + k + 4) = make_float4(f[4], f[5], f[6], f[7]);
  }
}

__global__ void rmsnorm_kernel(const float* residual, const bf16* w, int hidden, float eps, bf16* out) {
  replay::pdl::launch_dependents();
  prefetch_l1(w, hidden);  // the weights do not depend on earlier kernels
  replay::pdl::wait();
  const int r = blockIdx.x;
  const float* x = residual + std::size_t(r) * hidden;
  __shared__ float red[32];
  float ss = 0.f;
  for (int k = threadIdx.x; k < hidden; k += blockDim.x) ss += x[k] * x[k];
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
  __syncthreads();
  float s = 0.f;
  for (int i = 0; i < int(blockDim.x >> 5); ++i) s += red[i];
  const float rs = rsqrtf(s / hidden + eps);
  for (int k = threadIdx.x; k < hidden; k += blockDim.x)
    out[std::size_t(r) * hidden + k] = __float2bfloat16(x[k] * rs * __bfloat162float(w[k]));
}

__global__ void silu_mul_kernel(const float* gu, int N, int rows, bf16* act) {
  replay::pdl::launch_dependents();
  replay::pdl::wait();
  const std::size_t total = std::size_t(rows) * N;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < total;
       i += std::size_t(gridDim.x) * blockDim.x) {
    const std::size_t r = i / N, n = i % N;
    const float g = gu[r * 2 * N + n], u = gu[r * 2 * N + N + n];
    act[i] = __float2bfloat16(g / (1.f + __expf(-g)) * u);
  }
}

__global__ void argmax_kernel(const float* logits, int V, unsigned long long* keys, int index0) {
  replay::pdl::launch_dependents();
  replay::pdl::wait();
  const int r = blockIdx.x;
  const float* x = logits + std::size_t(r) * V;
  unsigned long long best = 0;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const unsigned long long k = argmax_key(x[i], i + index0);
    best = k > best ? k : best;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
    best = other > best ? other : best;
  }
  __shared__ unsigned long long red[32];
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i < int(blockDim.x >> 5); ++i) best = red[i] > best ? red[i] : best;
    keys[r] = best;
  }
}
__global__ void unshard_logits_kernel(const float* gathered, int tp, int rows, int shard, float* logits) {
  replay::pdl::launch_dependents();
  replay::pdl::wait();
  const std::size_t total = std::size_t(tp) * rows * shard;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < total;
       i += std::size_t(gridDim.x) * blockDim.x) {
    const std::size_t j = i % shard, r = i / shard % rows, k = i / shard / rows;  // gathered[k][r][j]
    logits[(r * tp + k) * shard + j] = gathered[i];
  }
}

int fill_grid(std::size_t n) {
  const std::size_t blocks = (n + 255) / 256;
  return static_cast<int>(blocks < 4096 ? (blocks == 0 ? 1 : blocks) : 4096);
}

}  // namespace

void launch_fill_random(bf16* p, std::size_t n, std::uint64_t seed, float scale, replay::stream_ref s) {
  replay::launch(fill_random_kernel, {.grid = dim3(fill_grid(n)), .block = dim3(256), .stream = s}, p, n, seed, scale);
}

void launch_fill_random_slice(bf16* p, std::size_t rows, std::size_t cols, std::size_t ld, std::size_t row0,
                              std::size_t col0, std::uint64_t seed, float scale, replay::stream_ref s) {
  if (col0 + cols > ld) throw replay::usage_error("qwen::launch_fill_random_slice: columns past the row");
  replay::launch(fill_random_slice_kernel, {.grid = dim3(fill_grid(rows * cols)), .block = dim3(256), .stream = s}, p,
                 rows, cols, ld, row0, col0, seed, scale);
}

void launch_fill_const(bf16* p, std::size_t n, float value, replay::stream_ref s) {
  replay::launch(fill_const_kernel, {.grid = dim3(fill_grid(n)), .block = dim3(256), .stream = s}, p, n, value);
}

void launch_rope_table(float2* rope, int max_pos, int head_dim, double theta, replay::stream_ref s) {
  const int half = head_dim / 2;
  replay::launch(rope_table_kernel, {.grid = dim3(fill_grid(std::size_t(max_pos) * half)), .block = dim3(256), .stream = s},
                 rope, max_pos, half, head_dim, static_cast<float>(theta));
}

void launch_embed(const bf16* embed, int vocab, int hidden, RowMeta meta, int rows, float* residual,
                  unsigned long long* keys, replay::stream_ref s) {
  if (hidden % 8 != 0) throw replay::usage_error("qwen::launch_embed: hidden must be a multiple of 8");
  replay::launch(embed_kernel, {.grid = dim3(rows), .block = dim3(128), .stream = s, .pdl = true}, embed, vocab, hidden,
                 meta, residual, keys);
}

void launch_rmsnorm(const float* residual, const bf16* w, int hidden, float eps, int rows, bf16* out,
                    replay::stream_ref s) {
  replay::launch(rmsnorm_kernel, {.grid = dim3(rows), .block = dim3(256), .stream = s, .pdl = true}, residual, w, hidden,
                 eps, out);
}

void launch_silu_mul(const float* gu, int N, int rows, bf16* act, replay::stream_ref s) {
  replay::launch(silu_mul_kernel, {.grid = dim3(fill_grid(std::size_t(rows) * N)), .block = dim3(256), .stream = s, .pdl = true},
                 gu, N, rows, act);
}

void launch_argmax(const float* logits, int V, int rows, unsigned long long* keys, replay::stream_ref s, int index0) {
  replay::launch(argmax_kernel, {.grid = dim3(rows), .block = dim3(1024), .stream = s, .pdl = true}, logits, V, keys,
                 index0);
}

void launch_unshard_logits(const float* gathered, int tp, int rows, int shard, float* logits, replay::stream_ref s) {
  replay::launch(unshard_logits_kernel,
                 {.grid = dim3(fill_grid(std::size_t(tp) * rows * shard)), .block = dim3(256), .stream = s, .pdl = true},
                 gathered, tp, rows, shard, logits);
}

// ---- the device loop's step end (Engine::decode_loop) ------------------------------------------------

namespace {

/// The last kernel of a step in the device loop, one thread: the step's token (row 0's argmax key)
/// is appended to the loop's result, and row 0's metadata becomes the next step's (that token, at
/// position + 1). The next step's kernels read it once this kernel has completed: each run of the
/// loop's body holds one step, and a run starts after the previous one has ended.
__global__ void loop_advance_kernel(const unsigned long long* keys, std::int32_t* token, std::int32_t* pos,
                                    int max_context, replay::token_loop_ref loop) {
  replay::pdl::wait();
  const int t = key_to_token(keys[0]);
  const int p = pos[0];
  token[0] = t;
  pos[0] = p + 1;
  // `t` sits at position p + 1: the sequence holds p + 2 tokens, the context is full at max_context.
  (void)loop.append(t, p + 2 >= max_context);
}

}  // namespace

void launch_loop_advance(const unsigned long long* keys, std::int32_t* token, std::int32_t* pos, int max_context,
                         replay::token_loop_ref loop, replay::stream_ref s) {
  if (loop.header == nullptr) throw replay::usage_error("qwen::launch_loop_advance: a null token loop");
  replay::launch(loop_advance_kernel, {.grid = dim3(1), .block = dim3(1), .stream = s, .pdl = true}, keys, token, pos,
                 max_context, loop);
}

}  // namespace qwen
