# Extra link settings of the benchmark programs (included by benchmarks/CMakeLists.txt).
# bench_decode_step measures the example decoders: it links whichever of them this build has
# (REPLAY_EXAMPLES selects them) and compiles only the benchmarks of those it links.
if(TARGET bench_decode_step)
  if(TARGET replay_example_nanogpt)
    target_link_libraries(bench_decode_step PRIVATE replay_example_nanogpt)
    target_compile_definitions(bench_decode_step PRIVATE REPLAY_BENCH_HAVE_NANOGPT=1)
  endif()
  if(TARGET replay_example_qwen)
    target_link_libraries(bench_decode_step PRIVATE replay_example_qwen)
    target_compile_definitions(bench_decode_step PRIVATE REPLAY_BENCH_HAVE_QWEN=1)
  endif()
endif()
