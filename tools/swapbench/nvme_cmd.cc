// Placeholder until the nvme subcommand lands.
#include "tools/swapbench/commands.h"

namespace strata::swapbench {
void RegisterNvmeCommand(CLI::App&, int*) {}
}  // namespace strata::swapbench
