# Finds the Python that the `strata` extension module builds against: the interpreter whose torch
# the module must share a LibTorch with. Included before LibTorch is looked up, because a pip
# torch (2.x) brings its own LibTorch (TorchConfig.cmake under torch.utils.cmake_prefix_path) and
# the whole build then has to use it; Debian's python3-torch has no TorchConfig and is the same
# build as libtorch-dev, which the Debian layout in StrataDeps.cmake finds.
#
# Sets STRATA_HAVE_PYTHON and, when on, STRATA_PY_EXECUTABLE, STRATA_PY_INCLUDES (Python,
# pybind11, torch), STRATA_PY_TORCH_PYTHON_LIB (libtorch_python), STRATA_PY_EXT_SUFFIX,
# STRATA_PY_TORCH_VERSION.
set(STRATA_PYTHON "AUTO" CACHE STRING
    "Build the Python module (import strata): AUTO (when a python3 with torch, pybind11 and headers exists), ON or OFF")
set_property(CACHE STRATA_PYTHON PROPERTY STRINGS AUTO ON OFF)
set(STRATA_PYTHON_EXECUTABLE "" CACHE FILEPATH
    "The python3 to build the module for; empty: /usr/bin/python3 when it has torch, else python3 on PATH")

set(STRATA_HAVE_PYTHON OFF)
if(NOT STRATA_PYTHON STREQUAL "OFF")
  set(_candidates)
  if(STRATA_PYTHON_EXECUTABLE)
    list(APPEND _candidates "${STRATA_PYTHON_EXECUTABLE}")
  else()
    # python3 on PATH may be a separate build without torch (pyenv); Debian's interpreter is the
    # one python3-torch installs into, so it is tried first.
    find_program(_strata_path_python3 python3)
    foreach(_c /usr/bin/python3 ${_strata_path_python3})
      if(EXISTS "${_c}")
        list(APPEND _candidates "${_c}")
      endif()
    endforeach()
  endif()
  set(_probe [=[
import os, sys, sysconfig
import torch, torch.utils, torch.utils.cpp_extension as ext
try:
    import pybind11
    pyb = pybind11.get_include()
except ImportError:
    pyb = ""
lib = ""
for d in ext.library_paths():
    for name in os.listdir(d):
        if name.startswith("libtorch_python.so"):
            lib = os.path.join(d, name)
            break
print("version=" + torch.__version__.split("+")[0])
print("includes=" + ";".join([sysconfig.get_paths()["include"]] + ([pyb] if pyb else []) + ext.include_paths()))
print("torch_python=" + lib)
print("suffix=" + sysconfig.get_config_var("EXT_SUFFIX"))
print("cmake_prefix=" + torch.utils.cmake_prefix_path)
print("cxx11_abi=" + str(int(torch._C._GLIBCXX_USE_CXX11_ABI)))
]=])
  # The module is dlopen'ed into a process that already holds torch's libstdc++.so.6, so it must
  # use that shared library, never a static copy (Note [one libstdc++] in python/CMakeLists.txt):
  # it links the compiler's libstdc++.so first, whatever the compiler's default, and a check after
  # linking refuses a module that does not need it. A compiler without a shared libstdc++ cannot
  # build the module at all.
  execute_process(COMMAND "${CMAKE_CXX_COMPILER}" -print-file-name=libstdc++.so
                  OUTPUT_VARIABLE _libstdcxx OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  set(STRATA_PY_LIBSTDCXX "")
  if(IS_ABSOLUTE "${_libstdcxx}" AND EXISTS "${_libstdcxx}")
    set(STRATA_PY_LIBSTDCXX "${_libstdcxx}")
  endif()
  set(_why "no python3 found")
  if(NOT STRATA_PY_LIBSTDCXX)
    set(_candidates)
    string(CONCAT _why "the C++ compiler ${CMAKE_CXX_COMPILER} has no shared libstdc++ "
             "(-print-file-name=libstdc++.so names no file): the module would carry a second "
             "libstdc++ beside the one torch loads. Configure with a compiler that has one, e.g. "
             "-DCMAKE_CXX_COMPILER=/usr/bin/g++ -DCMAKE_C_COMPILER=/usr/bin/gcc")
  endif()
  foreach(_py ${_candidates})
    execute_process(COMMAND "${_py}" -c "${_probe}" OUTPUT_VARIABLE _out ERROR_VARIABLE _err
                    RESULT_VARIABLE _rc)
    if(NOT _rc EQUAL 0)
      set(_why "${_py} cannot import torch (install python3-torch, or set STRATA_PYTHON_EXECUTABLE)")
      continue()
    endif()
    string(REGEX MATCH "version=([^\n]*)" _m "${_out}")
    set(STRATA_PY_TORCH_VERSION "${CMAKE_MATCH_1}")
    string(REGEX MATCH "includes=([^\n]*)" _m "${_out}")
    set(STRATA_PY_INCLUDES "${CMAKE_MATCH_1}")
    string(REGEX MATCH "torch_python=([^\n]*)" _m "${_out}")
    set(STRATA_PY_TORCH_PYTHON_LIB "${CMAKE_MATCH_1}")
    string(REGEX MATCH "suffix=([^\n]*)" _m "${_out}")
    set(STRATA_PY_EXT_SUFFIX "${CMAKE_MATCH_1}")
    string(REGEX MATCH "cmake_prefix=([^\n]*)" _m "${_out}")
    set(_prefix "${CMAKE_MATCH_1}")
    list(GET STRATA_PY_INCLUDES 0 _pyinc)
    set(_have_pybind OFF)
    foreach(_inc ${STRATA_PY_INCLUDES})
      if(EXISTS "${_inc}/pybind11/pybind11.h")
        set(_have_pybind ON)
      endif()
    endforeach()
    if(NOT EXISTS "${_pyinc}/Python.h")
      set(_why "${_py} has no headers (${_pyinc}/Python.h): install python3-dev")
    elseif(NOT _have_pybind)
      set(_why "${_py} has no pybind11 headers: install python3-pybind11")
    elseif(NOT STRATA_PY_TORCH_PYTHON_LIB)
      set(_why "${_py}'s torch has no libtorch_python")
    else()
      set(STRATA_HAVE_PYTHON ON)
      set(STRATA_PY_EXECUTABLE "${_py}")
      if(EXISTS "${_prefix}/Torch/TorchConfig.cmake")
        # A pip torch: its LibTorch is the one every target must link, or the module would load
        # two different LibTorch builds into one process.
        list(PREPEND CMAKE_PREFIX_PATH "${_prefix}")
      endif()
      break()
    endif()
  endforeach()
  if(NOT STRATA_HAVE_PYTHON)
    if(STRATA_PYTHON STREQUAL "ON")
      message(FATAL_ERROR "STRATA_PYTHON=ON but the Python module cannot be built: ${_why}")
    endif()
    message(STATUS "strata: Python module off: ${_why}")
  endif()
endif()
