# PCRE2 (8-bit) and utf8proc for the Qwen tokenizer, as imported targets qwen_text::pcre2 and
# qwen_text::utf8proc. Searched with find_path/find_library, so CMAKE_PREFIX_PATH (an unpacked
# package root) works as well as the system directories; pkg-config's paths are used as hints.
find_package(PkgConfig QUIET)
if(PkgConfig_FOUND)
  pkg_check_modules(PC_PCRE2 QUIET libpcre2-8)
  pkg_check_modules(PC_UTF8PROC QUIET libutf8proc)
endif()
find_path(QWEN_PCRE2_INCLUDE_DIR pcre2.h HINTS ${PC_PCRE2_INCLUDE_DIRS})
find_library(QWEN_PCRE2_LIBRARY NAMES pcre2-8 HINTS ${PC_PCRE2_LIBRARY_DIRS})
find_path(QWEN_UTF8PROC_INCLUDE_DIR utf8proc.h HINTS ${PC_UTF8PROC_INCLUDE_DIRS})
find_library(QWEN_UTF8PROC_LIBRARY NAMES utf8proc HINTS ${PC_UTF8PROC_LIBRARY_DIRS})
foreach(v QWEN_PCRE2_INCLUDE_DIR QWEN_PCRE2_LIBRARY QWEN_UTF8PROC_INCLUDE_DIR QWEN_UTF8PROC_LIBRARY)
  if(NOT ${v})
    message(FATAL_ERROR "The Qwen tokenizer needs PCRE2 and utf8proc (Debian: libpcre2-dev libutf8proc-dev); "
                        "${v} was not found")
  endif()
endforeach()
if(NOT TARGET qwen_text::pcre2)
  add_library(qwen_text::pcre2 UNKNOWN IMPORTED)
  set_target_properties(qwen_text::pcre2 PROPERTIES IMPORTED_LOCATION ${QWEN_PCRE2_LIBRARY}
                        INTERFACE_INCLUDE_DIRECTORIES ${QWEN_PCRE2_INCLUDE_DIR})
  add_library(qwen_text::utf8proc UNKNOWN IMPORTED)
  set_target_properties(qwen_text::utf8proc PROPERTIES IMPORTED_LOCATION ${QWEN_UTF8PROC_LIBRARY}
                        INTERFACE_INCLUDE_DIRECTORIES ${QWEN_UTF8PROC_INCLUDE_DIR})
endif()
