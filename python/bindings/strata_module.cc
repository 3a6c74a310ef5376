// strata._strata: the C++ side of `import strata`. Only what the Python front end
// (python/strata/) needs; users call the DeepSpeed-style API there.
#include <torch/extension.h>

#include <pybind11/stl.h>

#include "python/bindings/native_backtrace.h"
#include "python/bindings/py_engine.h"
#include "python/bindings/py_checkpoint.h"
#include "python/bindings/py_param_state.h"
#include "python/bindings/py_planner.h"
#include "python/bindings/py_step_report.h"
#include "runtime/base/env_vars.h"
#include "runtime/base/host_info.h"
#include "runtime/comm/backends.h"
#include "runtime/engine/zero_init.h"
#include "runtime/state/lr_schedule.h"

namespace py = pybind11;
using strata::python::AutoHints;
using strata::python::PyEngine;
using strata::python::StatusError;

namespace {

void DefErrors(py::module_& m) {
  // StrataError for every failure; InvalidArgumentError is also a ValueError, so a script that
  // catches ValueError for a bad config (as with DeepSpeed) keeps working.
  static py::handle strata_error =
      PyErr_NewExceptionWithDoc("strata.StrataError", "A Strata failure, with Strata's message",
                                PyExc_RuntimeError, nullptr);
  py::handle bases = PyTuple_Pack(2, strata_error.ptr(), PyExc_ValueError);
  static py::handle invalid_argument = PyErr_NewExceptionWithDoc(
      "strata.InvalidArgumentError", "A bad config key or value, flag or argument; the message names it",
      bases.ptr(), nullptr);
  bases.dec_ref();
  m.attr("StrataError") = strata_error;
  m.attr("InvalidArgumentError") = invalid_argument;
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      const bool bad_input = e.code() == strata::StatusCode::kInvalidArgument;
      PyErr_SetString((bad_input ? invalid_argument : strata_error).ptr(), e.what());
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(invalid_argument.ptr(), e.what());
    } catch (const c10::Error&) {
      throw;  // torch's own errors keep torch's translation
    } catch (const py::builtin_exception&) {
      throw;  // py::key_error and its kin keep their Python type
    } catch (const std::runtime_error& e) {
      PyErr_SetString(strata_error.ptr(), e.what());
    }
  });
}

void DefEngine(py::module_& m) {
  py::class_<AutoHints>(m, "AutoHints")
      .def(py::init<>())
      .def_readwrite("lr", &AutoHints::lr)
      .def_readwrite("weight_decay", &AutoHints::weight_decay)
      .def_readwrite("micro_batch", &AutoHints::micro_batch);

  py::class_<PyEngine> engine(m, "Engine");
  strata::python::DefStateMethods(engine);
  engine
      .def(py::init<py::handle, const std::vector<py::handle>&, const std::string&,
                    const std::string&, const AutoHints&, const PyEngine::Groups&, bool>(),
           py::arg("model"), py::arg("units"), py::arg("config_json"), py::arg("source"),
           py::arg("hints"), py::arg("groups") = PyEngine::Groups{},
           py::arg("client_optimizer") = false)
      .def("begin_unit", &PyEngine::BeginUnit, py::arg("unit"), py::arg("checkpointed") = false)
      .def("end_unit", &PyEngine::EndUnit)
      .def("backward", &PyEngine::Backward)
      .def("step", &PyEngine::Step)
      .def("save_checkpoint", &PyEngine::SaveCheckpoint, py::arg("dir"), py::arg("extra_json"),
           py::arg("client_file") = std::string(), py::arg("with_frozen") = true)
      .def("read_client_file", &PyEngine::ReadClientFile)
      .def("all_reduce_scalars", &PyEngine::AllReduceScalars, py::arg("values"), py::arg("op"))
      .def("begin_client_step", &PyEngine::BeginClientStep)
      .def("finish_client_step", &PyEngine::FinishClientStep, py::arg("apply") = true)
      .def("client_segments", &PyEngine::ClientSegments)
      .def("load_checkpoint", &PyEngine::LoadCheckpoint, py::arg("dir"),
           py::arg("parts") = std::string("all"))
      .def("stash_activations", &PyEngine::StashActivations)
      .def("restore_activations", &PyEngine::RestoreActivations)
      .def("master_params", &PyEngine::MasterParams)
      .def("close", &PyEngine::Close)
      .def("begin_close", &PyEngine::BeginClose)
      .def("check_closable", &PyEngine::CheckClosable)
      .def("lr_at", &PyEngine::LearningRateAt)
      .def(
          "group_lr_at",
          [](PyEngine& e, int64_t step, double group_lr) {
            return strata::GroupLearningRate(e.config(), step, group_lr);
          },
          py::arg("step"), py::arg("group_lr"))
      .def(
          "betas_at",
          [](PyEngine& e, int64_t step) { return strata::ScheduledBetas(e.config(), step); },
          py::arg("step"))
      .def(
          "check_scheduled_betas",
          [](PyEngine& e, int64_t step) {
            strata::python::ThrowIfError(strata::CheckScheduledBetas(e.config(), step));
          },
          py::arg("step"))
      .def(
          "set_groups",
          [](PyEngine& e, const std::vector<std::vector<double>>& groups) {
            std::vector<strata::GroupHyperparameters> g;
            for (const auto& h : groups) {
              if (h.size() != 7)
                strata::python::ThrowIfError(strata::InvalidArgument(
                    "set_groups: each group is (lr, beta1, beta2, eps, weight_decay, momentum, "
                    "dampening)"));
              g.push_back({h[0], h[1], h[2], h[3], h[4], h[5], h[6]});
            }
            strata::python::ThrowIfError(e.engine().SetGroupHyperparameters(g));
          },
          py::arg("groups"))
      .def_property_readonly("num_param_groups",
                             [](PyEngine& e) { return e.engine().num_param_groups(); })
      .def(
          "write_params",
          [](PyEngine& e, const std::vector<torch::Tensor>& params) {
            strata::Status s;
            const PyEngine::Call call(e);
            {
              py::gil_scoped_release nogil;
              s = call.engine().WriteParameters(params);
            }
            strata::python::ThrowIfError(s);
          },
          py::arg("params"))
      .def_property_readonly("rank", &PyEngine::rank)
      .def_property_readonly("world_size", &PyEngine::world_size)
      .def_property_readonly("num_units", [](PyEngine& e) { return e.engine().num_units(); })
      .def("unit_name", [](PyEngine& e, int64_t u) { return e.engine().unit_name(u); })
      .def_property_readonly("global_step", [](PyEngine& e) { return e.engine().global_step(); })
      .def_property_readonly("micro_step", [](PyEngine& e) { return e.engine().micro_step(); })
      .def_property_readonly("loss_scale", [](PyEngine& e) { return e.engine().loss_scale(); })
      .def_property_readonly("num_parameters",
                             [](PyEngine& e) { return e.engine().num_parameters(); })
      .def_property_readonly("cpu_checkpointing",
                             [](PyEngine& e) { return e.engine().cpu_checkpointing(); })
      .def_property_readonly("device_bytes_in_use",
                             [](PyEngine& e) { return e.engine().device_bytes_in_use(); })
      .def_property_readonly("device_peak_bytes",
                             [](PyEngine& e) { return e.engine().device_peak_bytes(); })
      .def_property_readonly("config_json", [](PyEngine& e) { return e.config().ToJsonString(); })
      .def("describe", [](PyEngine& e) { return e.engine().Describe().dump(); });
}

