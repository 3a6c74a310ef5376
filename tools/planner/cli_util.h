// Small helpers shared by the planner CLIs (strata-estimate, strata-tune, swapbench profile).
#pragma once

#include <cstdint>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json_fwd.hpp>

#include "runtime/base/config.h"
#include "runtime/base/status.h"
#include "tools/planner/model_spec.h"

namespace strata::planner {

// Parses argv with CLI11. Returns -1 to go on, else the exit code: 0 after --help, 2 after a bad
// flag (the message and a pointer to --help are printed on stderr).
int ParseArgs(CLI::App& app, int argc, char** argv);

// A count written as an integer or in scientific notation ("1.5e9"), in [lo, hi].
StatusOr<int64_t> ParseCount(const std::string& flag, const std::string& text, int64_t lo, int64_t hi);

// --gflops: a compute rate in (0, 1e7] GFLOP/s (1e7 is ten PFLOP/s, beyond any one device: a
// larger figure is a typo, or inf).
StatusOr<double> ParseGflops(const std::string& text);

// Resolves the config's "auto" values as a run on `device` ("cuda..." or anything else for the
// cpu device) with `world_size` ranks would (Config::ResolveAuto; bf16 where it is native).
Status ResolveAutoForPlanning(Config* config, const std::string& device, int world_size);

// Reads a JSON object from a file (the raw document, for editing while keeping every key).
// Comments and trailing commas are accepted, as Config::FromFile accepts them (RelaxedJson);
// *had_comments (when given) says whether there were any, since a document written back from the
// result has none.
StatusOr<nlohmann::json> ReadJsonFile(const std::string& path, bool* had_comments = nullptr);
// Writes `j` to `path` atomically: a temporary file in the same directory, fsync, rename.
Status WriteJsonFileAtomic(const std::string& path, const nlohmann::json& j);

// The model a planner CLI works on: the config's "model" section when the file has one, else
// --params/--largest-layer. `raw` is the config document (null when no --config was given).
StatusOr<ModelSpec> ModelFromArgs(const nlohmann::json* raw, const Config& config,
                                  const std::string& params, const std::string& largest_layer);

}  // namespace strata::planner
