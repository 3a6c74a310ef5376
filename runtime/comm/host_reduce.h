// Element-wise reduction of host buffers, for backends whose transport moves bytes but cannot
// reduce a dtype (Gloo's reduce-scatter is built from an all-to-all plus this).
//
// bf16 and fp16 are accumulated in fp32 and rounded once (round to nearest even), so the result
// of a sum over N inputs is at least as exact as N-1 chained 16-bit additions. Integers
// accumulate in their own type (wrapping like the transport would). kAvg divides the sum by
// `n_inputs` (integer division for integer types).
// Thread-safe: pure functions over caller-owned memory.
#pragma once

#include <cstdint>

#include "runtime/comm/communicator.h"

namespace strata {

// dst[i] = op over k of inputs[k][i], for i < count. dst may alias any input.
void ReduceHostBuffers(const void* const* inputs, int n_inputs, void* dst, int64_t count,
                       DType dtype, ReduceOp op);

// dst[i] = dst[i] / divisor (the averaging step for transports that can only sum).
void DivideHostBuffer(void* buf, int64_t count, DType dtype, int divisor);

// Conversions used by the reduction and by tests (round to nearest even, NaN preserved).
float Bf16ToFloat(uint16_t bits);
uint16_t FloatToBf16(float value);
float Fp16ToFloat(uint16_t bits);
uint16_t FloatToFp16(float value);

}  // namespace strata
