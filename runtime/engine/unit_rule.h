// The unit rule: which submodules of a model the engine manages as units when the caller names
// none (EngineOptions::units empty). A unit is the granularity of materialization: under ZeRO
// stage 3 its parameters exist in device memory only while its forward (and again its backward)
// runs.
//
// The rule: each child of the root that holds a trainable parameter is a unit, except containers,
// which are looked through to their children (recursively). A module reached twice (a submodule
// shared by two parents) is one unit, named by its first path. Parameters held directly by the
// root are not a unit here; the engine keeps them as one more unit ("") gathered for its life.
//
// This is the one implementation: the Python front end asks for it through the bindings
// (strata._strata.default_units) instead of keeping a copy.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace strata {

// A module the rule looks through, as it does LibTorch's Sequential, ModuleList and ModuleDict.
// The Python bindings build their mirror of torch.nn.Sequential / ModuleList / ModuleDict (and
// subclasses) as this type.
class UnitContainer : public torch::nn::Module {
 public:
  using torch::nn::Module::Module;
};

// The default units of `root` in registration order, as (dotted path, module) pairs.
std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> DefaultUnitModules(
    const torch::nn::Module& root);

}  // namespace strata
