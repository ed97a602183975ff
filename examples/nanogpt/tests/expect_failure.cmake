# Runs EXE with ARGS (a ;-list) and passes only if it exits non-zero AND its output matches REGEX.
# (CTest's PASS_REGULAR_EXPRESSION alone would ignore the exit code.)
execute_process(COMMAND ${EXE} ${ARGS} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err
                WORKING_DIRECTORY ${WORK})
set(all "${out}${err}")
message(STATUS "exit code: ${rc}\n${all}")
if(rc EQUAL 0)
  message(FATAL_ERROR "expected a non-zero exit code")
endif()
if(NOT all MATCHES "${REGEX}")
  message(FATAL_ERROR "output does not match: ${REGEX}")
endif()
