# Default CUDA architectures for replay's own tests, examples and benchmarks.
# CMake's "native" fails on machines without a GPU (CI), so when the user set nothing we build for
# sm_90 (H100/H200). This file is only included when replay builds its own programs: consumers of the
# replay::replay target never get an architecture forced on them.
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
  set(CMAKE_CUDA_ARCHITECTURES 90 CACHE STRING "CUDA architectures for replay's own targets")
endif()
