// EngineTestHooks: fault and delay injection for the engine's tests, kept out of the public
// engine.h (whose users need none of it). An engine made without them (EngineOptions::test_hooks
// null, as every production caller does) runs no hook and pays nothing for them.
//
// Thread rules: each hook is called on the thread named beside it and must be thread-safe where
// several threads may call it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>

#include "runtime/state/block_store.h"
#include "tiers/nvme/io_engine.h"

namespace strata {

struct EngineTestHooks {
  // Use the pread/pwrite NVMe engine even where io_uring works.
  bool force_fallback_io = false;
  // Rewrites NVMe attempts' results (NvmeTierOptions::fault_hook; I/O threads).
  nvme::IoFaultHook nvme_fault_hook;
  // Runs on the optimizer lane before each chunk's update, so a test can stretch the lane and show
  // that nothing reads a chunk before its update is in.
  std::function<void(int64_t chunk)> optimizer_delay_hook;
  // Runs on the reduce lane before each chunk's reduction and, with several ranks, before each
  // all-gather issued ahead (once the chunk's copy has landed), so a test can make the lane lag
  // compute and show that every reader of its results waits for them.
  std::function<void(int64_t chunk)> reduce_delay_hook;
  // The "fp16" block's loss scaling without fp16 compute, so the overflow path (a skipped step,
  // the scale's schedule, deferred updates around a skipped step) runs on the CPU device, where
  // fp16 is refused. Power-of-two scales multiply fp32 gradients exactly, so a run equals one
  // without scaling on every step that is not skipped.
  bool loss_scaling = false;
  // Wraps the engine's block store once it is made (a store that poisons released blocks,
  // tests/runtime/poisoning_store.h), so a test can show that nothing uses a block outside its
  // Acquire..Release window.
  std::function<std::unique_ptr<BlockStore>(std::unique_ptr<BlockStore>)> wrap_store;
  // Runs on the caller's thread once Engine::Create has written a chunk's initial blocks and
  // pointed its parameters at the engine's memory, so a test can measure the start's disk use
  // chunk by chunk (Note [start's disk] in engine_init.cc).
  std::function<void(int64_t chunk)> initial_chunk_hook;
  // Called at the engine's named points of a save (the caller's thread):
  // "checkpoint:before_write" (the folder made, no rank's file written yet) and
  // "checkpoint:before_publish" (every file of a checkpoint written and synced, nothing
  // published). A test exits the process there to show what a crash at that moment leaves, or
  // damages the file system to show what a failure does.
  std::function<void(std::string_view point)> crash_point;
};

}  // namespace strata
