# cmake -P script: builds tests/package/consumer against replay, either after installing replay to
# a temporary prefix (MODE=find_package) or through add_subdirectory (MODE=add_subdirectory).
cmake_minimum_required(VERSION 3.24)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
set(consumer ${CMAKE_CURRENT_LIST_DIR}/consumer)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
endfunction()

if(MODE STREQUAL "find_package")
  # Configure replay alone (its own tests/examples off), install to the temporary prefix.
  run(${CMAKE_COMMAND} -S ${REPLAY_SOURCE_DIR} -B ${WORK_DIR}/replay-build -G ${GENERATOR}
      -DCMAKE_INSTALL_PREFIX=${prefix} -DREPLAY_BUILD_TESTS=OFF -DREPLAY_BUILD_EXAMPLES=OFF
      -DREPLAY_BUILD_BENCHMARKS=OFF -DREPLAY_INSTALL=ON)
  run(${CMAKE_COMMAND} --install ${WORK_DIR}/replay-build)
  if(NOT EXISTS ${prefix}/include/replay/replay.hpp)
    message(FATAL_ERROR "install did not put replay.hpp under ${prefix}/include/replay")
  endif()
  run(${CMAKE_COMMAND} -S ${consumer} -B ${WORK_DIR}/consumer-build -G ${GENERATOR}
      -DCMAKE_PREFIX_PATH=${prefix} -DCONSUMER_MODE=find_package)
else()
  run(${CMAKE_COMMAND} -S ${consumer} -B ${WORK_DIR}/consumer-build -G ${GENERATOR}
      -DREPLAY_SOURCE_DIR=${REPLAY_SOURCE_DIR} -DCONSUMER_MODE=add_subdirectory)
endif()
run(${CMAKE_COMMAND} --build ${WORK_DIR}/consumer-build)
run(${WORK_DIR}/consumer-build/consumer)
message(STATUS "consumer built and ran with ${MODE}")
