# Finds every dependency that is not CUDA. Nothing is vendored.
find_package(Threads REQUIRED)
# liburing and hwloc through pkg-config where it exists; a machine without it (a lent GPU image
# with the libraries unpacked beside the tree) finds the header and library directly, under the
# same target names.
find_package(PkgConfig QUIET)
if(PKG_CONFIG_FOUND)
  pkg_check_modules(URING REQUIRED IMPORTED_TARGET liburing)
  pkg_check_modules(HWLOC REQUIRED IMPORTED_TARGET hwloc)
else()
  foreach(_dep IN ITEMS "URING;liburing.h;uring" "HWLOC;hwloc.h;hwloc")
    list(GET _dep 0 _name)
    list(GET _dep 1 _header)
    list(GET _dep 2 _lib)
    find_path(STRATA_${_name}_INCLUDE ${_header})
    find_library(STRATA_${_name}_LIB ${_lib})
    if(NOT STRATA_${_name}_INCLUDE OR NOT STRATA_${_name}_LIB)
      message(FATAL_ERROR "${_header} / lib${_lib} not found and no pkg-config to ask: install "
                          "liburing-dev, libhwloc-dev and pkgconf (tools/scripts/setup.sh does), or "
                          "pass -DCMAKE_INCLUDE_PATH and -DCMAKE_LIBRARY_PATH")
    endif()
    add_library(PkgConfig::${_name} INTERFACE IMPORTED)
    target_include_directories(PkgConfig::${_name} INTERFACE "${STRATA_${_name}_INCLUDE}")
    target_link_libraries(PkgConfig::${_name} INTERFACE "${STRATA_${_name}_LIB}")
  endforeach()
endif()
find_package(TBB REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(CLI11 CONFIG QUIET)
if(NOT CLI11_FOUND)
  find_path(CLI11_INCLUDE_DIR CLI/CLI.hpp REQUIRED)
  add_library(CLI11::CLI11 INTERFACE IMPORTED)
  target_include_directories(CLI11::CLI11 INTERFACE "${CLI11_INCLUDE_DIR}")
endif()

# LibTorch: a TorchConfig.cmake (LibTorch 2.x zip, pip wheel) wins; otherwise Debian's
# libtorch-dev layout (headers in the system include dir plus torch/csrc/api/include; libraries
# torch, torch_cpu, c10). Both end in one target, strata::torch.
find_package(Torch QUIET)
add_library(strata_torch_deps INTERFACE)
add_library(strata::torch ALIAS strata_torch_deps)
if(Torch_FOUND)
  set(STRATA_TORCH_LAYOUT "TorchConfig")
  target_link_libraries(strata_torch_deps INTERFACE ${TORCH_LIBRARIES})
  target_include_directories(strata_torch_deps INTERFACE ${TORCH_INCLUDE_DIRS})
else()
  find_path(STRATA_TORCH_API_INCLUDE torch/torch.h
            PATHS /usr/include/torch/csrc/api/include NO_DEFAULT_PATH)
  find_library(STRATA_TORCH_LIB torch)
  find_library(STRATA_TORCH_CPU_LIB torch_cpu)
  find_library(STRATA_C10_LIB c10)
  if(NOT STRATA_TORCH_API_INCLUDE OR NOT STRATA_TORCH_LIB OR NOT STRATA_TORCH_CPU_LIB OR NOT STRATA_C10_LIB)
    message(FATAL_ERROR "LibTorch not found: install libtorch-dev (tools/scripts/setup.sh does) "
                        "or pass -DCMAKE_PREFIX_PATH=/path/to/libtorch")
  endif()
  set(STRATA_TORCH_LAYOUT "Debian")
  target_include_directories(strata_torch_deps INTERFACE "${STRATA_TORCH_API_INCLUDE}")
  target_link_libraries(strata_torch_deps INTERFACE "${STRATA_TORCH_LIB}" "${STRATA_TORCH_CPU_LIB}"
                                                    "${STRATA_C10_LIB}")
endif()
# The C++ standard LibTorch's headers need, read from the #error line ATen.h keeps for it: 14 in
# Debian's 1.13, 17 in 2.6, 20 in 2.14. The build uses the newer of that and its own 17, for
# every target, so that one process never mixes standard-library modes.
find_file(STRATA_ATEN_HEADER ATen/ATen.h PATHS ${TORCH_INCLUDE_DIRS} NO_CACHE)
if(STRATA_ATEN_HEADER)
  file(STRINGS "${STRATA_ATEN_HEADER}" _aten_std REGEX "C\\+\\+[0-9]+ or later")
  if(_aten_std MATCHES "C\\+\\+([0-9]+) or later" AND CMAKE_MATCH_1 GREATER CMAKE_CXX_STANDARD)
    message(STATUS "LibTorch's headers need C++${CMAKE_MATCH_1}: building as C++${CMAKE_MATCH_1}")
    set(CMAKE_CXX_STANDARD ${CMAKE_MATCH_1})
  endif()
endif()
# c10d's headers expose ProcessGroupGloo only with USE_C10D_GLOO, which LibTorch builds that
# include Gloo (Debian's does; libgloo-dev supplies the headers) need defined by their users.
find_path(STRATA_GLOO_INCLUDE gloo/config.h)
if(STRATA_GLOO_INCLUDE)
  target_compile_definitions(strata_torch_deps INTERFACE USE_C10D_GLOO USE_DISTRIBUTED)
  set(STRATA_HAVE_GLOO ON)
else()
  set(STRATA_HAVE_GLOO OFF)
endif()

if(STRATA_BUILD_TESTS)
  find_package(GTest REQUIRED)
  find_package(benchmark QUIET)
endif()
