#include "python/bindings/py_planner.h"

#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>
#include <pybind11/stl.h>

#include "python/bindings/py_engine.h"
#include "tools/planner/memory_model.h"
#include "tools/planner/model_spec.h"

namespace py = pybind11;

namespace strata::python {

void DefPlanner(py::module_& m) {
  m.def(
      "estimate_memory",
      [](const std::string& config_json, const std::vector<std::tuple<std::string, int64_t, int64_t>>& params,
         int world_size, const std::string& device) {
        StatusOr<Config> config = Config::FromJsonText(config_json, "estimate_memory");
        ThrowIfError(config.status());
        planner::ModelSpec spec;
        for (const auto& [name, numel, block] : params) {
          spec.params.push_back({name, numel, block, {}});
          spec.num_blocks = std::max(spec.num_blocks, block + 1);
        }
        planner::EstimateOptions options;
        options.world_size = world_size;
        options.device = device;
        StatusOr<planner::MemoryEstimate> est = planner::EstimateMemory(*config, spec, options);
        ThrowIfError(est.status());
        return est->ToJson().dump();
      },
      py::arg("config_json"), py::arg("params"), py::arg("world_size") = 1,
      py::arg("device") = "cuda",
      "Per-rank bytes on each tier for a model given as (name, numel, unit) in registration "
      "order, under a config (JSON): the memory model behind strata-estimate, as JSON");
}

}  // namespace strata::python
