// PyEngine: the object behind strata._strata.Engine - one C++ Engine over a Python model, with
// everything the engine needs kept alive beside it (config, device, the model's mirror). The
// communicator is the process's: the first engine joins the ranks (torchrun-style environment:
// RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and later engines reuse it with their own bucket
// sizes, so a script may build several engines one after another.
//
// The Python front end (python/strata/engine.py) drives it: module hooks call BeginUnit/EndUnit
// around each unit's forward, backward() runs the C++ Engine::Backward, step() Engine::Step. The
// GIL is released while the engine works (gathers, backward, the optimizer), so Python code that
// autograd calls back into (a checkpointed function's recomputation) can take it.
//
// Errors: a failed Status is thrown as StatusError and becomes strata.InvalidArgumentError (a
// ValueError) for INVALID_ARGUMENT - a bad config key or value - and strata.StrataError for the
// rest; the message is Strata's, naming the key and the fix.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/extension.h>

#include "python/bindings/module_mirror.h"
#include "runtime/base/config.h"
#include "runtime/base/status.h"
#include "runtime/engine/engine.h"

namespace strata {
class Communicator;
class Device;
}  // namespace strata

namespace strata::python {

class StatusError : public std::runtime_error {
 public:
  explicit StatusError(const Status& s) : std::runtime_error(s.ToString()), code_(s.code()) {}
  StatusCode code() const { return code_; }

 private:
  StatusCode code_;
};

// Throws StatusError when `s` failed.
void ThrowIfError(const Status& s);

// What the Python side knows that a config's "auto" values are resolved from.
struct AutoHints {
  double lr = 0;
  double weight_decay = -1;
  int64_t micro_batch = 0;
};

// Testing only: the next engine start (in this process) fails once it has written `chunks`
// chunks' initial blocks, as a LibTorch error at that point would, so that the Python tests can
// show what such a start gives back. Every other check of the start runs before any chunk is
// written, so no configuration reaches that point on purpose. A count below 1 clears it.
void FailNextStartAfterChunks(int64_t chunks);

class PyEngine {
 public:
  // `units`: the Python modules to manage as units, in forward order (the front end picks them
  // with the same rule as the C++ default). `config_json`: the DeepSpeed-style config as JSON
  // text; `source` names it in messages. `groups`: the optimizer's parameter groups, each its
  // parameters and (lr, beta1, beta2, eps, weight_decay, momentum, dampening); empty: one group
  // from the config.
  using Groups = std::vector<std::pair<std::vector<torch::Tensor>, std::vector<double>>>;
  PyEngine(pybind11::handle model, const std::vector<pybind11::handle>& units,
           const std::string& config_json, const std::string& source, const AutoHints& hints,
           const Groups& groups, bool client_optimizer = false);
  ~PyEngine();

  void BeginUnit(int64_t unit, bool checkpointed);
  void EndUnit(int64_t unit, const std::vector<torch::Tensor>& outputs);
  void Backward(const torch::Tensor& loss);
  StepReport Step();  // the StepReport as JSON text
  // EngineOptions::client_optimizer: (the step's facts as JSON, per group the (master,
  // gradient) shard pairs), then the StepReport as JSON text.
  using ClientPairs = std::vector<std::vector<std::pair<torch::Tensor, torch::Tensor>>>;
  // Whether the step was skipped (an fp16 overflow), and the lent (master, grad) pairs.
  std::pair<bool, ClientPairs> BeginClientStep();
  StepReport FinishClientStep(bool apply);
  std::vector<std::vector<int64_t>> ClientSegments();
  // `client_file`: bytes saved beside this rank's manifest; `with_frozen`: the frozen
  // parameters too (Engine::SaveCheckpoint).
  void SaveCheckpoint(const std::string& dir, const std::string& extra_json,
                      const std::string& client_file, bool with_frozen);
  pybind11::bytes ReadClientFile(const std::string& dir);
  // `values` reduced over the ranks by the engine's communicator ("sum", "max" or "min"): the
  // agreements a save's Python half makes (Note [a save agreed by every rank]).
  std::vector<double> AllReduceScalars(std::vector<double> values, const std::string& op);
  // The extra JSON given to Save. parts: Engine::LoadParts, as "all", "weights" or
  // "weights_and_counters".
  std::string LoadCheckpoint(const std::string& dir, const std::string& parts);
  int64_t StashActivations(const std::vector<torch::Tensor>& tensors);
  std::vector<torch::Tensor> RestoreActivations(int64_t handle);
  std::vector<torch::Tensor> MasterParams();
  // Frees the engine (its tiers, NVMe files and threads) before Python collects the object.
  // Refused (FAILED_PRECONDITION) while a Call is in flight. BeginClose refuses likewise and
  // then refuses every later Call, for a close that has Python work to do before Close;
  // CheckClosable only refuses.
  void Close();
  void BeginClose();
  void CheckClosable() const;

  // A call into the engine that releases the GIL or may run Python (autograd hooks run inside
  // Backward): it holds the engine open, so that a close() from a hook inside it or from
  // another thread is refused instead of freeing the engine under it (Note [closing during a
  // call] in py_engine.cc). Made and ended with the GIL held, which guards the count.
  class Call {
   public:
    explicit Call(PyEngine& owner);
    ~Call() { --owner_.calls_; }
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;
    Engine& engine() const { return *owner_.engine_; }

   private:
    PyEngine& owner_;
  };

  // For calls that hold the GIL throughout (nothing can close the engine under them).
  Engine& engine();
  const Config& config() const { return config_; }
  int rank() const;
  int world_size() const;
  double LearningRateAt(int64_t step) const;

 private:
  Config config_;
  Communicator* comm_ = nullptr;  // the process's (ProcessCommunicator in py_engine.cc)
  // Shared with the engine's tensors (EngineOptions::device_owner): a parameter view kept in an
  // autograd graph may outlive this object.
  std::shared_ptr<Device> device_;
  Mirror mirror_;
  std::unique_ptr<Engine> engine_;
  int calls_ = 0;         // Calls in flight; read and written with the GIL held
  bool closing_ = false;  // BeginClose ran
};

}  // namespace strata::python
