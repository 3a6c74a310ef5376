// The unit coordinator (unit_coordinator.h): the unit table, the traces and what follows from
// them. The engine's side of the unit protocol is unit_protocol.cc; its gathers, chunk_gathers.cc.
#include "runtime/engine/unit_coordinator.h"

#include <algorithm>
#include <cstdlib>

namespace strata {

int64_t UnitCoordinator::Add(Unit unit) {
  units_.push_back(std::move(unit));
  return size() - 1;
}

void UnitCoordinator::BeginMicroStep() {
  trace_.clear();
  for (Unit& u : units_) {
    u.grads_pending = static_cast<int>(u.params.size());
    u.backward_held = false;
  }
}

size_t UnitCoordinator::RecordForward(int64_t u) {
  trace_.push_back(u);
  return trace_.size() - 1;
}

int64_t UnitCoordinator::ReachedInBackward(int64_t u) {
  // Backward runs the trace in reverse; a unit that ran twice is found at its later run first.
  size_t pos = std::min(backward_cursor_, trace_.size());
  while (pos > 0 && trace_[pos - 1] != u) --pos;
  if (pos == 0) return -1;
  backward_cursor_ = pos - 1;
  return static_cast<int64_t>(pos - 1);
}

void UnitCoordinator::EndMicroStep() {
  last_trace_ = trace_;
  last_trace_after_.assign(last_trace_.size(), 0);
  for (size_t k = last_trace_.size(); k-- > 1;)
    last_trace_after_[k - 1] = last_trace_after_[k] + 2 * units_[last_trace_[k]].elems;
}

// In forward, a unit at trace position i is next needed by its backward, after every later unit
// of the trace has been gathered twice (its forward and its backward).
int64_t UnitCoordinator::ForwardReuseDistance(size_t pos) const {
  if (pos >= last_trace_.size() || pos >= trace_.size() || last_trace_[pos] != trace_[pos])
    return kNever;
  return last_trace_after_[pos];
}

// A chunk spanning two units (their parameters meet inside it) or holding a tied weight is
// used again in the same backward by an earlier unit of the trace; releasing it as if its next
// use were after the step would drop it and gather it again at once.
int64_t UnitCoordinator::BackwardReuseDistance(int64_t c) const {
  int64_t distance = 0;
  for (size_t k = trace_.size(); k-- > 0;) {
    const Unit& unit = units_[trace_[k]];
    if (unit.grads_pending == 0) continue;  // its backward is done
    if (std::find(unit.chunks.begin(), unit.chunks.end(), c) != unit.chunks.end()) return distance;
    distance += unit.elems;
  }
  return kNever;
}

void UnitCoordinator::VisitNear(
    size_t pos, int direction,
    const std::function<bool(int64_t unit, int64_t distance)>& visit) const {
  const std::vector<int64_t>& trace = direction > 0 ? last_trace_ : trace_;
  const auto n = static_cast<int64_t>(trace.size());
  const auto p = static_cast<int64_t>(pos);
  for (int64_t k = p + direction; k >= 0 && k < n; k += direction)
    if (!visit(trace[k], std::abs(k - p))) return;
}

std::vector<int64_t> UnitCoordinator::ChunkOrder(
    const std::vector<int64_t>& trace, int64_t num_chunks,
    const std::function<bool(int64_t chunk)>& stays_gathered) const {
  std::vector<int64_t> order;
  std::vector<bool> seen(static_cast<size_t>(num_chunks), false);
  auto add = [&](int64_t u) {
    for (int64_t c : units_[u].chunks)
      if (!seen[c]) {
        seen[c] = true;
        order.push_back(c);
      }
  };
  for (int64_t u = 0; u < size(); ++u)
    if (units_[u].always_live) add(u);
  for (int64_t c = 0; c < num_chunks; ++c)
    if (!seen[c] && stays_gathered(c)) {
      seen[c] = true;
      order.push_back(c);
    }
  for (int64_t u : trace) add(u);
  for (int64_t c = 0; c < num_chunks; ++c)
    if (!seen[c]) order.push_back(c);
  return order;
}

}  // namespace strata
