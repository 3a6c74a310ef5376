#include "python/bindings/py_checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <string>

#include "python/bindings/py_engine.h"
#include "runtime/state/checkpoint.h"

namespace py = pybind11;

namespace strata::python {

void DefCheckpoint(py::module_& m) {
  m.def(
      "read_checked",
      [](const std::string& path, uint64_t offset, uint64_t bytes, uint32_t crc32c,
         const std::string& what) {
        std::string out(bytes, '\0');
        Status s;
        {
          py::gil_scoped_release nogil;
          const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
          if (fd < 0) {
            s = ErrnoToStatus(errno, StrCat("open ", path));
          } else {
            s = checkpoint::ReadChecked(fd, path, offset, bytes, crc32c, what, out.data());
            ::close(fd);
          }
        }
        ThrowIfError(s);
        return py::bytes(out);
      },
      py::arg("path"), py::arg("offset"), py::arg("bytes"), py::arg("crc32c"), py::arg("what"),
      "`bytes` bytes at `offset` of a checkpoint's state file, checked against their crc32c "
      "(DATA_LOSS naming the file when short or damaged)");
}

}  // namespace strata::python
