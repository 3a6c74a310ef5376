// Placeholder until the adam subcommand lands.
#include "tools/swapbench/commands.h"

namespace strata::swapbench {
void RegisterAdamCommand(CLI::App&, int*) {}
}  // namespace strata::swapbench
