// examples/qwen/cublas.hpp: a checked cuBLAS call (QWEN_CUBLAS) and an owning cuBLAS handle, for the
// engine's GEMMs (model.cu) and the benchmark's GEMM rate (bench.cu).
#pragma once

#include <cublas_v2.h>
#include <fmt/format.h>

#include <stdexcept>
#include <utility>

/// Evaluates a cuBLAS call; throws std::runtime_error naming the call and cuBLAS's status string.
#define QWEN_CUBLAS(call)                                                                                    \
  do {                                                                                                       \
    const cublasStatus_t qwen_st_ = (call);                                                                  \
    if (qwen_st_ != CUBLAS_STATUS_SUCCESS)                                                                   \
      throw std::runtime_error(fmt::format("cuBLAS call {} failed: {}", #call, cublasGetStatusString(qwen_st_))); \
  } while (false)

namespace qwen {

/// Owns a cuBLAS handle. Move-only; the destructor never throws.
class CublasHandle {
 public:
  CublasHandle() { QWEN_CUBLAS(cublasCreate(&h_)); }
  ~CublasHandle() {
    if (h_ != nullptr) (void)cublasDestroy(h_);
  }
  CublasHandle(CublasHandle&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  CublasHandle& operator=(CublasHandle&&) = delete;
  [[nodiscard]] cublasHandle_t get() const { return h_; }

 private:
  cublasHandle_t h_ = nullptr;
};

}  // namespace qwen
