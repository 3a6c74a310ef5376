// MirrorModule: a torch::nn::Module tree that stands for a Python torch.nn.Module tree, so that the
// C++ engine can manage a model written in Python.
//
// Every Python module becomes a C++ module with the same child names, and each of its parameters
// and buffers is registered in the mirror as the *same* tensor (the Python Parameter and the C++
// tensor share one TensorImpl). So whatever the engine does to a parameter - pointing it at a
// chunk's storage, emptying that storage between uses, moving its gradient - the Python model
// sees, and the Python forward computes with the engine's memory. A module reached twice (a
// submodule shared by two parents) has one mirror; a parameter shared by two modules (tied
// weights) is one tensor registered twice, which the engine stores once.
//
// The mirror is a snapshot of the tree's structure: assigning a new Parameter or submodule on the
// Python side after the engine took the model is not seen (the Python front end says so).
#pragma once

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/extension.h>

namespace strata::python {

struct Mirror {
  std::shared_ptr<torch::nn::Module> root;
  // Python module object -> its mirror.
  std::unordered_map<PyObject*, std::shared_ptr<torch::nn::Module>> by_python;
};

// Builds the mirror of `module` (a torch.nn.Module). Throws std::invalid_argument for a member
// that is not a tensor where a Parameter or buffer is expected.
Mirror MirrorModule(pybind11::handle module);

// strata._strata.default_units: the dotted paths of `module`'s default units, by the engine's
// own rule (runtime/engine/unit_rule.h) applied to its mirror.
std::vector<std::string> DefaultUnitNames(pybind11::handle module);

}  // namespace strata::python