void DefZeroInit(py::module_& m) {
  // zero::Init for strata.zero.Init: current on the creating thread until close().
  py::class_<strata::zero::Init>(m, "ZeroInit")
      .def(py::init([](const std::string& dir, bool shapes_only) {
             auto init = strata::zero::Init::Create(
                 dir, torch::kFloat32,
                 shapes_only ? strata::zero::StageMode::kShapesOnly : strata::zero::StageMode::kValues);
             strata::python::ThrowIfError(init.status());
             return std::move(*init);
           }),
           py::arg("dir"), py::arg("shapes_only") = false)
      .def("stage", [](strata::zero::Init&, const torch::Tensor& t) { strata::zero::StageMapped(t); })
      .def_property_readonly("staged_bytes", &strata::zero::Init::staged_bytes)
      .def_property_readonly("staged_params", &strata::zero::Init::staged_params);
}

}  // namespace

PYBIND11_MODULE(_strata, m) {
  m.doc() = "Strata's C++ engine, tiers and CPU Adam; use the functions of the strata package";
  // Whether this build has c10d's Gloo (CPU collectives across ranks): it needs Gloo's headers at
  // build time (libgloo-dev, or a LibTorch that carries them).
  m.attr("have_gloo") = strata::GlooAvailable();
  m.attr("native_backtrace") = strata::python::MaybeInstallNativeBacktrace();

  DefErrors(m);
  DefEngine(m);
  DefZeroInit(m);
  strata::python::DefPlanner(m);
  strata::python::DefCheckpoint(m);
  strata::python::DefStepReport(m);
  m.def("default_units", &strata::python::DefaultUnitNames, py::arg("model"),
        "The dotted paths of the model's default units, by the engine's own rule.");
  m.def("env_vars", [] {
    std::vector<std::tuple<std::string, std::string, std::string>> out;
    for (const strata::EnvVar& v : strata::kEnvVars) out.emplace_back(v.name, v.reader, v.meaning);
    return out;
  }, "Every environment variable Strata reads: (name, reader, meaning), runtime/base/env_vars.h");
  m.def(
      "_fail_next_start_after_chunks", &strata::python::FailNextStartAfterChunks, py::arg("chunks"),
      "Testing only: the next engine start fails once it has written `chunks` chunks (< 1: never)");
  m.def("host_description", [](const std::string& dir) { return strata::HostDescription(dir); },
        py::arg("dir") = "", "The machine: CPU model, ISA, cores (and the disk holding `dir`)");
}
