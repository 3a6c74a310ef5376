#include "python/bindings/py_step_report.h"

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/engine/engine.h"

namespace py = pybind11;

namespace strata::python {
namespace {

// The report's figure names (ToJson's keys, sorted); each is also an attribute of the bound class.
const std::vector<std::string>& FieldNames() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    const nlohmann::json fields = StepReport{}.ToJson();
    for (const auto& item : fields.items()) out.push_back(item.key());
    return out;
  }();
  return names;
}

bool IsField(const std::string& key) {
  for (const auto& n : FieldNames())
    if (n == key) return true;
  return false;
}

}  // namespace

void DefStepReport(py::module_& m) {
  py::class_<StepReport> c(m, "StepReport",
                           "One optimizer step's report: the lr and loss scale it ran with, the "
                           "gradient norm, the step's wall time and each lane's busy time, and the "
                           "bytes it moved between tiers. Read-only; also reads as a mapping.");
  c.def_readonly("step", &StepReport::step)
      .def_readonly("skipped", &StepReport::skipped)
      .def_readonly("lr", &StepReport::lr)
      .def_readonly("loss_scale", &StepReport::loss_scale)
      .def_readonly("grad_norm", &StepReport::grad_norm)
      .def_readonly("step_time_s", &StepReport::step_time_s)
      .def_readonly("compute_s", &StepReport::compute_s)
      .def_readonly("copy_s", &StepReport::copy_s)
      .def_readonly("comm_s", &StepReport::comm_s)
      .def_readonly("nvme_s", &StepReport::nvme_s)
      .def_readonly("optimizer_s", &StepReport::optimizer_s)
      .def_readonly("stall_s", &StepReport::stall_s)
      .def_readonly("update_wait_s", &StepReport::update_wait_s)
      .def_readonly("lane_sum_s", &StepReport::lane_sum_s)
      .def_readonly("longest_lane_s", &StepReport::longest_lane_s)
      // NaN when only one lane was busy: None here, as JSON's null in strata-train --json.
      .def_property_readonly("overlap",
                             [](const StepReport& r) -> py::object {
                               if (std::isnan(r.overlap)) return py::none();
                               return py::float_(r.overlap);
                             })
      .def_readonly("compute_idle_share", &StepReport::compute_idle_share)
      .def_readonly("bytes_host_to_device", &StepReport::bytes_host_to_device)
      .def_readonly("bytes_device_to_host", &StepReport::bytes_device_to_host)
      .def_readonly("bytes_nvme_to_host", &StepReport::bytes_nvme_to_host)
      .def_readonly("bytes_host_to_nvme", &StepReport::bytes_host_to_nvme)
      .def_readonly("peak_device_bytes", &StepReport::peak_device_bytes)
      .def_readonly("peak_host_bytes", &StepReport::peak_host_bytes)
      .def_readonly("bytes_activations_stashed", &StepReport::bytes_activations_stashed);
  c.def_static("keys", []() { return FieldNames(); }, "The report's figure names.")
      .def("__getitem__",
           [](py::object self, const std::string& key) {
             if (!IsField(key)) throw py::key_error(key);
             return self.attr(key.c_str());
           })
      .def("__contains__", [](const StepReport&, const std::string& key) { return IsField(key); })
      .def(
          "get",
          [](py::object self, const std::string& key, py::object fallback) {
            return IsField(key) ? self.attr(key.c_str()) : fallback;
          },
          py::arg("key"), py::arg("default") = py::none())
      .def("to_dict",
           [](py::object self) {
             py::dict d;
             for (const auto& k : FieldNames()) d[k.c_str()] = self.attr(k.c_str());
             return d;
           })
      .def("__repr__", [](const StepReport& r) {
        return "StepReport(step=" + std::to_string(r.step) +
               (r.skipped ? ", skipped" : "") + ", lr=" + std::to_string(r.lr) +
               ", step_time_s=" + std::to_string(r.step_time_s) + ")";
      });
}

}  // namespace strata::python
