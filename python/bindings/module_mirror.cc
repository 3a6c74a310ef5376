#include "python/bindings/module_mirror.h"

#include <stdexcept>
#include <string>

#include "runtime/engine/unit_rule.h"

namespace strata::python {
namespace py = pybind11;
namespace {

std::shared_ptr<torch::nn::Module> Build(py::handle module, Mirror* m) {
  auto found = m->by_python.find(module.ptr());
  if (found != m->by_python.end()) return found->second;
  // A plain Module holds parameters, buffers and children, which is all the engine reads; it is
  // named for the Python class so that messages name what the user wrote.
  // Containers (and their subclasses) are UnitContainers, which the unit rule looks through
  // (runtime/engine/unit_rule.h), as it does LibTorch's own.
  const std::string type_name = py::str(py::type::of(module).attr("__name__"));
  // Leaked on purpose: a static py::object would be released after the interpreter is gone.
  static const py::object* containers = [] {
    py::module_ nn = py::module_::import("torch.nn");
    return new py::object(py::make_tuple(nn.attr("Sequential"), nn.attr("ModuleList"),
                                         nn.attr("ModuleDict")));
  }();
  const bool container = PyObject_IsInstance(module.ptr(), containers->ptr()) == 1;
  std::shared_ptr<torch::nn::Module> node =
      container ? std::make_shared<UnitContainer>(type_name)
                : std::make_shared<torch::nn::Module>(type_name);
  m->by_python.emplace(module.ptr(), node);
  // Registration order follows the Python dicts, which is the order named_parameters() uses, so
  // unit and parameter order match what a PyTorch user sees.
  for (auto item : module.attr("_parameters").cast<py::dict>()) {
    if (item.second.is_none()) continue;
    const std::string name = py::str(item.first);
    if (!THPVariable_Check(item.second.ptr()))
      throw std::invalid_argument("parameter '" + name + "' of " + node->name() + " is not a tensor");
    torch::Tensor t = THPVariable_Unpack(item.second.ptr());
    node->register_parameter(name, t, t.requires_grad());
  }
  for (auto item : module.attr("_buffers").cast<py::dict>()) {
    if (item.second.is_none()) continue;
    const std::string name = py::str(item.first);
    if (!THPVariable_Check(item.second.ptr()))
      throw std::invalid_argument("buffer '" + name + "' of " + node->name() + " is not a tensor");
    node->register_buffer(name, THPVariable_Unpack(item.second.ptr()));
  }
  for (auto item : module.attr("_modules").cast<py::dict>()) {
    if (item.second.is_none()) continue;
    node->register_module(py::str(item.first), Build(item.second, m));
  }
  return node;
}

}  // namespace

Mirror MirrorModule(py::handle module) {
  Mirror m;
  m.root = Build(module, &m);
  return m;
}

std::vector<std::string> DefaultUnitNames(py::handle module) {
  Mirror m = MirrorModule(module);
  std::vector<std::string> names;
  for (const auto& unit : DefaultUnitModules(*m.root)) names.push_back(unit.first);
  return names;
}

}  // namespace strata::python
