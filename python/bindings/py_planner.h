// strata._strata.estimate_memory: the planner's memory model (tools/planner/memory_model.h) for
// a model given by its parameters, for DeepSpeed's estimate_zero*_model_states_mem_needs*
// (python/strata/estimators.py).
#pragma once

#include <torch/extension.h>

namespace strata::python {

void DefPlanner(pybind11::module_& m);

}  // namespace strata::python
