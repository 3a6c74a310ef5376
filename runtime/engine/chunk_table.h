// ChunkTable: every chunk's working copy and where it stands on the device, as the compute thread
// sees it. The flags that decide what may happen to a chunk next change only through the table's
// transitions, each of which checks what it assumes (STRATA_DCHECK: only a bug breaks them).
//
// A stage-3 chunk's life (stages 0-2 do not use it: their working copy, `full`, is made at Init
// and kept):
//
//   dropped --Installed--> installed --(the caller copies its shard in and all-gathers)--> used
//                             |
//                             +--FillStarted--> filling --FillSettled--> installed
//                                  (the gather lane copies the shard ahead; with several ranks
//                                   the reduce lane all-gathers it ahead too)
//
//   installed, filling --Dropped--> dropped   (no holders; nothing of the gather lane in flight)
//
// Holders (Hold/Release) are the users of a gathered chunk: a running unit, a unit held for its
// backward, the root's own parameters. A held chunk is not dropped.
//
// Invariants, checked by each transition and by CheckInvariants:
//   - live_elems() is the sum of the elements of the installed chunks;
//   - a filling chunk is installed; only a filling chunk has an all-gather ahead;
//   - a dropped chunk has no holders and no device memory.
//
// What the table does not hold, and who does: whether a chunk's copy ahead is enqueued or landed
// (GatherLane), whether its update is queued, running or publishing (OptimizerLane::Pending), its
// last reduction's norm part (ReduceLane::grad_stats). Those change on other threads, under their
// lane's lock.
//
// Thread rules: the compute thread's only (the engine's owner thread), except `buffer`, which the
// gather lane reads for a chunk it was handed (installed before FillStarted, kept until Dropped).
#pragma once

#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "runtime/base/check.h"

namespace strata {

class ChunkTable {
 public:
  // A chunk's memory and its gradient for this micro-step: data the engine reads and writes
  // directly; the table's transitions never touch it, apart from `buffer` (Installed, Dropped).
  struct Chunk {
    std::vector<int64_t> units;  // units whose parameters live in it
    // Stages 0-2: the working copy, owned. Stage 3: a view of `storage`, whose memory the engine
    // installs when gathering and removes when dropping.
    torch::Tensor full;
    c10::Storage storage;
    void* buffer = nullptr;   // the device memory installed (stage 3)
    torch::Tensor grad_full;  // fp32 gradient of the whole chunk for this micro-step
    int pending = 0;          // parameters whose gradient has not arrived this micro-step
  };

  ChunkTable() = default;
  // One chunk per entry of `numel` (its elements), none installed.
  explicit ChunkTable(std::vector<int64_t> numel)
      : chunks_(numel.size()), state_(numel.size()), numel_(std::move(numel)) {}

  size_t size() const { return chunks_.size(); }
  Chunk& operator[](int64_t c) { return chunks_[c]; }
  const Chunk& operator[](int64_t c) const { return chunks_[c]; }

  bool installed(int64_t c) const { return state_[c].installed; }
  bool filling(int64_t c) const { return state_[c].filling; }
  bool all_gather_ahead(int64_t c) const { return state_[c].all_gather_ahead; }
  int holders(int64_t c) const { return state_[c].holders; }
  // Below stage3_param_persistence_threshold: stays gathered across steps (Note [stage-3 live
  // set]). Fixed at Init.
  bool persistent(int64_t c) const { return state_[c].persistent; }
  void SetPersistent(int64_t c, bool on) { state_[c].persistent = on; }
  // Elements of the installed chunks: what stage3_max_live_parameters caps.
  int64_t live_elems() const { return live_elems_; }

  // Device memory `buffer` now backs chunk c.
  void Installed(int64_t c, void* buffer) {
    STRATA_DCHECK(!state_[c].installed, "chunk ", c, " installed twice");
    chunks_[c].buffer = buffer;
    state_[c].installed = true;
    live_elems_ += numel_[c];
  }
  // Chunk c's memory has gone back to the device (the caller freed it).
  void Dropped(int64_t c) {
    STRATA_DCHECK(state_[c].installed, "chunk ", c, " dropped but not installed");
    STRATA_DCHECK(!state_[c].filling, "chunk ", c, " dropped with its copy ahead unsettled");
    STRATA_DCHECK(state_[c].holders == 0, "chunk ", c, " dropped with ", state_[c].holders,
                  " holder(s)");
    STRATA_DCHECK(chunks_[c].buffer == nullptr, "chunk ", c, " dropped with its memory");
    state_[c].installed = false;
    live_elems_ -= numel_[c];
  }
  // The gather lane was handed chunk c's copy (and, with `all_gather`, the reduce lane its
  // all-gather).
  void FillStarted(int64_t c, bool all_gather) {
    STRATA_DCHECK(state_[c].installed && !state_[c].filling, "chunk ", c,
                  " gathered ahead while not installed or already filling");
    state_[c].filling = true;
    state_[c].all_gather_ahead = all_gather;
  }
  // Compute has ordered itself after chunk c's copy ahead (or waited for it); returns whether an
  // all-gather ahead was queued with it, which the caller still has to wait for.
  bool FillSettled(int64_t c) {
    STRATA_DCHECK(state_[c].filling, "chunk ", c, " settled but not filling");
    state_[c].filling = false;
    const bool all_gather = state_[c].all_gather_ahead;
    state_[c].all_gather_ahead = false;
    return all_gather;
  }
  void Hold(int64_t c) { ++state_[c].holders; }
  // Returns whether chunk c has no holder left.
  bool Release(int64_t c) {
    STRATA_DCHECK(state_[c].holders > 0, "chunk ", c, " released more often than gathered");
    return --state_[c].holders == 0;
  }

  // Every invariant above over the whole table (the engine checks them at the end of each Step).
  // Aborts on the first that fails.
  void CheckInvariants() const {
    int64_t elems = 0;
    for (size_t c = 0; c < state_.size(); ++c) {
      const State& s = state_[c];
      if (s.installed) elems += numel_[c];
      STRATA_DCHECK(!s.filling || s.installed, "chunk ", c, " filling but not installed");
      STRATA_DCHECK(!s.all_gather_ahead || s.filling, "chunk ", c,
                    " has an all-gather ahead but no copy ahead");
      STRATA_DCHECK(s.installed || (s.holders == 0 && chunks_[c].buffer == nullptr), "chunk ", c,
                    " dropped with holders or memory");
    }
    STRATA_DCHECK(elems == live_elems_, "live elements ", live_elems_, " but installed chunks hold ",
                  elems);
  }

 private:
  struct State {
    bool installed = false;
    bool filling = false;
    bool all_gather_ahead = false;
    bool persistent = false;
    int holders = 0;
  };
  std::vector<Chunk> chunks_;
  std::vector<State> state_;
  std::vector<int64_t> numel_;
  int64_t live_elems_ = 0;
};

}  // namespace strata
