// A toy decode step for the pool and runner GPU tests: four kernels that read per-row metadata
// (token, position, scale) through a pointer, with buffers sized once for the largest bucket.
// Row r of a step computes, for d in [0, width):
//   out[r][d] = (token[r] * 0.25 + d) * scale[r] + pos[r]      (exact in float for our inputs)
//   sums[r]   = sum over d of out[r][d]                         (a fixed-order tree reduction)
// Rows are independent, so a batch padded to a bucket gives the real rows bit-identical results.
#pragma once

#include <gpu_test.hpp>
#include <replay/replay.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace pool_toy {

struct row_meta {
  int token;
  int pos;
  float scale;
};

inline constexpr int width = 64;  // threads per row (one block per row)

__global__ void embed(const row_meta* meta, float* x) {
  const int r = blockIdx.x, d = threadIdx.x;
  x[r * width + d] = static_cast<float>(meta[r].token) * 0.25f + static_cast<float>(d);
}
__global__ void scale_rows(const row_meta* meta, float* x) {
  const int r = blockIdx.x, d = threadIdx.x;
  x[r * width + d] *= meta[r].scale;
}
__global__ void add_pos(const row_meta* meta, const float* x, float* out) {
  const int r = blockIdx.x, d = threadIdx.x;
  out[r * width + d] = x[r * width + d] + static_cast<float>(meta[r].pos);
}
__global__ void row_sum(const float* out, float* sums) {
  __shared__ float s[width];
  const int r = blockIdx.x, d = threadIdx.x;
  s[d] = out[r * width + d];
  __syncthreads();
  for (int stride = width / 2; stride > 0; stride /= 2) {
    if (d < stride) s[d] += s[d + stride];
    __syncthreads();
  }
  if (d == 0) sums[r] = s[0];
}

/// The model: metadata and buffers for `max_rows` rows, allocated once (persistent batch).
struct model {
  explicit model(std::size_t max_rows)
      : max_rows(max_rows), meta(max_rows), x(max_rows * width), out(max_rows * width), sums(max_rows) {}

  /// The decode step for `rows` rows (a bucket): four launches on `s`, grid = rows.
  void step(replay::stream_ref s, std::size_t rows) const {
    if (rows == 0 || rows > max_rows)
      throw replay::usage_error("pool_toy::model::step: rows out of range");
    const dim3 grid(static_cast<unsigned>(rows));
    embed<<<grid, width, 0, s.get()>>>(meta.device(), x.data());
    REPLAY_CHECK_LAUNCH("embed");
    scale_rows<<<grid, width, 0, s.get()>>>(meta.device(), x.data());
    REPLAY_CHECK_LAUNCH("scale_rows");
    add_pos<<<grid, width, 0, s.get()>>>(meta.device(), x.data(), out.data());
    REPLAY_CHECK_LAUNCH("add_pos");
    row_sum<<<grid, width, 0, s.get()>>>(out.data(), sums.data());
    REPLAY_CHECK_LAUNCH("row_sum");
  }

  /// Stages `real` rows of step `t` and `bucket - real` padding rows, then pushes them on `s`.
  void stage(std::size_t real, std::size_t bucket, int t, replay::stream_ref s) {
    auto st = meta.staging();
    for (std::size_t r = 0; r < bucket; ++r)
      st[r] = r < real ? row_value(r, t) : row_meta{0, 0, 1.0f};  // padding rows: harmless values
    meta.push(s, bucket);
  }

  static row_meta row_value(std::size_t r, int t) {
    static constexpr float scales[] = {0.5f, 1.0f, 1.5f, 2.0f};
    return row_meta{static_cast<int>(7 * r + 13 * t) % 1000, static_cast<int>(r) + t,
                    scales[(r + static_cast<std::size_t>(t)) % 4]};
  }
  /// The host-side expected out[r][d].
  static float expected(std::size_t r, int t, int d) {
    const row_meta m = row_value(r, t);
    return (static_cast<float>(m.token) * 0.25f + static_cast<float>(d)) * m.scale + static_cast<float>(m.pos);
  }

  void poison(replay::stream_ref s) const {
    replay_test::poison(out.data(), out.size_bytes(), s);
    replay_test::poison(sums.data(), sums.size_bytes(), s);
  }
  /// The first `rows` rows of out and sums, copied to the host (synchronises).
  std::vector<float> out_rows(std::size_t rows, replay::stream_ref s) const {
    return replay_test::to_host(out.data(), rows * width, s);
  }
  std::vector<float> sum_rows(std::size_t rows, replay::stream_ref s) const {
    return replay_test::to_host(sums.data(), rows, s);
  }

  std::size_t max_rows;
  replay::step_meta_array<row_meta> meta;
  replay::device_buffer<float> x;
  replay::device_buffer<float> out;
  replay::device_buffer<float> sums;
};

/// Bitwise equality of two float vectors (NaN payloads of the poison compare as bits too).
inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// Number of mismatches between out rows and the host formula.
inline int mismatches(const std::vector<float>& out, std::size_t rows, int t) {
  int bad = 0;
  for (std::size_t r = 0; r < rows; ++r)
    for (int d = 0; d < width; ++d)
      if (out[r * width + static_cast<std::size_t>(d)] != model::expected(r, t, d)) ++bad;
  return bad;
}

}  // namespace pool_toy
