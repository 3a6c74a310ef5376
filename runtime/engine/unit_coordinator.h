// UnitCoordinator: the units (the modules whose parameters are gathered together) and the order
// they ran in, and every decision that follows from that alone: how far away a unit's next use
// is (Note [stage-3 live set]), which units to gather ahead of forward and backward, and the order
// the next forward needs chunks in.
//
// Owns: the unit table (each unit's parameters, chunks and size, and its state in this
// micro-step: open forward runs, gradients still to come, held for backward), this micro-step's
// trace, the previous one's with the elements gathered after each position, and backward's
// position in the trace. Borrows nothing: the gathers themselves are the engine's, through the
// chunk table and the lanes.
//
// Thread rules: the compute thread's only (forward, autograd's hooks and Backward all run there).
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace strata {

class UnitCoordinator {
 public:
  struct Unit {
    std::string name;
    std::shared_ptr<torch::nn::Module> module;
    std::vector<int64_t> params;  // parameters it holds, tied ones included
    std::vector<int64_t> chunks;  // chunks those parameters live in
    int64_t elems = 0;            // full elements a gather of the unit brings in
    bool always_live = false;     // the root's own parameters: gathered for the engine's life
    // This micro-step:
    int grads_pending = 0;           // parameters whose gradient has not arrived
    bool backward_held = false;      // gathered for its backward
    int forward_depth = 0;           // open BeginUnit calls
    bool open_checkpointed = false;  // the open run is a checkpointed forward
  };
  static constexpr int64_t kNever = std::numeric_limits<int64_t>::max();

  // Building (Init): units are added in the order their modules were found.
  int64_t Add(Unit unit);
  int64_t size() const { return static_cast<int64_t>(units_.size()); }
  Unit& operator[](int64_t u) { return units_[u]; }
  const Unit& operator[](int64_t u) const { return units_[u]; }
  std::string name(int64_t u) const { return u >= 0 && u < size() ? units_[u].name : std::string(); }

  // A training micro-step's forward begins: the trace restarts, every unit waits for all its
  // parameters' gradients and holds nothing for backward.
  void BeginMicroStep();
  // Unit u began a training forward run; returns its position in this micro-step's trace.
  size_t RecordForward(int64_t u);
  const std::vector<int64_t>& trace() const { return trace_; }
  // The previous micro-step's trace: what forward expects to run next.
  const std::vector<int64_t>& last_trace() const { return last_trace_; }
  // Backward begins: it walks this micro-step's trace from the end.
  void BeginBackward() { backward_cursor_ = trace_.size(); }
  // Backward reached unit u: returns u's position in the trace, searching back from where
  // backward last was (the units before it are the ones to gather ahead), or -1 when u is not
  // in the rest of the trace.
  int64_t ReachedInBackward(int64_t u);
  // The micro-step is over: its trace becomes the one the next forward follows.
  void EndMicroStep();

  // In forward: the elements gathered before the unit at trace position `pos` is needed again
  // (by its backward), or kNever when this forward has left the previous one's order.
  int64_t ForwardReuseDistance(size_t pos) const;
  // In backward: the elements gathered before chunk c is needed again in this backward (by a
  // unit whose gradients are not all in yet), or kNever (its next use follows the step).
  int64_t BackwardReuseDistance(int64_t c) const;
  // The units after trace position `pos` (direction +1: forward, in the previous micro-step's
  // order) or before it (-1: backward, in this one's), nearest first, with their distance in
  // units; `visit` returns false to stop.
  void VisitNear(size_t pos, int direction,
                 const std::function<bool(int64_t unit, int64_t distance)>& visit) const;
  // Every chunk once, in the order the next forward needs them: those `stays_gathered` says
  // remain gathered across steps (the root's own chunks first, then the others it names), then
  // `trace`'s units' chunks, then any others.
  std::vector<int64_t> ChunkOrder(const std::vector<int64_t>& trace, int64_t num_chunks,
                                  const std::function<bool(int64_t chunk)>& stays_gathered) const;

 private:
  std::vector<Unit> units_;
  std::vector<int64_t> trace_, last_trace_;
  // Per position of last_trace_: elements the units after it gather in forward and backward.
  std::vector<int64_t> last_trace_after_;
  size_t backward_cursor_ = 0;
};

}  // namespace strata
