#include "runtime/state/param_groups.h"

#include <algorithm>
#include <cmath>

#include "runtime/base/status.h"

namespace strata {

Status ValidateGroup(const GroupHyperparameters& g, int index) {
  auto bad = [&](const char* what, double v, const char* rule) {
    return InvalidArgument(StrCat("parameter group ", index, ": ", what, "=", v, " ", rule));
  };
  if (!std::isfinite(g.lr) || g.lr < 0) return bad("lr", g.lr, "must be finite and >= 0");
  if (!std::isfinite(g.eps) || g.eps < 0) return bad("eps", g.eps, "must be finite and >= 0");
  if (!std::isfinite(g.weight_decay) || g.weight_decay < 0)
    return bad("weight_decay", g.weight_decay, "must be finite and >= 0");
  if (!std::isfinite(g.momentum) || g.momentum < 0)
    return bad("momentum", g.momentum, "must be finite and >= 0");
  if (!std::isfinite(g.dampening) || g.dampening < 0)
    return bad("dampening", g.dampening, "must be finite and >= 0");
  if (!(g.beta1 >= 0 && g.beta1 < 1)) return bad("betas[0]", g.beta1, "must be in [0, 1)");
  if (!(g.beta2 >= 0 && g.beta2 < 1)) return bad("betas[1]", g.beta2, "must be in [0, 1)");
  return Status::Ok();
}

std::vector<ShardSegment> ShardSegments(const Partitioner& part, int64_t chunk, int rank,
                                        const std::vector<int>& group_of_param) {
  const ChunkInfo& ci = part.chunks()[chunk];
  const int64_t lo = part.ShardOffset(chunk, rank);
  const int64_t hi = lo + ci.shard_numel;
  // The parameters' ranges clipped to the shard, in chunk order.
  struct Range {
    int64_t begin, end;
    int group;
  };
  std::vector<Range> ranges;
  for (int64_t p : ci.params) {
    const ParamLocation& loc = part.location(p);
    const int64_t b = std::max(lo, loc.offset), e = std::min(hi, loc.offset + loc.numel);
    if (b < e) ranges.push_back({b - lo, e - lo, group_of_param[p]});
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  std::vector<ShardSegment> out;
  const int64_t n = ci.shard_numel;
  if (ranges.empty()) {  // all padding
    if (n > 0) out.push_back({0, n, 0});
    return out;
  }
  for (size_t i = 0; i < ranges.size(); ++i) {
    // Each segment runs to the next parameter's start (or the shard's end), so gaps join it.
    const int64_t begin = i == 0 ? 0 : ranges[i].begin;
    const int64_t end = i + 1 < ranges.size() ? ranges[i + 1].begin : n;
    if (!out.empty() && out.back().group == ranges[i].group) {
      out.back().size = end - out.back().begin;
    } else {
      out.push_back({begin, end - begin, ranges[i].group});
    }
  }
  return out;
}

}  // namespace strata
