// The README's example, compiled and run as written (keep the two in sync).
#include <doctest/doctest.h>
#include <gpu_test.hpp>
#include <replay/replay.hpp>

namespace {

struct step_t { int token; int pos; };                   // per-step values, read on the device

__global__ void decode(const step_t* meta, float* kv, float* out) {
  const step_t m = *meta;                                // never baked into the graph
  out[m.pos] = kv[m.pos] + m.token;
}

void generate(float* kv, float* out, int first_token, int steps) {
  replay::stream s;                                      // non-blocking, owning
  replay::step_meta<step_t> meta;                        // fixed device address + pinned staging
  replay::graph_exec exec = replay::capture(s, [&](replay::stream_ref cs) {
    decode<<<1, 1, 0, cs.get()>>>(meta.device(), kv, out);
    REPLAY_CHECK_LAUNCH("decode");
  }).instantiate({.upload_stream = s.get()});
  for (int pos = 0; pos < steps; ++pos) {
    meta.staging() = {first_token, pos};                 // double-buffered host staging
    meta.push(s);                                        // async copy to the fixed address
    exec.launch(s);                                      // one launch replays the whole step
  }
  s.synchronize();
}

__global__ void iota(float* kv, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) kv[i] = static_cast<float>(i);
}

}  // namespace

TEST_CASE("README example: capture once, replay with step metadata") {
  constexpr int steps = 32;
  replay::stream s;
  replay::device_buffer<float> kv(steps);
  replay::device_buffer<float> out(steps);
  iota<<<1, steps, 0, s.get()>>>(kv.data(), steps);
  REPLAY_CHECK_LAUNCH("iota");
  replay_test::poison(out.data(), out.size_bytes(), s);
  s.synchronize();
  generate(kv.data(), out.data(), 7, steps);
  const auto host = replay_test::to_host(out.data(), steps, s);
  for (int pos = 0; pos < steps; ++pos) CHECK(host[pos] == static_cast<float>(pos + 7));
}
