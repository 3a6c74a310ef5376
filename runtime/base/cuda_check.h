// The one way CUDA calls report errors, for every floor that makes them (the CUDA device and host
// allocator in tiers/, the NCCL communicator in runtime/comm/, the kernels): a Status naming the
// call, out of memory as RESOURCE_EXHAUSTED, with CUDA's sticky error cleared so that one failed
// call does not poison every later one. Included only by files compiled with CUDA.
#pragma once

#include <cuda_runtime_api.h>

#include "runtime/base/status.h"

namespace strata {

inline Status CudaToStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  (void)cudaGetLastError();  // clear the sticky error so later calls are judged on their own
  StatusCode code = err == cudaErrorMemoryAllocation ? StatusCode::kResourceExhausted
                    : err == cudaErrorInvalidValue   ? StatusCode::kInvalidArgument
                    : err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver
                        ? StatusCode::kUnavailable
                        : StatusCode::kInternal;
  return Status(code, StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

}  // namespace strata

#define STRATA_CUDA_RETURN_IF_ERROR(call) \
  STRATA_RETURN_IF_ERROR(::strata::CudaToStatus((call), #call))
