// The engine's state-kind methods for Python: offload_states / reload_states and the
// per-parameter accessors behind DeepSpeed's safe_get_full_* / safe_set_full_* and a ZeRO-3
// parameter's ds_status and ds_tensor (python/strata/param_state.py). States are named as
// StateKindName names them: "param16", "grad", "master32", "exp_avg", "exp_avg_sq".
#pragma once

#include <torch/extension.h>

#include "python/bindings/py_engine.h"

namespace strata::python {

void DefStateMethods(pybind11::class_<PyEngine>& engine);

}  // namespace strata::python
