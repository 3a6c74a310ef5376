# The floors of the source tree, checked: which folder's files may include which project headers.
# Run as `cmake -DSOURCE_DIR=<root> -P cmake/CheckLayering.cmake` (CTest: layering_test). Fails
# naming each file and include that breaks a rule, so a new dependency that runs downwards is
# seen the day it is written.
#
#   runtime/base/   the ground floor: nothing of the project but itself
#   runtime/comm/   runtime/base/ and itself (LibTorch allowed: c10d's Gloo)
#   tiers/          runtime/base/ and itself
#   optim/          runtime/base/ and itself
#   kernels/        runtime/base/, optim/ and itself
#   runtime/state/  runtime/base/, tiers/, optim/ and itself, no LibTorch
#   runtime/engine/ and everything above (tools/, python/, tests/): no rule here
# These are the include rules of the libraries' link graph (the top CMakeLists.txt): a floor may
# include what it links.
cmake_minimum_required(VERSION 3.20)
if(NOT SOURCE_DIR)
  message(FATAL_ERROR "usage: cmake -DSOURCE_DIR=<repository root> -P CheckLayering.cmake")
endif()

# folder;allowed include prefixes (regex alternatives);whether LibTorch headers are allowed
set(_rules
  "runtime/base|runtime/base/|no"
  "runtime/comm|runtime/base/|runtime/comm/|yes"
  "tiers|runtime/base/|tiers/|no"
  "optim|runtime/base/|optim/|no"
  "kernels|runtime/base/|optim/|kernels/|no"
  "runtime/state|runtime/base/|tiers/|optim/|runtime/state/|no")

set(_violations "")
set(_checked 0)
foreach(_rule IN LISTS _rules)
  string(REPLACE "|" ";" _parts "${_rule}")
  list(POP_FRONT _parts _folder)
  list(POP_BACK _parts _torch_ok)
  string(JOIN "|" _allowed ${_parts})
  file(GLOB_RECURSE _files RELATIVE "${SOURCE_DIR}"
       "${SOURCE_DIR}/${_folder}/*.h" "${SOURCE_DIR}/${_folder}/*.cc"
       "${SOURCE_DIR}/${_folder}/*.cu" "${SOURCE_DIR}/${_folder}/*.inc")
  foreach(_f IN LISTS _files)
    math(EXPR _checked "${_checked} + 1")
    file(STRINGS "${SOURCE_DIR}/${_f}" _includes REGEX "^[ \t]*#[ \t]*include[ \t]*[\"<]")
    foreach(_line IN LISTS _includes)
      if(_line MATCHES "#[ \t]*include[ \t]*\"([^\"]+)\"")
        set(_inc "${CMAKE_MATCH_1}")
        # A project header: its first folder is one of the tree's. Anything else (a system or
        # third-party header in quotes) is not the layering's business.
        if(_inc MATCHES "^(runtime|tiers|optim|kernels|tools|python|tests)/"
           AND NOT _inc MATCHES "^(${_allowed})")
          list(APPEND _violations "${_f}: includes \"${_inc}\" (${_folder}/ may include only ${_allowed})")
        endif()
      endif()
      if(_torch_ok STREQUAL "no" AND _line MATCHES "#[ \t]*include[ \t]*[\"<](torch|ATen|c10)/")
        list(APPEND _violations "${_f}: includes LibTorch (${_line}); ${_folder}/ is below the LibTorch boundary")
      endif()
    endforeach()
  endforeach()
endforeach()

if(_checked LESS 50)
  message(FATAL_ERROR "layering: only ${_checked} files found under ${SOURCE_DIR}; wrong SOURCE_DIR?")
endif()
list(LENGTH _violations _n)
if(_n GREATER 0)
  list(JOIN _violations "\n  " _text)
  message(FATAL_ERROR "layering: ${_n} include(s) break the floors:\n  ${_text}\n"
          "Move the code up a floor, or the shared piece down (cmake/CheckLayering.cmake).")
endif()
message(STATUS "layering: ${_checked} files keep to their floors")
