# Helpers for replay's own targets (tests, examples, benchmarks). Not installed.
#
# Every GPU test executable exits with REPLAY_SKIP_CODE when no CUDA device exists, and CTest
# reports it as skipped (never passed).
set(REPLAY_SKIP_CODE 77)
find_package(doctest QUIET)
set(REPLAY_SUPPORT_DIR ${PROJECT_SOURCE_DIR}/tests/support)

# Warnings and settings shared by our own targets.
function(replay_target_defaults target)
  set_target_properties(${target} PROPERTIES CXX_EXTENSIONS OFF CUDA_EXTENSIONS OFF)
  target_compile_features(${target} PRIVATE cxx_std_20)
  # CMake < 3.30 does not know nvcc 13's dialect flags (CUDA_STANDARD 20 fails), so pass it directly.
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>
    $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20 -Xcompiler=-Wall -diag-suppress=20208 --expt-relaxed-constexpr -lineinfo>)
endfunction()

# replay_add_host_test(NAME name SOURCES a.cpp ... [LIBS ...])
# A doctest executable that needs no GPU (runs in CI).
function(replay_add_host_test)
  cmake_parse_arguments(T "" "NAME" "SOURCES;LIBS" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES} ${REPLAY_SUPPORT_DIR}/host_main.cpp)
  target_link_libraries(${T_NAME} PRIVATE replay::replay doctest::doctest ${T_LIBS})
  target_include_directories(${T_NAME} PRIVATE ${REPLAY_SUPPORT_DIR})
  replay_target_defaults(${T_NAME})
  add_test(NAME ${T_NAME} COMMAND ${T_NAME})
  set_tests_properties(${T_NAME} PROPERTIES LABELS host)
endfunction()

# replay_add_gpu_test(NAME name SOURCES a.cu ... [LIBS ...])
# A doctest executable that needs a CUDA device; skipped (exit 77) where none exists.
function(replay_add_gpu_test)
  cmake_parse_arguments(T "" "NAME" "SOURCES;LIBS" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES} ${REPLAY_SUPPORT_DIR}/gpu_main.cpp)
  target_link_libraries(${T_NAME} PRIVATE replay::replay doctest::doctest ${T_LIBS})
  target_include_directories(${T_NAME} PRIVATE ${REPLAY_SUPPORT_DIR})
  replay_target_defaults(${T_NAME})
  add_test(NAME ${T_NAME} COMMAND ${T_NAME})
  set_tests_properties(${T_NAME} PROPERTIES LABELS gpu SKIP_RETURN_CODE ${REPLAY_SKIP_CODE})
endfunction()
