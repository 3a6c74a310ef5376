#include "python/bindings/module_mirror.h"

#include <stdexcept>
#include <string>

namespace strata::python {
namespace py = pybind11;
namespace {

std::shared_ptr<torch::nn::Module> Build(py::handle module, Mirror* m) {
  auto found = m->by_python.find(module.ptr());
  if (found != m->by_python.end()) return found->second;
  // A plain Module holds parameters, buffers and children, which is all the engine reads; it is
  // named for the Python class so that messages name what the user wrote.
  auto node = std::make_shared<torch::nn::Module>(
      py::str(py::type::of(module).attr("__name__")).cast<std::string>());
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

}  // namespace strata::python
