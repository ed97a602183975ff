// GPU tests of capture_watch (capture_watch.hpp): the call that broke a capture is named, with the
// module that made it, for a call of our own that skipped REPLAY_CHECK and for calls cuBLAS makes
// inside a capture. The messages are printed so that a run shows what a user would see.
//
// Every test here provokes CUDA API errors on purpose (suite "expected_cuda_errors").
#include <doctest/doctest.h>
#include <gpu_test.hpp>
#include <replay/capture_watch.hpp>
#include <replay/replay.hpp>

#include <cublas_v2.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// Captures `body` on `s`; returns the message of the cuda_error the capture ended with, or "" when
/// it produced a graph.
std::string capture_message(replay::stream_ref s, const std::function<void(replay::stream_ref)>& body) {
  try {
    replay::graph g = replay::capture(s, [&](replay::stream_ref cs) { body(cs); });
    return {};
  } catch (const replay::cuda_error& e) {
    return e.what();
  }
}

/// compute-sanitizer and profilers are CUPTI clients themselves, and CUPTI allows one: under them
/// the watch is unavailable and these cases cannot run (they say so and check nothing).
bool another_cupti_client(const replay::capture_watch& w) {
  if (w.available() || w.unavailable_reason().find("MULTIPLE_SUBSCRIBERS") == std::string::npos) return false;
  std::printf("NOT RUN (another CUPTI client, e.g. compute-sanitizer, is attached): %s\n",
              w.unavailable_reason().c_str());
  return true;
}

}  // namespace

TEST_SUITE("expected_cuda_errors") {

TEST_CASE("capture_watch names an unchecked call of our own that broke the capture") {
  replay::capture_watch watch;
  if (another_cupti_client(watch)) return;
  REQUIRE_MESSAGE(watch.available(), watch.unavailable_reason());
  replay::stream s;
  void* p = nullptr;
  const std::string msg = capture_message(s, [&](replay::stream_ref) {
    (void)cudaMalloc(&p, 1024);  // capture-unsafe, and its error is ignored
  });
  std::printf("--- unchecked cudaMalloc inside a capture:\n%s\n", msg.c_str());
  CHECK(contains(msg, "cudaStreamEndCapture"));
  CHECK(contains(msg, "first failed call while capturing: cudaMalloc"));
  const auto f = watch.first_failure();
  REQUIRE(f.has_value());
  CHECK(contains(f->describe(), "cudaMalloc"));
  CHECK_FALSE(f->module.empty());
  CHECK_FALSE(s.is_capturing());
}

TEST_CASE("capture_watch names the CUDA call that cuBLAS made inside a capture") {
  replay::capture_watch watch;
  if (another_cupti_client(watch)) return;
  REQUIRE_MESSAGE(watch.available(), watch.unavailable_reason());
  replay::stream s;
  replay::device_buffer<float> x(256), y(256);
  REPLAY_CHECK(cudaMemsetAsync(x.data(), 0, x.size_bytes(), s.get()));
  REPLAY_CHECK(cudaMemsetAsync(y.data(), 0, y.size_bytes(), s.get()));
  cublasHandle_t h = nullptr;
  REQUIRE(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS);
  REQUIRE(cublasSetStream(h, s.get()) == CUBLAS_STATUS_SUCCESS);
  s.synchronize();

  struct breaker {
    const char* name;
    std::function<void(replay::stream_ref)> body;
  };
  float host_result = 0;
  cublasHandle_t created = nullptr;
  std::vector<float> host(256, 1.0f);
  const std::vector<breaker> breakers = {
      // A reduction whose result goes to host memory: cuBLAS must wait for it.
      {"cublasSdot with CUBLAS_POINTER_MODE_HOST",
       [&](replay::stream_ref) {
         (void)cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST);
         (void)cublasSdot(h, 256, x.data(), 1, y.data(), 1, &host_result);
       }},
      // Creating a handle allocates and initialises on the device.
      {"cublasCreate", [&](replay::stream_ref) { (void)cublasCreate(&created); }},
      // The vector helpers copy synchronously.
      {"cublasSetVector", [&](replay::stream_ref) { (void)cublasSetVector(256, sizeof(float), host.data(), 1, x.data(), 1); }},
  };
  int broken = 0;
  bool named_cublas = false;
  for (const breaker& b : breakers) {
    const std::string msg = capture_message(s, b.body);
    const auto f = watch.first_failure();
    std::printf("--- %s inside a capture:\n%s\n", b.name,
                msg.empty() ? (f ? ("capture survived; failed call: " + f->describe()).c_str() : "capture survived; no failed call")
                            : msg.c_str());
    if (!msg.empty()) {
      ++broken;
      CHECK(contains(msg, "first failed call while capturing: "));
      named_cublas |= f.has_value() && contains(f->module, "libcublas");
    }
    (void)cudaGetLastError();
    CHECK_FALSE(s.is_capturing());
  }
  if (created != nullptr) (void)cublasDestroy(created);
  (void)cublasDestroy(h);
  CHECK(broken >= 1);
  CHECK(named_cublas);
}

TEST_CASE("without a watch nothing is added and a second watch is refused") {
  replay::stream s;
  void* p = nullptr;
  const std::string plain = capture_message(s, [&](replay::stream_ref) { (void)cudaMalloc(&p, 1024); });
  CHECK(contains(plain, "cudaStreamEndCapture"));
  CHECK_FALSE(contains(plain, "first failed call"));
  replay::capture_watch one;
  replay::capture_watch two;
  if (one.available()) {
    CHECK_FALSE(two.available());
    CHECK(contains(two.unavailable_reason(), "another replay::capture_watch"));
  }
}

}  // TEST_SUITE
