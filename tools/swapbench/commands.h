// strata-swapbench subcommands. Each lives in its own file and registers itself on the app;
// the callback it installs runs the measurement and sets *exit_code.
#pragma once

#include <CLI/CLI.hpp>

namespace strata::swapbench {

void RegisterNvmeCommand(CLI::App& app, int* exit_code);
void RegisterAdamCommand(CLI::App& app, int* exit_code);
void RegisterElementwiseCommands(CLI::App& app, int* exit_code);  // sgd, adagrad, lion
void RegisterTiersCommand(CLI::App& app, int* exit_code);
void RegisterProfileCommand(CLI::App& app, int* exit_code);
void RegisterFormatsCommand(CLI::App& app, int* exit_code);  // Adam by optimizer-state layout

}  // namespace strata::swapbench
