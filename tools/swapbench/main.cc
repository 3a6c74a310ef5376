// strata-swapbench: what can this machine's NVMe, DRAM, PCIe and CPU do for offloaded training.
#include <cstdio>

#include <CLI/CLI.hpp>

#include "tools/swapbench/commands.h"
#include "tools/swapbench/scratch_files.h"

int main(int argc, char** argv) {
  CLI::App app{
      "strata-swapbench: measures the bandwidths Strata's tiers depend on (NVMe through "
      "io_uring, CPU Adam) and compares each figure with its reference on the same machine.\n"
      "Run a subcommand with --help for its options."};
  app.require_subcommand(1);
  strata::swapbench::InstallScratchCleanup();
  int exit_code = 0;
  strata::swapbench::RegisterNvmeCommand(app, &exit_code);
  strata::swapbench::RegisterAdamCommand(app, &exit_code);
  strata::swapbench::RegisterElementwiseCommands(app, &exit_code);
  strata::swapbench::RegisterTiersCommand(app, &exit_code);
  strata::swapbench::RegisterProfileCommand(app, &exit_code);
  strata::swapbench::RegisterFormatsCommand(app, &exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "strata-swapbench: %s\nRun with --help for the options.\n", e.what());
    return 2;
  }
  return exit_code;
}
