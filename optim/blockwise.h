// How the element-wise CPU optimizers (SGD, Adagrad, Lion) run one flat update: the ISA's block
// function over [0, n) in blocks of `grain` elements on oneTBB, each block followed by its
// 16-bit copy while the block is still in cache. Adam has its own driver (cpu_adam.cc): it
// also checks gradients and keeps bf16 states.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include "optim/cpu_adam.h"
#include "optim/dtype.h"
#include "runtime/base/status.h"

namespace strata::optim {

// How an element-wise optimizer call runs.
struct ElementwiseOptions {
  Isa isa = Isa::kAuto;
  tbb::task_arena* arena = nullptr;  // null: the caller's current arena
  size_t grain = 0;                  // elements per task; 0: 64 Ki
};

namespace internal {

inline constexpr size_t kDefaultBlockGrain = size_t{64} << 10;

// The ISA to run: `requested`, or the best this CPU has for kAuto. INVALID_ARGUMENT naming the
// optimizer when this CPU cannot run the requested one.
inline StatusOr<Isa> ChooseIsa(Isa requested, const char* optimizer) {
  const Isa isa = requested == Isa::kAuto ? ResolveAutoIsa() : requested;
  if (!IsaSupported(isa))
    return InvalidArgument(StrCat(optimizer, " isa=", IsaName(isa), ": this CPU does not support it"));
  return isa;
}

// One of the three block functions by ISA (the avx512 one serves avx512_bf16 too).
template <class Fn>
Fn PickBlock(Isa isa, Fn scalar, Fn avx2, Fn avx512) {
  return isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16 ? avx512 : isa == Isa::kAvx2 ? avx2 : scalar;
}

// dst[i] = src[i] rounded to nearest even as bf16 or fp16.
inline void StoreParam16(const float* src, void* dst, DType dtype, size_t n) {
  auto* d = static_cast<uint16_t*>(dst);
  if (dtype == DType::kBFloat16) {
    for (size_t i = 0; i < n; ++i) d[i] = FloatToBf16(src[i]);
  } else {
    for (size_t i = 0; i < n; ++i) d[i] = FloatToHalf(src[i]);
  }
}

// Calls body(begin, end) for consecutive blocks covering [0, n): inline for one block, else on
// oneTBB (static partition, so each worker streams one contiguous range) inside `arena` when
// given. Blocks until every block is done.
template <class Body>
void ForEachBlock(size_t n, size_t grain, tbb::task_arena* arena, const Body& body) {
  if (grain == 0) grain = kDefaultBlockGrain;
  const size_t blocks = (n + grain - 1) / grain;
  if (blocks <= 1) {
    if (n > 0) body(size_t{0}, n);
    return;
  }
  auto run = [&] {
    tbb::parallel_for(tbb::blocked_range<size_t>(0, blocks, 1),
                      [&](const tbb::blocked_range<size_t>& r) {
                        body(r.begin() * grain, std::min(n, r.end() * grain));
                      },
                      tbb::static_partitioner());
  };
  if (arena != nullptr) {
    arena->execute(run);
  } else {
    run();
  }
}

}  // namespace internal
}  // namespace strata::optim
