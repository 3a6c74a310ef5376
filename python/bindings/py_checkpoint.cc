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
        std::string out;
        Status s;
        {
          py::gil_scoped_release nogil;
          uint64_t size = 0;
          auto fd = checkpoint::OpenCheckpointFile(path, &size);
          if (!fd.ok()) {
            s = fd.status();
          } else {
            // Checked before the buffer is made: a damaged manifest may name any size.
            if (offset > size || bytes > size - offset)
              s = DataLoss(StrCat(path, " is truncated: ", what, " needs ", bytes,
                                  " bytes at offset ", offset, ", the file holds ", size));
            if (s.ok()) {
              out.resize(bytes);
              s = checkpoint::ReadChecked(*fd, path, offset, bytes, crc32c, what, out.data());
            }
            ::close(*fd);
          }
        }
        ThrowIfError(s);
        return py::bytes(out);
      },
      py::arg("path"), py::arg("offset"), py::arg("bytes"), py::arg("crc32c"), py::arg("what"),
      "`bytes` bytes at `offset` of a checkpoint's state file, checked against their crc32c "
      "(DATA_LOSS naming the file when short or damaged)");
  m.def(
      "read_checkpoint_file",
      [](const std::string& path) {
        StatusOr<std::string> text = [&] {
          py::gil_scoped_release nogil;
          return checkpoint::ReadFile(path);
        }();
        ThrowIfError(text.status());
        return py::bytes(*text);
      },
      py::arg("path"),
      "A checkpoint's whole file (a manifest, `latest`): DATA_LOSS naming it when it is not a "
      "regular file (a FIFO there would block the read)");
  m.def(
      "check_manifest",
      [](const std::string& text, const std::string& source) {
        ThrowIfError(checkpoint::ParseManifest(text, source).status());
      },
      py::arg("text"), py::arg("source"),
      "Checks a rank's manifest as the engine's load does (format, version, every field's type "
      "and range); raises naming `source` otherwise");
  m.def(
      "resolve_checkpoint_dir",
      [](const std::string& path) {
        StatusOr<std::string> dir = checkpoint::ResolveCheckpointDir(path);
        ThrowIfError(dir.status());
        return *dir;
      },
      py::arg("path"),
      "The checkpoint `path` is, or the one its `latest` names, as the engine's load resolves "
      "it (a damaged `latest`, a missing step and a step a save moved aside are handled alike)");
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
