// Host tests: error formatting, API-name extraction and capture hints (no GPU needed).
#include <doctest/doctest.h>
#include <replay/error.hpp>
#include <replay/stream.hpp>

#include <string>
#include <type_traits>

using replay::capture_state;
using replay::cuda_error;

namespace {
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
}  // namespace

TEST_CASE("api_name extracts the called function from the checked expression") {
  static_assert(replay::detail::api_name("cudaMalloc(&p, n)") == "cudaMalloc");
  static_assert(replay::detail::api_name("::cudaStreamSynchronize (s)") == "cudaStreamSynchronize");
  static_assert(replay::detail::api_name("err") == "err");
  CHECK(replay::detail::api_name("cudaMemcpyAsync(a, b, n, k, s.get())") == "cudaMemcpyAsync");
}

TEST_CASE("cuda_error carries code, API, location and context") {
  const auto here = std::source_location::current();
  const cuda_error e(cudaErrorMemoryAllocation, "cudaMalloc", "KV cache", capture_state::none, here);
  CHECK(e.code() == cudaErrorMemoryAllocation);
  CHECK(e.api() == "cudaMalloc");
  CHECK(e.where().line() == here.line());
  CHECK_FALSE(e.during_capture());
  const std::string msg = e.what();
  CHECK(contains(msg, "cudaMalloc failed"));
  CHECK(contains(msg, "cudaErrorMemoryAllocation"));
  CHECK(contains(msg, "[KV cache]"));
  CHECK(contains(msg, "test_error.cpp"));
  CHECK_FALSE(contains(msg, "capturing"));
  static_assert(std::is_base_of_v<std::runtime_error, cuda_error>);
}

TEST_CASE("errors during capture say so and hint at the cause") {
  const auto here = std::source_location::current();
  SUBCASE("allocation") {
    const cuda_error e(cudaErrorStreamCaptureUnsupported, "cudaMalloc", "", capture_state::invalidated, here);
    CHECK(e.during_capture());
    const std::string msg = e.what();
    CHECK(contains(msg, "while the stream was capturing"));
    CHECK(contains(msg, "invalidated"));
    CHECK(contains(msg, "allocate every buffer before capture"));
  }
  SUBCASE("synchronisation") {
    const cuda_error e(cudaErrorStreamCaptureUnsupported, "cudaStreamSynchronize", "", capture_state::active, here);
    CHECK(contains(e.what(), "must not synchronise"));
  }
  SUBCASE("legacy stream") {
    const cuda_error e(cudaErrorStreamCaptureImplicit, "kernel launch (k)", "", capture_state::active, here);
    CHECK(contains(e.what(), "legacy default stream"));
  }
  SUBCASE("a capture error code implies capture even without a registered scope") {
    const cuda_error e(cudaErrorStreamCaptureInvalidated, "cudaStreamEndCapture", "", capture_state::none, here);
    CHECK(contains(e.what(), "capturing"));
  }
}

TEST_CASE("REPLAY_CHECK throws only on failure and formats context lazily") {
  CHECK_NOTHROW(REPLAY_CHECK(cudaSuccess));
  int formatted = 0;
  auto count = [&] { return ++formatted; };
  CHECK_NOTHROW(REPLAY_CHECK(cudaSuccess, "never formatted {}", count()));
  CHECK(formatted == 0);
  try {
    REPLAY_CHECK(cudaErrorInvalidValue, "layer {}", 3);
    FAIL("expected a throw");
  } catch (const cuda_error& e) {
    CHECK(e.code() == cudaErrorInvalidValue);
    CHECK(contains(e.what(), "[layer 3]"));
  }
}

TEST_CASE("stream_ref cannot be made from 0 or nullptr") {
  static_assert(!std::is_constructible_v<replay::stream_ref, int>);
  static_assert(!std::is_constructible_v<replay::stream_ref, std::nullptr_t>);
  static_assert(std::is_constructible_v<replay::stream_ref, cudaStream_t>);
  static_assert(!std::is_convertible_v<cudaStream_t, replay::stream_ref>);
  static_assert(!std::is_copy_constructible_v<replay::stream>);
  static_assert(std::is_nothrow_move_constructible_v<replay::stream>);
  CHECK(replay::stream_ref::legacy().get() == nullptr);
}
