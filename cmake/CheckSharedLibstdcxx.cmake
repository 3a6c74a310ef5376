# Run after linking the Python module (cmake -DMODULE=<file> -P this): the module must need the
# shared libstdc++.so.6 that torch's process already holds, not carry a static copy of it
# (Note [one libstdc++] in python/CMakeLists.txt). A DT_NEEDED entry leaves its name in the
# dynamic string table, which file(STRINGS) finds.
if(NOT MODULE OR NOT EXISTS "${MODULE}")
  message(FATAL_ERROR "CheckSharedLibstdcxx: MODULE=${MODULE} does not exist")
endif()
file(STRINGS "${MODULE}" _needed REGEX "^libstdc\\+\\+\\.so\\.6$" LIMIT_COUNT 1)
if(NOT _needed)
  file(REMOVE "${MODULE}")
  message(FATAL_ERROR
    "${MODULE} was linked with a static libstdc++ (it does not need libstdc++.so.6): inside a "
    "Python process holding torch it would run with two C++ runtimes and crash or lose output. "
    "The linker found a libstdc++.a before the shared library; configure with a compiler whose "
    "libstdc++ is shared (e.g. -DCMAKE_CXX_COMPILER=/usr/bin/g++ -DCMAKE_CUDA_HOST_COMPILER=/usr/bin/g++) "
    "or remove that folder from the link path. The module was deleted.")
endif()
