// strata._strata's checkpoint files, by runtime/state/checkpoint.h's one implementation:
// read_checked (a saved state's bytes, checked against the crc32c its manifest recorded, for
// strata.zero_to_fp32), write_file_atomic and publish_file (crash-safe writes, for the engine's
// `latest` file and the torch.save outputs of save_16bit_model and zero_to_fp32).
#pragma once

#include <torch/extension.h>

namespace strata::python {

void DefCheckpoint(pybind11::module_& m);

}  // namespace strata::python
