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
  m.def(
      "write_file_atomic",
      [](const std::string& path, const py::bytes& data) {
        std::string bytes = data;
        py::gil_scoped_release nogil;
        ThrowIfError(checkpoint::WriteFileAtomic(path, bytes));
      },
      py::arg("path"), py::arg("data"),
      "Writes `data` to `path` so that a crash leaves the old file or the new one, never a part: "
      "path.tmp, fsync, rename, fsync of the directory");
  m.def(
      "publish_file",
      [](const std::string& tmp, const std::string& path) {
        py::gil_scoped_release nogil;
        ThrowIfError(checkpoint::PublishFile(tmp, path));
      },
      py::arg("tmp"), py::arg("path"),
      "Makes the finished file `tmp` appear as `path` durably: fsync, rename, fsync of the "
      "directory (tmp is removed on failure)");
}

}  // namespace strata::python
