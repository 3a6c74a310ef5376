// strata._strata.read_checked: a saved state's bytes, checked against the crc32c its manifest
// recorded (runtime/state/checkpoint.h, ReadChecked), for strata.zero_to_fp32.
#pragma once

#include <torch/extension.h>

namespace strata::python {

void DefCheckpoint(pybind11::module_& m);

}  // namespace strata::python
