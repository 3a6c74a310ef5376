#include "runtime/engine/lane_trace.h"

#include <algorithm>

namespace strata {

const char* LaneName(Lane lane) {
  switch (lane) {
    case Lane::kCompute: return "compute";
    case Lane::kWait: return "compute waits";
    case Lane::kCopy: return "copy";
    case Lane::kComm: return "comm";
    case Lane::kNvme: return "nvme";
    case Lane::kOptimizer: return "optimizer";
  }
  return "?";
}

void LaneTrace::Add(Lane lane, const char* name, Clock::time_point begin, Clock::time_point end,
                    int64_t step, int64_t chunk) {
  if (!armed()) return;
  MutexLock l(&mu_);
  spans_.push_back({lane, name, begin, end, step, chunk});
}

nlohmann::json LaneTrace::ToJson() const {
  MutexLock l(&mu_);
  nlohmann::json events = nlohmann::json::array();
  // Track names and their order (tid = lane), so the viewer shows compute first.
  for (int k = 0; k < kNumLanes; ++k) {
    events.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", 0}, {"tid", k},
                      {"args", {{"name", LaneName(static_cast<Lane>(k))}}}});
    events.push_back({{"ph", "M"}, {"name", "thread_sort_index"}, {"pid", 0}, {"tid", k},
                      {"args", {{"sort_index", k}}}});
  }
  events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", 0},
                    {"args", {{"name", "strata engine"}}}});
  Clock::time_point origin = Clock::time_point::max();
  for (const Span& s : spans_) origin = std::min(origin, s.begin);
  auto us = [&](Clock::time_point t) {
    return std::chrono::duration<double, std::micro>(t - origin).count();
  };
  for (const Span& s : spans_) {
    nlohmann::json args = nlohmann::json::object();
    if (s.step >= 0) args["step"] = s.step;
    if (s.chunk >= 0) args["chunk"] = s.chunk;
    events.push_back({{"ph", "X"}, {"name", s.name}, {"pid", 0},
                      {"tid", static_cast<int>(s.lane)}, {"ts", us(s.begin)},
                      {"dur", us(s.end) - us(s.begin)}, {"args", std::move(args)}});
  }
  return {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
}

size_t LaneTrace::size() const {
  MutexLock l(&mu_);
  return spans_.size();
}

void LaneTrace::Clear() {
  MutexLock l(&mu_);
  spans_.clear();
}

}  // namespace strata
