// strata._strata.StepReport: one optimizer step's report (runtime/engine/engine.h, StepReport),
// bound as a read-only class, so a step's figures reach Python as numbers, not as JSON text.
//
// It also reads as the mapping it used to be (engine.last_report["lr"], .get, keys, to_dict):
// the keys are StepReport::ToJson's, so the C++ report and the Python one name each figure once.
#pragma once

#include <torch/extension.h>

namespace strata::python {

void DefStepReport(pybind11::module_& m);

}  // namespace strata::python
