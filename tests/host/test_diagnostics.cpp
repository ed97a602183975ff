// Host tests of the diagnostics that need no GPU: NVTX range names carry the key and ranges open
// and close without a profiler; the capture watch's stack filtering and its message.
#include <doctest/doctest.h>
#include <replay/capture_watch.hpp>
#include <replay/graph_pool.hpp>
#include <replay/nvtx.hpp>

#include <string>

namespace {
struct opaque_key {
  int id;
};
}  // namespace

TEST_CASE("nvtx_name puts the key in the range name") {
  CHECK(replay::nvtx_name("capture", replay::graph_key{.bucket = 8}).starts_with("capture "));
  CHECK(replay::nvtx_name("capture", replay::graph_key{.bucket = 8}).find('8') != std::string::npos);
  CHECK(replay::nvtx_name("replay", 16) == "replay 16");
  CHECK(replay::nvtx_name("evict", opaque_key{3}) == "evict");  // not printable: the phase alone
}

TEST_CASE("ranges nest and close without a profiler attached") {
  static_assert(!std::is_copy_constructible_v<replay::nvtx_range>);
  {
    replay::nvtx_range outer("capture", replay::graph_key{.bucket = 1});
    const std::string cached = replay::nvtx_name("replay", 1);
    replay::nvtx_range inner(cached);
    replay::nvtx_range plain("upload");
  }
  CHECK(REPLAY_NVTX == 1);  // the toolkit's NVTX3 headers are found by default
}

TEST_CASE("capture_watch: the caller is the first module past CUPTI, the driver and the runtime") {
  using replay::detail::is_cuda_stack_module;
  using replay::detail::module_basename;
  static_assert(module_basename("/usr/lib/x86_64-linux-gnu/libcublas.so.13") == "libcublas.so.13");
  static_assert(module_basename("a.out") == "a.out");
  CHECK(is_cuda_stack_module("/usr/local/cuda/lib64/libcupti.so.13"));
  CHECK(is_cuda_stack_module("/usr/lib/x86_64-linux-gnu/libcuda.so.1"));
  CHECK(is_cuda_stack_module("/usr/local/cuda/lib64/libcudart.so.13"));
  CHECK_FALSE(is_cuda_stack_module("/usr/local/cuda/lib64/libcublas.so.13"));
  CHECK_FALSE(is_cuda_stack_module("/usr/local/cuda/lib64/libcublasLt.so.13"));
  CHECK_FALSE(is_cuda_stack_module("/work/build/tests/gpu_test_capture_watch"));
}

TEST_CASE("capture_watch: polling and error queries are not failures") {
  using replay::detail::ignored_failure;
  CHECK(ignored_failure("cudaStreamQuery", 600));
  CHECK(ignored_failure("cudaGetLastError", 900));
  CHECK(ignored_failure("cuGetProcAddress_v2", 500));
  CHECK_FALSE(ignored_failure("cudaMalloc", 900));
  CHECK_FALSE(ignored_failure("cuStreamSynchronize", 900));
}

TEST_CASE("capture_watch: the message names the call, the error and the module") {
  replay::failed_call f;
  f.api = "cuMemAlloc_v2";
  f.driver = true;
  f.code = 900;
  f.outer_api = "cudaMalloc";
  f.module = "libcublas.so.13";
  f.offset = 0x1234;
  CHECK(f.describe() == "cudaMalloc (driver call cuMemAlloc_v2) returned CUresult 900 "
                        "(cudaErrorStreamCaptureUnsupported), called from libcublas.so.13 (+0x1234)");
  replay::failed_call r;
  r.api = "cudaStreamSynchronize";
  r.code = 900;
  r.module = "app";
  r.symbol = "step()";
  r.offset = 0x2c;
  CHECK(r.describe() == "cudaStreamSynchronize returned cudaErrorStreamCaptureUnsupported, called from app "
                        "(step()+0x2c)");
}
