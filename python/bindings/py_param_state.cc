#include "python/bindings/py_param_state.h"

#include <string>
#include <vector>

#include <pybind11/stl.h>

namespace py = pybind11;

namespace strata::python {
namespace {

StateKind KindNamed(const std::string& name, const char* what) {
  for (int k = 0; k < kNumStateKinds; ++k)
    if (name == StateKindName(static_cast<StateKind>(k))) return static_cast<StateKind>(k);
  ThrowIfError(InvalidArgument(std::string(what) + ": unknown state '" + name +
                               "'; one of param16, grad, master32, exp_avg, exp_avg_sq"));
  return StateKind::kParam16;  // not reached
}

template <typename T>
T Checked(StatusOr<T> v) {
  ThrowIfError(v.status());
  return std::move(*v);
}

// One of the engine's per-parameter readers, without the GIL.
using StateReader = StatusOr<std::vector<torch::Tensor>> (Engine::*)(
    StateKind, const std::vector<torch::Tensor>&);
std::vector<torch::Tensor> ParamStates(PyEngine& e, StateKind kind,
                                       const std::vector<torch::Tensor>& params, StateReader read) {
  StatusOr<std::vector<torch::Tensor>> got = std::vector<torch::Tensor>{};
  const PyEngine::Call call(e);
  {
    py::gil_scoped_release nogil;
    got = (call.engine().*read)(kind, params);
  }
  return Checked(std::move(got));
}

}  // namespace

void DefStateMethods(py::class_<PyEngine>& engine) {
  engine
      .def("offload_states",
           [](PyEngine& e, const std::vector<std::string>& names) {
             std::vector<StateKind> kinds;
             for (const std::string& n : names) kinds.push_back(KindNamed(n, "offload_states"));
             StatusOr<uint64_t> moved = uint64_t{0};
             const PyEngine::Call call(e);
             {
               py::gil_scoped_release nogil;
               moved = call.engine().OffloadStates(kinds);
             }
             return Checked(std::move(moved));
           },
           py::arg("kinds"))
      .def("reload_states",
           [](PyEngine& e) {
             StatusOr<uint64_t> moved = uint64_t{0};
             const PyEngine::Call call(e);
             {
               py::gil_scoped_release nogil;
               moved = call.engine().ReloadStates();
             }
             return Checked(std::move(moved));
           })
      // 0: available, 1: not available, 2: in flight (Engine::Residency's order).
      .def("param_residency",
           [](PyEngine& e, const std::vector<torch::Tensor>& params) {
             std::vector<int> out;
             for (Engine::Residency r : Checked(e.engine().ParamResidency(params)))
               out.push_back(static_cast<int>(r));
             return out;
           },
           py::arg("params"))
      .def("gather_param_state",
           [](PyEngine& e, const std::string& kind, const std::vector<torch::Tensor>& params) {
             return ParamStates(e, KindNamed(kind, "gather_param_state"), params, &Engine::GatherParamState);
           },
           py::arg("kind"), py::arg("params"))
      .def("local_param_state",
           [](PyEngine& e, const std::string& kind, const std::vector<torch::Tensor>& params) {
             return ParamStates(e, KindNamed(kind, "local_param_state"), params, &Engine::LocalParamState);
           },
           py::arg("kind"), py::arg("params"))
      .def("write_param_state",
           [](PyEngine& e, const std::string& kind, const std::vector<torch::Tensor>& params,
              const std::vector<torch::Tensor>& values) {
             const StateKind k = KindNamed(kind, "write_param_state");
             Status s;
             const PyEngine::Call call(e);
             {
               py::gil_scoped_release nogil;
               s = call.engine().WriteParamState(k, params, values);
             }
             ThrowIfError(s);
           },
           py::arg("kind"), py::arg("params"), py::arg("values"));
}

}  // namespace strata::python
